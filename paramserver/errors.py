"""Exception tree of paramserver; every class knows its gRPC status code.

::

    ParamServerError                      (INTERNAL)
    ├── InvalidArgument                   (INVALID_ARGUMENT)
    │   ├── MalformedStream               frames missing / duplicated / out of order / wrong size
    │   ├── DimensionMismatch             dtype or shape disagrees with the key's
    │   │   └── DTypeMismatch             the shape fits, the dtype does not (e.g. float64)
    │   ├── NonFiniteGradient             NaN/Inf in a gradient (default policy)
    │   └── ValueOutOfRange               an update whose result overflows the key's dtype
    ├── KeyNotFound                       (NOT_FOUND)
    │   └── TableNotFound                 an embedding table not declared on the shard
    ├── FailedPrecondition                (FAILED_PRECONDITION)
    │   ├── WorkerNotFound                unknown, evicted or fenced worker id
    │   ├── StaleUpdate                   stale, future or duplicate step
    │   ├── ReadOnly                      a mutation sent to a read-only server (serve --read-only)
    │   ├── WrongShard                    table row ids that another shard owns
    │   └── StaleEpoch                    replication from a primary deposed by a newer epoch
    ├── AlreadyExists                     (ALREADY_EXISTS) a live worker name
    │   ├── KeyConflict                   a key re-declared with another dtype or shape
    │   └── TableConflict                 a table re-declared with another declaration
    ├── Aborted                           (ABORTED) BSP step aborted by the fail_fast policy
    ├── WaitTimeout                       (DEADLINE_EXCEEDED) a consistency wait ran out
    ├── ResourceExhausted                 (RESOURCE_EXHAUSTED) retryable back-pressure
    │   └── MessageTooLarge               gRPC's own refusal of a message over the receive limit
    ├── StorageFull                       (RESOURCE_EXHAUSTED) WAL/checkpoint disk full (ENOSPC)
    ├── CapacityExceeded                  (RESOURCE_EXHAUSTED) table memory budget, table count
    │                                     or process memory exhausted; nothing applied
    ├── Unavailable                       (UNAVAILABLE) server unreachable or shutting down
    │   ├── StorageError                  WAL/checkpoint I/O failed (EIO); see the message
    │   └── NotPrimary                    a shard replica that is not (or no longer) primary
    ├── Unauthenticated                   (UNAUTHENTICATED) missing or unknown bearer token
    └── PermissionDenied                  (PERMISSION_DENIED) the token's role may not call it

Only codes the gRPC library never produces by itself are used for refusals, so a client can
tell a refusal from a broken link; every refusal also names its class in the trailing metadata
``paramserver-error-class`` (:data:`ERROR_CLASS_METADATA_KEY`). RESOURCE_EXHAUSTED is the one
code gRPC itself also sends (a message over the receive limit): only a RESOURCE_EXHAUSTED whose
trailer says ``ResourceExhausted`` is back-pressure to retry; without the trailer it is
:class:`MessageTooLarge`, permanent. The server turns these into ``context.abort``
(see :func:`paramserver.server.transports.grpc_service.grpc_errors`); the client maps status codes
back with
:func:`from_rpc_error`.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Self

import grpc


@dataclass(frozen=True)
class OptionHint:
    """Advice that names an option, worded for each audience: the keyword argument in Python
    (``replace=True``), the flag on the command line (``--replace``).

    An error carries the Python wording in its message (what ``str(exc)`` shows a program) and
    the hint itself as ``exc.hint``; the command line swaps the wording for :meth:`cli` in one
    place (``paramserver.cli.main.error_line``).

    Attributes:
        keyword: The keyword argument, e.g. ``replace``.
        advice: The advice with ``{option}`` where the option goes, e.g. ``pass {option} to
            fence that registration``.
        value: The keyword's value in the Python wording.
        flag: The command-line flag; default ``--`` and the keyword with dashes.
    """

    keyword: str
    advice: str
    value: str = "True"
    flag: str = ""

    def python(self) -> str:
        """The advice naming the keyword argument (``pass replace=True to ...``)."""
        return self.advice.format(option=f"{self.keyword}={self.value}")

    def cli(self) -> str:
        """The advice naming the flag (``pass --replace to ...``)."""
        return self.advice.format(option=self.flag or "--" + self.keyword.replace("_", "-"))


class ParamServerError(Exception):
    """Base of every paramserver error. Status code: INTERNAL.

    Attributes:
        message: What went wrong (with the Python wording of ``hint``, when there is one).
        hint: Advice that names an option (:class:`OptionHint`), or None.
    """

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    retryable: bool = False
    hint: OptionHint | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def with_hint(self, hint: OptionHint) -> Self:
        """The same error (class, status code) with ``hint``'s Python wording appended to the
        message and ``hint`` attached; raise it ``from`` this one."""
        out = type(self)(f"{self.message}; {hint.python()}")
        out.code = self.code
        out.hint = hint
        return out


class InvalidArgument(ParamServerError):
    """Bad input: wrong dtype/shape, malformed frames, bad config. INVALID_ARGUMENT."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class MalformedStream(InvalidArgument):
    """A tensor stream whose frames are missing, duplicated, out of order or mis-sized."""


class DimensionMismatch(InvalidArgument):
    """A tensor whose dtype, shape or width disagrees with the key's declaration."""


class DTypeMismatch(DimensionMismatch):
    """A gradient of the key's shape but another dtype (numpy's default float64 for a float32
    key, say). INVALID_ARGUMENT (trailer ``DTypeMismatch``); cast on the client."""


class NonFiniteGradient(InvalidArgument):
    """A gradient holding NaN or Inf, refused under the default policy."""


class ValueOutOfRange(InvalidArgument):
    """An update whose finite result lies outside the storage dtype's range (e.g. above
    float16's 65504): refused, nothing applied, instead of storing Inf."""


class KeyNotFound(ParamServerError):
    """A key that was never declared with ``init``. NOT_FOUND."""

    code = grpc.StatusCode.NOT_FOUND


class TableNotFound(KeyNotFound):
    """An embedding table not declared (``InitTable``) on the shard asked. NOT_FOUND (trailer
    ``TableNotFound``); names the table."""


class FailedPrecondition(ParamServerError):
    """The request is well-formed but the cluster state refuses it. FAILED_PRECONDITION."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class WorkerNotFound(FailedPrecondition):
    """Unknown, evicted, departed or fenced worker id. FAILED_PRECONDITION."""


class StaleUpdate(FailedPrecondition):
    """An update for a step that is stale, in the future, or already contributed."""


class WrongShard(FailedPrecondition):
    """Row ids sent to a shard that does not own them (a row of id i lives on shard
    ``hash64(table, i) mod S``). FAILED_PRECONDITION (trailer ``WrongShard``); names the
    table, the shard's index, the shard count and an offending id; nothing applied. The
    product's clients route every id to its owner, so this means a misrouting client or a
    shard map out of date (a resharded cluster)."""


class ReadOnly(FailedPrecondition):
    """A mutation (register, leave, clock, init, push, a table declaration or row push) sent to
    a read-only server (``paramserver serve --read-only --from-export DIR``), which serves
    pulls only. FAILED_PRECONDITION (trailer ``ReadOnly``; not retried); nothing changed. Read
    from such a server with a client that does not register (``register=False``)."""


class StaleEpoch(FailedPrecondition):
    """A shard replica refused a replication stream from a primary whose epoch is older than
    one it has seen: that primary was deposed, and nothing it sends is acknowledged."""


class AlreadyExists(ParamServerError):
    """A worker name that is already registered and live. ALREADY_EXISTS."""

    code = grpc.StatusCode.ALREADY_EXISTS


class KeyConflict(AlreadyExists):
    """An ``init`` of an existing key with another dtype or shape; names both declarations.
    ALREADY_EXISTS (trailer ``KeyConflict``). Nothing of the init was applied."""


class TableConflict(AlreadyExists):
    """An ``InitTable`` of an existing table with another declaration; names both.
    ALREADY_EXISTS (trailer ``TableConflict``). Nothing was changed."""


class Aborted(ParamServerError):
    """A BSP step aborted by the ``fail_fast`` worker-death policy. ABORTED."""

    code = grpc.StatusCode.ABORTED


class WaitTimeout(ParamServerError):
    """A consistency wait that ran past its deadline; names whom it waited for."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class ResourceExhausted(ParamServerError):
    """Back-pressure: too many in-flight requests or bytes. Retryable."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    retryable = True


class MessageTooLarge(ResourceExhausted):
    """A message over the peer's receive limit, refused by gRPC itself (no paramserver trailer).

    Permanent: the same message is refused again. Split tensors into frames of at most
    ``tensor.CHUNK_BYTES`` (the product's clients always do)."""

    retryable = False


class StorageFull(ParamServerError):
    """The server's write-ahead log or checkpoint disk is full (ENOSPC, EDQUOT).

    RESOURCE_EXHAUSTED with the trailer ``StorageFull``. Nothing of the request was applied.
    Not retried by the product's clients: an operator must free space (the message names the
    path)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class CapacityExceeded(ParamServerError):
    """The request needs more than the shard has room for: its table memory budget
    (``--table-memory-bytes``), its table count (``--table-max-tables``), or memory the process
    could not get (a MemoryError).

    RESOURCE_EXHAUSTED with the trailer ``CapacityExceeded``. Nothing of the request was
    applied or logged. Not retried by the product's clients: the same request needs the same
    room (raise the budget, add shards, or expire rows)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ParamServerError):
    """The server cannot be reached or is shutting down. Retryable."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class StorageError(Unavailable):
    """The write-ahead log or a checkpoint could not be written or synced (EIO and other I/O
    errors), or the log failed earlier and the server accepts no more mutations until it is
    restarted. UNAVAILABLE (retryable: a restarted server replays its log, and a retried push
    is still applied once)."""


class NotPrimary(Unavailable):
    """This shard replica does not hold the primary role (a backup, or a primary deposed
    under a newer epoch): it neither applies nor serves client calls. UNAVAILABLE
    (retryable: a client that knows the shard's replicas retries at the primary)."""


#: errno values that mean "out of space" (ENOSPC; EDQUOT where the platform has it).
_NO_SPACE = frozenset(
    e for e in (getattr(errno, "ENOSPC", None), getattr(errno, "EDQUOT", None)) if e is not None
)


def storage_error(exc: OSError, what: str) -> ParamServerError:
    """The refusal for an I/O failure while making a request durable.

    Args:
        exc: The OSError raised by the write, fsync or rename.
        what: What failed, naming the path (e.g. ``"write-ahead log /data/wal"``).

    Returns:
        :class:`StorageFull` for ENOSPC/EDQUOT, :class:`StorageError` otherwise.
    """
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    name = errno.errorcode.get(exc.errno or 0, "OSError")
    if exc.errno in _NO_SPACE:
        return StorageFull(f"{what}: {name} ({reason}); free disk space, then retry")
    return StorageError(f"{what}: {name} ({reason})")


class Unauthenticated(ParamServerError):
    """No bearer token, or one the server does not know. UNAUTHENTICATED."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ParamServerError):
    """A valid token whose role may not call this RPC (a worker token on an admin RPC).
    PERMISSION_DENIED."""

    code = grpc.StatusCode.PERMISSION_DENIED


_BY_CODE: dict[grpc.StatusCode, type[ParamServerError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: KeyNotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.DEADLINE_EXCEEDED: WaitTimeout,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


#: Trailing-metadata key carrying the exact error class name from server to client.
ERROR_CLASS_METADATA_KEY = "paramserver-error-class"

#: Initial-metadata key a server sends the moment it refuses a client stream (Push, Init)
#: that the client is still writing: ``"<ErrorClass> <STATUS_CODE>"``. A client that sees it
#: stops writing and half-closes, and then receives the refusal's status at once (the server
#: sends it when the client's stream ends, so no write races the status: grpc/grpc#36066).
REFUSAL_METADATA_KEY = "paramserver-refusal"


def _all_subclasses(cls: type[ParamServerError]) -> dict[str, type[ParamServerError]]:
    out = {cls.__name__: cls}
    for sub in cls.__subclasses__():
        out.update(_all_subclasses(sub))
    return out


#: Appended to a connection that closed or failed during the TLS handshake.
TLS_MISMATCH_HINT = (
    " (TLS mismatch? the server may require TLS (--tls-ca) or a client certificate "
    "(--tls-cert/--tls-key), or may not speak TLS at all)"
)


def _handshake_hint(code: grpc.StatusCode, details: str) -> str:
    """:data:`TLS_MISMATCH_HINT` when a connection never came up because the peer closed it
    during connection setup or the TLS handshake failed (what a plain-text client meeting a TLS
    server, or the reverse, sees); else nothing."""
    if code != grpc.StatusCode.UNAVAILABLE or "failed to connect to all addresses" not in details:
        return ""
    lowered = details.lower()
    return TLS_MISMATCH_HINT if "socket closed" in lowered or "handshake" in lowered else ""


def error_class_of(trailing: object) -> str | None:
    """The class name a paramserver server put in the ``paramserver-error-class`` trailer of
    a failed call, or None (the status came from gRPC itself, or from another server)."""
    for key, value in trailing or ():  # type: ignore[attr-defined]
        if key == ERROR_CLASS_METADATA_KEY:
            return str(value)
    return None


def from_rpc_error(err: grpc.RpcError) -> ParamServerError:
    """Map a failed RPC to the matching :class:`ParamServerError` (the client funnel).

    The status code picks the class; when the server named a more specific class of the same
    code in trailing metadata (``paramserver-error-class``), that class is used. A connection
    that failed during setup or the TLS handshake gets :data:`TLS_MISMATCH_HINT`. Callers
    ``raise from_rpc_error(e) from e`` so the original status stays attached.
    """
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _BY_CODE.get(code, ParamServerError)
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    named_class = error_class_of(trailing)
    if named_class is not None:
        named = _all_subclasses(ParamServerError).get(named_class)
        if named is not None and named.code == code:
            cls = named
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        cls = MessageTooLarge  # gRPC's own refusal (a message over the receive limit)
    details = f"{details}{_handshake_hint(code, str(details))}"
    exc = cls(f"{code.name}: {details}" if cls is ParamServerError else details)
    exc.code = code
    return exc
