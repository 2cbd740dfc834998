"""TLS, mutual TLS and bearer-token authentication for every paramserver server and client.

Two frozen, validated dataclasses own the credentials:

* :class:`ServerSecurity` (``paramserver serve`` in both modes, ``paramserver rank-server``, the
  gossip workers' push-sum endpoints): a certificate and key turn TLS on; a CA as well turns on
  **mutual TLS** (``require_client_auth``: a client without a certificate signed by that CA fails
  the handshake); a token file turns on bearer-token authentication, checked by
  :class:`TokenAuthInterceptor` on every RPC.
* :class:`ClientSecurity` (workers and every other command that talks to a server): a CA to
  verify the server (TLS), a client certificate and key for mutual TLS, and the bearer token.

Precedence, as for :class:`~paramserver.server.config.ServerConfig`: command-line flag, then
``PARAMSERVER_*`` environment variable, then default (nothing: plain text, no token — the
behaviour of a loopback development cluster). The environment mapping is passed in, so tests
never touch ``os.environ``.

=====================  ================================  ==========================================
flag                   environment variable              meaning
=====================  ================================  ==========================================
``--tls-cert``         ``PARAMSERVER_TLS_CERT``          PEM certificate (chain) this side presents
``--tls-key``          ``PARAMSERVER_TLS_KEY``           PEM private key of that certificate
``--tls-ca``           ``PARAMSERVER_TLS_CA``            PEM CA bundle: clients verify the server
                                                         with it; a server given one requires and
                                                         verifies client certificates (mTLS)
``--tls-server-name``  ``PARAMSERVER_TLS_SERVER_NAME``   clients: name the server certificate must
                                                         carry when it differs from the address
``--auth-tokens``      ``PARAMSERVER_AUTH_TOKENS``       servers: the token file (below)
``--token-file``       ``PARAMSERVER_TOKEN_FILE``        clients: file holding the bearer token
(none)                 ``PARAMSERVER_TOKEN``             clients: the bearer token itself (used
                                                         when no token file is given)
=====================  ================================  ==========================================

Bearer tokens, the role of every RPC and the per-worker identity are
:mod:`paramserver.security.tokens`.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
import os
import socket
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc

from paramserver.errors import InvalidArgument, Unavailable
from paramserver.protocol.addresses import channel_target
from paramserver.protocol.keepalive import (
    CLIENT_KEEPALIVE_OPTIONS,
    ChannelOption,
    with_keepalive,
)
from paramserver.security.tokens import (
    Role,
    TokenAuthInterceptor,
    TokenTable,
    _check_metadata_token,
    _read_file,
    _token_of_file,
    _warn_if_shared,
    bearer_interceptors,
)

__all__ = [
    "ClientSecurity",
    "ServerSecurity",
    "bind",
    "bind_failure_reason",
    "client_security_from_args",
    "endpoint_security",
    "open_channel",
    "peer_security",
    "server_security_from_args",
    "token_from_sources",
]

logger = logging.getLogger(__name__)

ENV_PREFIX = "PARAMSERVER_"


# --------------------------------------------------------------------------- files
def _check_pem(data: bytes, path: str, what: str, marker: bytes) -> None:
    if b"-----BEGIN" not in data or marker not in data:
        raise InvalidArgument(f"{what}: {path!r} holds no PEM {marker.decode().strip()} block")


def _check_key_pair(cert_path: str, key_path: str, key: bytes, side: str) -> None:
    """Load the pair as TLS would (stdlib :mod:`ssl`), so a key that does not match its
    certificate, a broken PEM or a passphrase-protected key is refused when the files are read,
    not at the first handshake (where grpc reports only a failed bind or a closed socket).

    Raises:
        InvalidArgument: naming both paths (INVALID_ARGUMENT).
    """
    if b"ENCRYPTED" in key:  # PKCS#8 "ENCRYPTED PRIVATE KEY" or legacy "Proc-Type: 4,ENCRYPTED"
        raise InvalidArgument(
            f"--tls-key {key_path!r} is passphrase-protected; grpc needs an unencrypted key "
            "(e.g. openssl pkey -in KEY -out KEY.plain, then chmod 600)"
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # A password callback, so OpenSSL never prompts on the terminal.
        context.load_cert_chain(cert_path, key_path, password=lambda: b"")
    except ssl.SSLError as exc:
        reason = str(exc.reason or exc)
        if "KEY_VALUES_MISMATCH" in reason or "key values mismatch" in reason.lower():
            raise InvalidArgument(
                f"--tls-key {key_path!r} does not match --tls-cert {cert_path!r} ({side}: the "
                "private key must be the certificate's)"
            ) from None
        raise InvalidArgument(
            f"--tls-cert {cert_path!r} / --tls-key {key_path!r}: cannot load the pair "
            f"({side}): {reason}"
        ) from None
    except OSError as exc:
        raise InvalidArgument(
            f"--tls-cert {cert_path!r} / --tls-key {key_path!r}: {exc.strerror or exc}"
        ) from None


def _check_ca(path: str) -> None:
    """Load a CA bundle as TLS would (stdlib :mod:`ssl`).

    Raises:
        InvalidArgument: not loadable PEM certificates, the path named (INVALID_ARGUMENT).
    """
    try:
        ssl.create_default_context(cafile=path)
    except ssl.SSLError as exc:
        raise InvalidArgument(
            f"--tls-ca {path!r}: cannot load the CA certificates: {exc.reason or exc}"
        ) from None


# --------------------------------------------------------------------------- both sides
@dataclass(frozen=True)
class _PemFiles:
    """The certificate, key and CA bytes of a side, read and checked once when it is built."""

    _cert: bytes = dataclasses.field(default=b"", init=False, repr=False, compare=False)
    _key: bytes = dataclasses.field(default=b"", init=False, repr=False, compare=False)
    _ca: bytes = dataclasses.field(default=b"", init=False, repr=False, compare=False)

    def _load(
        self, cert: str | None, key: str | None, ca: str | None, side: str, *, warn: bool
    ) -> None:
        """Read and check ``cert``+``key`` (as ``side``, e.g. "server certificate") and ``ca``;
        ``warn``: log when the key file is readable by others."""
        if cert is not None and key is not None:
            cert_pem = _read_file(cert, "--tls-cert")
            key_pem = _read_file(key, "--tls-key")
            _check_pem(cert_pem, cert, "--tls-cert", b"CERTIFICATE")
            _check_pem(key_pem, key, "--tls-key", b"PRIVATE KEY")
            _check_key_pair(cert, key, key_pem, side)
            if warn:
                _warn_if_shared(key, "TLS key")
            object.__setattr__(self, "_cert", cert_pem)
            object.__setattr__(self, "_key", key_pem)
        if ca is not None:
            ca_pem = _read_file(ca, "--tls-ca")
            _check_pem(ca_pem, ca, "--tls-ca", b"CERTIFICATE")
            _check_ca(ca)
            object.__setattr__(self, "_ca", ca_pem)


# --------------------------------------------------------------------------- server side
@dataclass(frozen=True)
class ServerSecurity(_PemFiles):
    """TLS / mutual TLS and token authentication of one server.

    Attributes:
        tls_cert: PEM certificate (chain) the server presents; with ``tls_key`` turns TLS on.
        tls_key: PEM private key of ``tls_cert``.
        tls_ca: PEM CA bundle; given, the server requires client certificates signed by it
            (mutual TLS). Needs ``tls_cert``.
        auth_tokens: Token file path (``ROLE TOKEN`` lines); given, every RPC but health and
            reflection needs a bearer token (see the module docstring).
        tokens: The token table itself (instead of, or loaded from, ``auth_tokens``).

    Raises:
        InvalidArgument: a cert without a key (or the reverse), a CA without a cert, or a file
            that is missing, unreadable, empty or not PEM (the path named).
    """

    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    auth_tokens: str | None = None
    tokens: TokenTable | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidArgument("--tls-cert and --tls-key go together (server TLS needs both)")
        if self.tls_ca is not None and self.tls_cert is None:
            raise InvalidArgument(
                "--tls-ca on a server requires client certificates (mutual TLS) and needs the "
                "server's own --tls-cert and --tls-key"
            )
        self._load(self.tls_cert, self.tls_key, self.tls_ca, "server certificate", warn=True)
        if self.tokens is None and self.auth_tokens is not None:
            object.__setattr__(self, "tokens", TokenTable.from_file(self.auth_tokens))

    @classmethod
    def from_sources(
        cls, cli: Mapping[str, object] | None = None, env: Mapping[str, str] | None = None
    ) -> ServerSecurity:
        """CLI values (None = not given) over ``PARAMSERVER_TLS_*`` / ``PARAMSERVER_AUTH_TOKENS``
        in ``env`` over defaults (nothing)."""
        values = _pick(("tls_cert", "tls_key", "tls_ca", "auth_tokens"), cli, env)
        return cls(
            tls_cert=values.get("tls_cert"),
            tls_key=values.get("tls_key"),
            tls_ca=values.get("tls_ca"),
            auth_tokens=values.get("auth_tokens"),
        )

    @classmethod
    def of_config(cls, config: object) -> ServerSecurity | None:
        """The security of a server config with ``tls_cert``, ``tls_key``, ``tls_ca`` and
        ``auth_tokens`` attributes (e.g. :class:`~paramserver.server.config.ServerConfig`);
        None when none is set.

        Raises:
            InvalidArgument: see :class:`ServerSecurity`.
        """
        names = ("tls_cert", "tls_key", "tls_ca", "auth_tokens")
        values = {name: getattr(config, name, None) for name in names}
        if all(v is None for v in values.values()):
            return None
        return cls(**values)

    @property
    def tls(self) -> bool:
        """True when the server speaks TLS."""
        return bool(self._cert)

    @property
    def mutual_tls(self) -> bool:
        """True when the server requires client certificates."""
        return bool(self._ca)

    @property
    def enabled(self) -> bool:
        """True when anything is configured (TLS or tokens)."""
        return self.tls or self.tokens is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        """``grpc.ssl_server_credentials`` (``require_client_auth`` with a CA).

        Raises:
            InvalidArgument: TLS is not configured.
        """
        if not self.tls:
            raise InvalidArgument("server TLS is not configured (--tls-cert/--tls-key)")
        return grpc.ssl_server_credentials(
            [(self._key, self._cert)],
            root_certificates=self._ca or None,
            require_client_auth=self.mutual_tls,
        )

    def interceptors(
        self, on_refusal: Callable[[str, str], None] | None = None
    ) -> list[grpc.aio.ServerInterceptor]:
        """The token interceptor when tokens are configured (else none).

        Args:
            on_refusal: Told ``(method, status code name)`` of every refused call (see
                :class:`TokenAuthInterceptor`).
        """
        if self.tokens is None:
            return []
        return [TokenAuthInterceptor(self.tokens, on_refusal=on_refusal)]

    def describe(self) -> str:
        """A log-friendly summary (never a secret)."""
        parts = ["mutual TLS" if self.mutual_tls else "TLS" if self.tls else "plain text"]
        if self.tokens is not None:
            parts.append(f"{len(self.tokens.entries)} bearer tokens")
        return ", ".join(parts)


def bind(server: grpc.aio.Server, address: str, security: ServerSecurity | None) -> int:
    """Add a listening port: ``add_secure_port`` when TLS is configured, else insecure.

    Returns:
        The bound port.

    Raises:
        Unavailable: the address cannot be bound (in use, or not an address here) (UNAVAILABLE).
    """
    # A fixed port that a probe cannot bind fails in grpc too: refuse before grpc's C core
    # prints its own error lines (grpc stays the judge when the probe passes).
    error = _probe_bind(address)
    if error is None:
        try:
            if security is not None and security.tls:
                bound = int(server.add_secure_port(address, security.server_credentials()))
            else:
                bound = int(server.add_insecure_port(address))
        except RuntimeError:  # grpc raises RuntimeError("Failed to bind to address ...")
            bound = 0
        if bound:
            return bound
    raise Unavailable(f"could not bind {address}: {bind_failure_reason(address, error)}")


def _probe_bind(address: str) -> OSError | None:
    """The error of binding a probe socket to ``address`` (closed at once); None when it binds,
    the port is 0 or the address does not parse (left to grpc)."""
    host, _, port_text = address.rpartition(":")
    try:
        port = int(port_text)
    except ValueError:
        return None
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, sockaddr = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(sockaddr)
    except OSError as exc:  # socket.gaierror included
        return exc
    return None


def bind_failure_reason(address: str, error: OSError | None = None) -> str:
    """Why ``address`` (``host:port``) cannot be listened on, in a few words: ``address in
    use``, ``not an address of this machine``, or the OS's reason.

    grpc reports only "Failed to bind"; the reason comes from ``error`` when the caller has one,
    else from binding a probe socket to the address.
    """
    if error is None:
        error = _probe_bind(address)
    if error is None:
        return "in use, or not an address here"
    if error.errno == errno.EADDRINUSE:
        return "address in use"
    if error.errno == errno.EADDRNOTAVAIL or isinstance(error, socket.gaierror):
        return "not an address of this machine"
    if error.errno == errno.EACCES:
        return "permission denied (ports below 1024 need privileges)"
    return str(error.strerror or error)


# --------------------------------------------------------------------------- client side
@dataclass(frozen=True)
class ClientSecurity(_PemFiles):
    """How a client reaches a server: TLS (server verified by a CA), mutual TLS (plus a client
    certificate), and the bearer token.

    Attributes:
        tls_ca: PEM CA bundle that signed the server's certificate; given (or with a client
            certificate), the channel uses TLS. Without it, TLS verifies against the system
            roots.
        tls_cert: PEM client certificate (chain) for mutual TLS; needs ``tls_key``.
        tls_key: PEM private key of ``tls_cert``.
        tls_server_name: Name the server's certificate must carry, when the address used is
            not in it (``grpc.ssl_target_name_override``).
        token: The bearer token (never printed by ``repr``).
        token_file: File holding the token (its first non-empty line); read when ``token``
            is not given.
        tls: Use TLS; set by itself when ``tls_ca`` or ``tls_cert`` is given (True alone:
            TLS verified against the system's root certificates).

    Raises:
        InvalidArgument: a cert without a key (or the reverse), an empty or unreadable file
            (the path named), a token with whitespace inside.
    """

    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    token: str | None = dataclasses.field(default=None, repr=False)
    token_file: str | None = None
    tls: bool = False

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidArgument("--tls-cert and --tls-key go together (mutual TLS needs both)")
        self._load(self.tls_cert, self.tls_key, self.tls_ca, "client certificate", warn=False)
        if self.tls_ca is not None or self.tls_cert is not None:
            object.__setattr__(self, "tls", True)
        if self.tls_server_name is not None and not self.tls:
            raise InvalidArgument(
                "--tls-server-name needs TLS (--tls-ca): it names the server's certificate, "
                "and a plain-text channel has none"
            )
        where = "the bearer token (PARAMSERVER_TOKEN or token=)"
        if self.token is None and self.token_file is not None:
            where = f"--token-file {self.token_file!r}"
            object.__setattr__(self, "token", _token_of_file(self.token_file))
        if self.token is not None:
            if not self.token or any(c.isspace() for c in self.token):
                raise InvalidArgument(
                    f"{where}: a bearer token must be non-empty without whitespace"
                )
            _check_metadata_token(self.token, where)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientSecurity:
        """The security the CLI commands use, from ``PARAMSERVER_TLS_CA`` / ``_TLS_CERT`` /
        ``_TLS_KEY`` / ``_TLS_SERVER_NAME`` / ``_TOKEN_FILE`` / ``_TOKEN`` in ``env`` (default
        ``os.environ``), for Python code: ``connect(addr, name,
        security=ClientSecurity.from_env())``.

        Raises:
            InvalidArgument: see the class.
        """
        return cls.from_sources(None, os.environ if env is None else env)

    @classmethod
    def from_sources(
        cls, cli: Mapping[str, object] | None = None, env: Mapping[str, str] | None = None
    ) -> ClientSecurity:
        """CLI values (None = not given) over ``PARAMSERVER_*`` in ``env`` over defaults.

        The token: ``--token-file``, else ``PARAMSERVER_TOKEN_FILE``, else ``PARAMSERVER_TOKEN``.
        """
        names = ("tls_ca", "tls_cert", "tls_key", "tls_server_name", "token_file")
        values = _pick(names, cli, env)
        token = None
        if values.get("token_file") is None:
            given = (env or {}).get(ENV_PREFIX + "TOKEN")
            if given:
                token = given.strip()
        return cls(
            tls_ca=values.get("tls_ca"),
            tls_cert=values.get("tls_cert"),
            tls_key=values.get("tls_key"),
            tls_server_name=values.get("tls_server_name"),
            token_file=values.get("token_file"),
            token=token,
        )

    @property
    def enabled(self) -> bool:
        """True when anything is configured (TLS or a token)."""
        return self.tls or self.token is not None

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """``grpc.ssl_channel_credentials`` (client cert and key for mutual TLS), composed with
        the token's call credentials when a token is set."""
        creds = grpc.ssl_channel_credentials(
            root_certificates=self._ca or None,
            private_key=self._key or None,
            certificate_chain=self._cert or None,
        )
        if self.token is not None:
            creds = grpc.composite_channel_credentials(
                creds, grpc.access_token_call_credentials(self.token)
            )
        return creds

    def describe(self) -> str:
        """A log-friendly summary (never a secret)."""
        parts = ["mutual TLS" if self._cert else "TLS" if self.tls else "plain text"]
        if self.token is not None:
            parts.append("bearer token")
        return ", ".join(parts)


def endpoint_security(client: ClientSecurity | None) -> ServerSecurity | None:
    """The security of a worker's own endpoint that its peers call with the same settings as
    the worker uses (the gossip workers' push-sum endpoints): TLS with the worker's certificate
    and key, mutual TLS with its CA, and its own token accepted as a worker token (peers of one
    job share it).

    Raises:
        InvalidArgument: TLS without a certificate and key of the worker's own (an endpoint
            cannot serve TLS without them; pass its security explicitly instead).
    """
    if client is None or not client.enabled:
        return None
    if client.tls and (client.tls_cert is None or client.tls_key is None):
        raise InvalidArgument(
            "a TLS worker endpoint needs a certificate and key of its own (tls_cert, tls_key, "
            "valid for its host) or explicit endpoint security"
        )
    tokens = None
    if client.token is not None:
        tokens = TokenTable(((client.token, Role.WORKER),))
    if not client.tls:
        return ServerSecurity(tokens=tokens)
    return ServerSecurity(
        tls_cert=client.tls_cert, tls_key=client.tls_key, tls_ca=client.tls_ca, tokens=tokens
    )


def peer_security(
    server: ServerSecurity | None, token: str | None, tls_server_name: str | None = None
) -> ClientSecurity | None:
    """The client security a server uses towards its peers (rank servers): its own
    certificate and key as client certificate, its CA to verify them, and ``token``.

    A TLS server without a CA verifies its peers against the system roots.
    """
    tls = server is not None and server.tls
    if tls_server_name is not None and not tls:
        raise InvalidArgument(
            "--tls-server-name needs TLS (--tls-cert/--tls-key): it names the peers' certificate"
        )
    if not tls and token is None:
        return None
    if not tls or server is None:
        return ClientSecurity(token=token)
    return ClientSecurity(
        tls_ca=server.tls_ca,
        tls_cert=server.tls_cert,
        tls_key=server.tls_key,
        tls_server_name=tls_server_name,
        token=token,
        tls=True,
    )


def open_channel(
    address: str,
    security: ClientSecurity | None = None,
    options: Sequence[ChannelOption] = (),
) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``address`` as ``security`` says: secure (TLS / mutual TLS,
    token as call credentials), plain text with the token added by an interceptor (loopback
    and testing only), or plain text as before when nothing is configured.

    ``address`` may name a replicated shard's replicas, ``"h0:p0|h1:p1"``: calls then go to its
    primary (:func:`paramserver.protocol.addresses.channel_target`).

    Must be called inside the event loop that uses the channel.
    """
    address, routing = channel_target(address)  # a replicated shard: its primary
    opts = with_keepalive([*routing, *options], CLIENT_KEEPALIVE_OPTIONS)
    if security is None or not security.enabled:
        return grpc.aio.insecure_channel(address, options=opts)
    if security.tls:
        if security.tls_server_name:
            opts.append(("grpc.ssl_target_name_override", security.tls_server_name))
        return grpc.aio.secure_channel(address, security.channel_credentials(), options=opts)
    assert security.token is not None
    return grpc.aio.insecure_channel(
        address, options=opts, interceptors=bearer_interceptors(security.token)
    )


# --------------------------------------------------------------------------- command line
def _pick(
    names: Sequence[str], cli: Mapping[str, object] | None, env: Mapping[str, str] | None
) -> dict[str, str]:
    values: dict[str, str] = {}
    cli = cli or {}
    env = env or {}
    for name in names:
        if cli.get(name) is not None:
            values[name] = str(cli[name])
            continue
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None and raw.strip():
            values[name] = raw.strip()
    return values


def token_from_sources(token_file: str | None, env: Mapping[str, str]) -> str | None:
    """A client's bearer token: ``token_file`` (the flag), else ``PARAMSERVER_TOKEN_FILE``, else
    ``PARAMSERVER_TOKEN``; None when none is set.

    Raises:
        InvalidArgument: an unreadable or empty token file (the path named).
    """
    values = _pick(("token_file",), {"token_file": token_file}, env)
    if "token_file" not in values:
        token = env.get(ENV_PREFIX + "TOKEN", "").strip()
        return token or None
    return ClientSecurity(token_file=values["token_file"]).token


def _cli_values(args: argparse.Namespace, names: Sequence[str]) -> dict[str, object]:
    return {name: getattr(args, name, None) for name in names}


def server_security_from_args(
    args: argparse.Namespace, env: Mapping[str, str]
) -> ServerSecurity | None:
    """The server's security from its flags and ``env``; None when nothing is configured.

    Raises:
        InvalidArgument: see :class:`ServerSecurity`.
    """
    cli = _cli_values(args, ("tls_cert", "tls_key", "tls_ca", "auth_tokens"))
    security = ServerSecurity.from_sources(cli, env)
    return security if security.enabled else None


def client_security_from_args(
    args: argparse.Namespace, env: Mapping[str, str]
) -> ClientSecurity | None:
    """A client's security from its flags and ``env``; None when nothing is configured.

    Raises:
        InvalidArgument: see :class:`ClientSecurity`.
    """
    names = ("tls_ca", "tls_cert", "tls_key", "tls_server_name", "token_file")
    security = ClientSecurity.from_sources(_cli_values(args, names), env)
    return security if security.enabled else None
