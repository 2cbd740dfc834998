"""Bearer-token authentication of every paramserver server and client: the token file, the
role of every RPC, the server interceptor that checks them, and the per-worker identity.

**Token file** (servers): one ``ROLE TOKEN`` pair per line, ``#`` starts a comment, blank lines
are ignored; roles are ``worker`` and ``admin`` (admin implies worker); a role may have several
tokens (rotation); a token is at least :data:`MIN_TOKEN_CHARS` characters without whitespace::

    # role   token
    worker   6d1f0c...   (e.g. python -c "import secrets; print(secrets.token_urlsafe(32))")
    admin    b83a9e...

**Roles.** Every RPC of every paramserver service is classified in :data:`RPC_ROLES`; an RPC
missing from that table is refused for everyone (PERMISSION_DENIED), so a new RPC cannot slip
through unclassified. Admin RPCs: ``ParameterServer/Checkpoint`` (the on-demand checkpoint) and
the rank server's ``ImportMetadata`` / ``ForgetRemote`` (they rewire which peers a rank reads and
writes). The wire has no restore or shutdown RPC (restore happens on start, shutdown by signal).
Everything else is a worker RPC. The standard health service (``grpc.health.v1``) and server
reflection stay open without a token, as probes and tools expect; with TLS they still need the
handshake.

Missing or unknown token → UNAUTHENTICATED; a worker token on an admin RPC → PERMISSION_DENIED.
Tokens are compared with :func:`hmac.compare_digest`; refusals are logged at WARNING with the
method and the peer, never the token.

Tokens travel as ``authorization: Bearer <token>`` metadata: on a TLS channel as gRPC call
credentials (grpc sends those only over secure channels); on a plain-text channel by a client
interceptor. **A token without TLS crosses the network in clear text: use that only on loopback
or for testing.**
"""

from __future__ import annotations

import enum
import hmac
import inspect
import logging
import os
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TypeVar, cast

import grpc

from paramserver.errors import InvalidArgument, PermissionDenied
from paramserver.method_handlers import Behaviour, Handler, behaviour_of, same_shape

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Shortest token accepted in a token file (a guessable token is no authentication).
MIN_TOKEN_CHARS = 16
AUTHORIZATION_KEY = "authorization"


class Role(enum.IntEnum):
    """Who may call an RPC; a higher role implies every lower one (admin implies worker)."""

    WORKER = 1
    ADMIN = 2

    @classmethod
    def parse(cls, text: str) -> Role:
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(f"unknown role {text!r} (worker or admin)") from None


_PS = "/paramserver.api.v1.ParameterServer/"
_RS = "/paramserver.api.v1.ReductionService/"
_PEER = "/paramserver.api.v1.PushSumPeer/"
_RANK = "/paramserver.api.v1.RankServer/"
_REPL = "/paramserver.api.v1.Replication/"

#: The role each RPC needs, by full method name (``/package.Service/Method``). One table for
#: every service: an RPC missing from it is refused for everyone (see the module docstring).
RPC_ROLES: Mapping[str, Role] = MappingProxyType(
    {
        # ParameterServer: a worker's own session, its data path, and read-only views.
        _PS + "Register": Role.WORKER,  # replace=True fences a registration of the *same name*
        _PS + "Heartbeat": Role.WORKER,
        _PS + "Leave": Role.WORKER,
        _PS + "Init": Role.WORKER,
        _PS + "Push": Role.WORKER,
        _PS + "InitTable": Role.WORKER,
        _PS + "PullRows": Role.WORKER,
        _PS + "PushRows": Role.WORKER,
        _PS + "PullRowsMany": Role.WORKER,
        _PS + "PushRowsMany": Role.WORKER,
        _PS + "PushPullRows": Role.WORKER,
        _PS + "Pull": Role.WORKER,
        _PS + "Clock": Role.WORKER,
        _PS + "Session": Role.WORKER,  # persistent push/pull/clock stream (the worker fast path)
        _PS + "Status": Role.WORKER,
        _PS + "GetShardMap": Role.WORKER,
        _PS + "Checkpoint": Role.ADMIN,  # on-demand checkpoint: disk writes, WAL truncation
        # A shard's primary to its backups: it replaces a backup's whole state (the replicas
        # call each other with the first admin token of their shared token file).
        _REPL + "Replicate": Role.ADMIN,
        # ReductionService and the gossip workers' push-sum endpoints: worker traffic only.
        _RS + "Register": Role.WORKER,
        _RS + "Heartbeat": Role.WORKER,
        _RS + "Leave": Role.WORKER,
        _RS + "Reduce": Role.WORKER,
        _RS + "Peers": Role.WORKER,
        _RS + "Status": Role.WORKER,
        _PEER + "PushShare": Role.WORKER,
        # RankServer: rewiring the peers of a rank is admin; block traffic (also the peer-to-peer
        # ReadBlocks / WriteBlocks / CheckBlocks) is worker.
        _RANK + "ExportMetadata": Role.WORKER,
        _RANK + "ImportMetadata": Role.ADMIN,
        _RANK + "ForgetRemote": Role.ADMIN,
        _RANK + "LocalTransfer": Role.WORKER,
        _RANK + "RemoteOnboard": Role.WORKER,
        _RANK + "RemoteOffload": Role.WORKER,
        _RANK + "HasObjects": Role.WORKER,
        _RANK + "PutBlocks": Role.WORKER,
        _RANK + "GetBlocks": Role.WORKER,
        _RANK + "PutObject": Role.WORKER,
        _RANK + "GetObject": Role.WORKER,
        _RANK + "ReadBlocks": Role.WORKER,
        _RANK + "WriteBlocks": Role.WORKER,
        _RANK + "CheckBlocks": Role.WORKER,
        _RANK + "Status": Role.WORKER,
    }
)

#: Services that answer without a token: health probes and server reflection (standard practice:
#: orchestrators and tools probe them unauthenticated; they reveal no parameters).
OPEN_SERVICES = (
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
)


def _read_file(path: str, what: str) -> bytes:
    """The bytes of ``path``; a missing, unreadable or empty file is an InvalidArgument naming
    the path and the setting it came from."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"{what}: cannot read {path!r}: {exc.strerror or exc}") from None
    if not data.strip():
        raise InvalidArgument(f"{what}: {path!r} is empty")
    return data


def _warn_if_shared(path: str, what: str) -> None:
    """A secret readable by others, or by a group this process is not in, is worth a warning
    (not a refusal: secrets mounted by orchestrators are often 0444 inside a private
    container). Readable by this process's own group is not: Kubernetes mounts a 0400 Secret
    as 0440 owned by the pod's ``fsGroup``, a group of the pod's own processes."""
    try:
        st = os.stat(path)
    except OSError:
        return
    mine = {os.getegid(), *os.getgroups()}
    if st.st_mode & stat.S_IROTH or (st.st_mode & stat.S_IRGRP and st.st_gid not in mine):
        logger.warning("%s %s is readable by other users; chmod 600 it", what, path)


def _check_metadata_token(token: str, where: str) -> None:
    """gRPC metadata values are printable ASCII: a token with other characters can never be
    sent (grpc would fail every call), so it is refused when loaded.

    Raises:
        InvalidArgument: naming ``where`` (the flag, variable or file), never the token.
    """
    if not all(0x21 <= ord(c) <= 0x7E for c in token):
        raise InvalidArgument(
            f"{where}: a bearer token must be printable ASCII without spaces (gRPC metadata); "
            "this one has other characters"
        )


# --------------------------------------------------------------------------- tokens
def _lookup(pairs: Sequence[tuple[str, T]], token: str) -> T | None:
    """The value paired with ``token``, comparing with :func:`hmac.compare_digest` against
    every entry (no early exit on a match, so the time does not tell which one matched)."""
    given = token.encode("utf-8", "surrogatepass")
    found: T | None = None
    for known, value in pairs:
        if hmac.compare_digest(given, known.encode("utf-8")) and found is None:
            found = value
    return found


@dataclass(frozen=True)
class TokenTable:
    """The tokens a server accepts and the role of each.

    Attributes:
        entries: ``(token, role)`` pairs (tokens unique).
    """

    entries: tuple[tuple[str, Role], ...]
    #: ``(token, worker name)`` of the tokens bound to one worker name (third field of a
    #: ``worker`` line); such a token may only make calls naming that worker.
    bound: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.entries:
            raise InvalidArgument("a token table needs at least one token")
        known = {token for token, _ in self.entries}
        roles = dict(self.entries)
        for token, name in self.bound:
            if token not in known or not name:
                raise InvalidArgument("a bound worker name needs its token in the table")
            if roles[token] is not Role.WORKER:
                raise InvalidArgument("only worker tokens can be bound to a worker name")
        seen: set[str] = set()
        for token, _role in self.entries:
            if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
                raise InvalidArgument(
                    f"tokens must be >= {MIN_TOKEN_CHARS} characters without whitespace"
                )
            _check_metadata_token(token, "a token")
            if token in seen:
                raise InvalidArgument("a token is listed twice")
            seen.add(token)

    def first_admin(self) -> str | None:
        """The first admin token (what a server presents to its peers), or None."""
        return next((token for token, role in self.entries if role is Role.ADMIN), None)

    def __repr__(self) -> str:  # never print the secrets
        roles = [r.name.lower() for _, r in self.entries]
        return f"TokenTable({len(roles)} tokens: {', '.join(sorted(set(roles)))})"

    @classmethod
    def parse(cls, text: str, source: str = "token file") -> TokenTable:
        """Parse ``ROLE TOKEN`` lines (``#`` comments, blank lines ignored).

        Raises:
            InvalidArgument: a malformed line (named by number, the token never shown), an
                unknown role, a short or duplicate token, or no token at all.
        """
        entries: list[tuple[str, Role]] = []
        bound: list[tuple[str, str]] = []
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) not in (2, 3):
                raise InvalidArgument(
                    f"{source} line {number}: expected 'ROLE TOKEN' or 'worker TOKEN NAME' "
                    f"(2 or 3 fields), got {len(parts)}"
                )
            try:
                role = Role.parse(parts[0])
            except ValueError as exc:
                raise InvalidArgument(f"{source} line {number}: {exc}") from None
            if len(parts) == 3:
                if role is not Role.WORKER:
                    raise InvalidArgument(
                        f"{source} line {number}: only worker tokens take a worker name"
                    )
                bound.append((parts[1], parts[2]))
            entries.append((parts[1], role))
        if not entries:
            raise InvalidArgument(f"{source}: no 'ROLE TOKEN' line")
        try:
            return cls(tuple(entries), tuple(bound))
        except InvalidArgument as exc:
            raise InvalidArgument(f"{source}: {exc.message}") from None

    @classmethod
    def from_file(cls, path: str) -> TokenTable:
        """Read a token file (see :meth:`parse`).

        Raises:
            InvalidArgument: unreadable or malformed file (the path named).
        """
        data = _read_file(path, "--auth-tokens")
        _warn_if_shared(path, "auth tokens file")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument(f"--auth-tokens: {path!r} is not UTF-8 text") from None
        return cls.parse(text, f"--auth-tokens {path!r}")

    def role_of(self, token: str) -> Role | None:
        """The role of ``token``, or None when unknown. Compares with
        :func:`hmac.compare_digest` against every entry (no early exit on a match)."""
        return _lookup(self.entries, token)

    def worker_name_of(self, token: str) -> str | None:
        """The worker name ``token`` is bound to, or None (a role-only token, or unknown).
        Compares with :func:`hmac.compare_digest` against every bound entry."""
        return _lookup(self.bound, token)


#: The worker name the calling token is bound to, while a handler serves that call (None: a
#: role-only token, an admin token, or no token check). Set by :class:`TokenAuthInterceptor`.
CALLER_WORKER_NAME: ContextVar[str | None] = ContextVar(
    "paramserver_caller_worker_name", default=None
)


def worker_name_of_id(worker: str) -> str:
    """The worker name of a worker id ``"{name}#{incarnation}"`` (a name is returned as is)."""
    name, sep, incarnation = worker.rpartition("#")
    return name if sep and incarnation.isdigit() else worker


def check_worker_identity(worker: str) -> None:
    """Refuse a call naming ``worker`` (a worker name or id) unless the calling token may act
    as it: a token bound to a worker name acts only as that worker; role-only and admin tokens
    (and servers without tokens) act as any worker.

    Raises:
        PermissionDenied: the token is bound to another worker name (PERMISSION_DENIED).
    """
    bound = CALLER_WORKER_NAME.get()
    if bound is None or not worker:
        return
    name = worker_name_of_id(worker)
    if name != bound:
        raise PermissionDenied(
            f"this token is bound to worker {bound!r}; the call names worker {name!r}"
        )


def _bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key.lower() != AUTHORIZATION_KEY:
            continue
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return None
    return None


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks the bearer token of every RPC (unary and streaming) against a :class:`TokenTable`.

    Open services (:data:`OPEN_SERVICES`) pass without a token. Otherwise: no token or an unknown
    one → UNAUTHENTICATED; a role below the RPC's (:data:`RPC_ROLES`) → PERMISSION_DENIED; an
    RPC not in the table → PERMISSION_DENIED for everyone. A refused call never reaches its
    handler; the refusal is logged at WARNING with method and peer (never the token).

    Args:
        tokens: The accepted tokens and their roles.
        roles: RPC → required role (default :data:`RPC_ROLES`).
        on_refusal: Called with ``(method, status code name)`` for every refused call, e.g.
            ``("Push", "UNAUTHENTICATED")`` (``method``: the last part of the full method name);
            the servers count refusals in their Prometheus registry through it.
    """

    def __init__(
        self,
        tokens: TokenTable,
        roles: Mapping[str, Role] | None = None,
        on_refusal: Callable[[str, str], None] | None = None,
    ) -> None:
        self.tokens = tokens
        self.roles = dict(RPC_ROLES if roles is None else roles)
        self.on_refusal = on_refusal
        #: Calls refused so far, by status code name (for tests and humans).
        self.refused: dict[str, int] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        method = str(handler_call_details.method)
        service = method.lstrip("/").split("/", 1)[0]
        if service in OPEN_SERVICES:
            return await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata
        verdict = self._verdict(method, metadata)
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if verdict is None:
            token = _bearer_token(metadata)
            name = self.tokens.worker_name_of(token) if token is not None else None
            return handler if name is None else _with_identity(handler, name)
        return self._refusal(handler, method, *verdict)

    def _verdict(
        self, method: str, metadata: Sequence[tuple[str, str | bytes]] | None
    ) -> tuple[grpc.StatusCode, str] | None:
        token = _bearer_token(metadata)
        if token is None:
            return grpc.StatusCode.UNAUTHENTICATED, "missing bearer token (authorization metadata)"
        role = self.tokens.role_of(token)
        if role is None:
            return grpc.StatusCode.UNAUTHENTICATED, "unknown bearer token"
        needed = self.roles.get(method)
        if needed is None:
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method} is not classified for authorization; refused for every role",
            )
        if role < needed:
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method} needs the {needed.name.lower()} role; the token has {role.name.lower()}",
            )
        return None

    def _refusal(
        self, handler: Handler, method: str, code: grpc.StatusCode, detail: str
    ) -> Handler:
        """A handler of the same streaming kind as ``handler`` that logs and aborts."""

        async def refuse(
            _request: object, context: grpc.aio.ServicerContext[object, object]
        ) -> None:
            self.refused[code.name] = self.refused.get(code.name, 0) + 1
            if self.on_refusal is not None:
                self.on_refusal(method.rsplit("/", 1)[-1], code.name)
            logger.warning("refused %s from %s: %s: %s", method, context.peer(), code.name, detail)
            await context.abort(code, detail)

        return same_shape(handler, refuse)


def _with_identity(handler: Handler, name: str) -> Handler:
    """``handler`` with :data:`CALLER_WORKER_NAME` set to ``name`` while it runs."""
    behavior = behaviour_of(handler)
    wrapped: Behaviour
    if inspect.isasyncgenfunction(behavior):

        async def gen(request: object, context: object) -> AsyncIterator[object]:
            CALLER_WORKER_NAME.set(name)
            async for item in cast(AsyncIterator[object], behavior(request, context)):
                yield item

        wrapped = gen
    else:

        async def call(request: object, context: object) -> object:
            CALLER_WORKER_NAME.set(name)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result

        wrapped = call
    return same_shape(handler, wrapped)


def _token_of_file(path: str) -> str:
    """The token in a client token file: its first non-empty line.

    Raises:
        InvalidArgument: unreadable or empty file, or one that looks like a server's
            ``--auth-tokens`` file or holds more than a token on its line (the path named,
            never the content).
    """
    data = _read_file(path, "--token-file")
    _warn_if_shared(path, "token file")
    lines = [ln.strip() for ln in data.decode("utf-8", "replace").splitlines()]
    first = next(ln for ln in lines if ln)
    if first.startswith("#") or len(first.split()) > 1:
        fields = [ln.split() for ln in lines if ln and not ln.startswith("#")]
        server_file = any(len(f) == 2 and f[0].lower() in ("worker", "admin") for f in fields)
        raise InvalidArgument(
            f"--token-file {path!r}: a client token file holds one token on one line"
            + ("; this looks like a server --auth-tokens file" if server_file else "")
        )
    return first


class _BearerMetadata:
    """Adds ``authorization: Bearer <token>`` to the metadata of a call on a plain-text channel
    (grpc sends call credentials only over TLS). Loopback and testing only: the token travels
    in clear."""

    def __init__(self, token: str) -> None:
        self._pair = (AUTHORIZATION_KEY, f"Bearer {token}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(*self._pair)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


def _bearer_kind(base: type, method: str) -> type:
    """A :class:`_BearerMetadata` interceptor of one of grpc.aio's four call kinds."""

    async def intercept(
        self: _BearerMetadata,
        continuation: Callable[[grpc.aio.ClientCallDetails, object], Awaitable[object]],
        details: grpc.aio.ClientCallDetails,
        body: object,
    ) -> object:
        return await continuation(self._details(details), body)

    return type(f"_Bearer{base.__name__}", (_BearerMetadata, base), {method: intercept})


# grpc.aio files an interceptor under the first of the four kinds it is an instance of, so each
# kind needs an object of its own.
_BEARER_KINDS = tuple(
    _bearer_kind(base, f"intercept_{kind}")
    for base, kind in (
        (grpc.aio.UnaryUnaryClientInterceptor, "unary_unary"),
        (grpc.aio.UnaryStreamClientInterceptor, "unary_stream"),
        (grpc.aio.StreamUnaryClientInterceptor, "stream_unary"),
        (grpc.aio.StreamStreamClientInterceptor, "stream_stream"),
    )
)


def bearer_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors adding ``authorization: Bearer <token>`` to every call of a
    plain-text ``grpc.aio`` channel (unary and streaming)."""
    return [kind(token) for kind in _BEARER_KINDS]
