"""Access control of the HTTP endpoints a server exposes besides gRPC (``/metrics``, and any
page served on the same port): where they listen, TLS, and a bearer token.

The metrics endpoint lists key names, worker names and counters, so it is not for everyone:

* It binds to **loopback** (``127.0.0.1``) by default; ``--metrics-host 0.0.0.0`` (env
  ``PARAMSERVER_METRICS_HOST``) exposes it, e.g. to a Prometheus in another container.
* ``--metrics-token-file FILE`` (env ``PARAMSERVER_METRICS_TOKEN_FILE``): every request must
  carry ``Authorization: Bearer <token>`` with the file's token (one line, at least 16
  characters); others get ``401 Unauthorized``. Prometheus: ``authorization: {credentials_file:
  FILE}`` in the scrape config.
* ``--metrics-tls-cert`` / ``--metrics-tls-key`` (env ``PARAMSERVER_METRICS_TLS_CERT`` /
  ``_KEY``): serve HTTPS. A token without TLS crosses the network in clear text.

:func:`authorized` is the one check every path of the port goes through.
"""

from __future__ import annotations

import hmac
import ssl
from collections.abc import Iterable
from dataclasses import dataclass

from paramserver.errors import InvalidArgument

__all__ = [
    "DEFAULT_METRICS_HOST",
    "HttpSecurity",
    "MetricsEndpointConfig",
    "authorized",
    "unauthorized_response",
]

#: Interface the metrics endpoint binds by default (loopback only).
DEFAULT_METRICS_HOST = "127.0.0.1"

_MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class HttpSecurity:
    """TLS and bearer token of an HTTP endpoint.

    Attributes:
        token: The bearer token every request must present (None: no token check).
        tls_cert: PEM certificate (chain) to serve HTTPS with (with ``tls_key``).
        tls_key: PEM private key of ``tls_cert``.

    Raises:
        InvalidArgument: a short token, or only one of ``tls_cert`` / ``tls_key``
            (INVALID_ARGUMENT).
    """

    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def __post_init__(self) -> None:
        if self.token is not None and (
            len(self.token) < _MIN_TOKEN_CHARS or any(c.isspace() for c in self.token)
        ):
            raise InvalidArgument(
                f"the metrics token must be >= {_MIN_TOKEN_CHARS} characters without whitespace"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidArgument("--metrics-tls-cert and --metrics-tls-key go together")

    def __repr__(self) -> str:  # never print the token
        return (
            f"HttpSecurity(token={'set' if self.token else None}, tls={self.tls_cert is not None})"
        )

    @classmethod
    def from_files(
        cls, token_file: str | None, tls_cert: str | None, tls_key: str | None
    ) -> HttpSecurity | None:
        """Read the token file (first non-empty line); None when nothing is configured.

        Raises:
            InvalidArgument: an unreadable or malformed token file, named (INVALID_ARGUMENT).
        """
        if token_file is None and tls_cert is None and tls_key is None:
            return None
        token = None
        if token_file is not None:
            try:
                with open(token_file, encoding="utf-8") as fh:
                    lines = [line.strip() for line in fh if line.strip()]
            except (OSError, UnicodeDecodeError) as exc:
                raise InvalidArgument(f"--metrics-token-file {token_file!r}: {exc}") from None
            if not lines:
                raise InvalidArgument(f"--metrics-token-file {token_file!r} is empty")
            token = lines[0]
        return cls(token=token, tls_cert=tls_cert, tls_key=tls_key)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server-side TLS context (None without a certificate).

        Raises:
            InvalidArgument: the certificate or key cannot be loaded (INVALID_ARGUMENT).
        """
        if self.tls_cert is None or self.tls_key is None:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise InvalidArgument(f"--metrics-tls-cert/--metrics-tls-key: {exc}") from None
        return ctx


@dataclass(frozen=True, kw_only=True)
class MetricsEndpointConfig:
    """Where a daemon serves its Prometheus metrics and dashboard, and how they are guarded: the
    settings a shard's and a rank server's configurations share (both subclass this).

    Attributes:
        metrics_port: Serve Prometheus metrics (``/metrics``) and the dashboard on this TCP
            port of ``metrics_host`` (0: ephemeral); None: no endpoint.
        metrics_host: Interface of the metrics endpoint (default loopback, ``127.0.0.1``).
        metrics_token_file: File with the bearer token every metrics request must present.
        metrics_tls_cert: PEM certificate to serve the metrics over HTTPS (with the key).
        metrics_tls_key: PEM private key of ``metrics_tls_cert``.
    """

    metrics_port: int | None = None
    metrics_host: str = DEFAULT_METRICS_HOST
    metrics_token_file: str | None = None
    metrics_tls_cert: str | None = None
    metrics_tls_key: str | None = None

    def check_metrics_port(self, port: int) -> None:
        """Refuse a metrics port that is no TCP port or is the daemon's own gRPC ``port``.

        Raises:
            InvalidArgument: (INVALID_ARGUMENT) the port named.
        """
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise InvalidArgument(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.metrics_port and self.metrics_port == port:
            raise InvalidArgument(
                f"--metrics-port {self.metrics_port} is also --port: the metrics endpoint "
                "needs a port of its own"
            )

    def metrics_security(self) -> HttpSecurity | None:
        """The endpoint's TLS and token, read from the files (None when none is set).

        Raises:
            InvalidArgument: (INVALID_ARGUMENT) as :meth:`HttpSecurity.from_files`.
        """
        return HttpSecurity.from_files(
            self.metrics_token_file, self.metrics_tls_cert, self.metrics_tls_key
        )


def authorized(security: HttpSecurity | None, header_lines: Iterable[bytes]) -> bool:
    """Whether a request with these header lines may be served (any path).

    True without a configured token; otherwise only with ``Authorization: Bearer <token>``
    matching it (compared with :func:`hmac.compare_digest`).
    """
    if security is None or security.token is None:
        return True
    expected = security.token.encode("utf-8")
    for raw in header_lines:
        name, sep, value = raw.decode("latin-1").partition(":")
        if not sep or name.strip().lower() != "authorization":
            continue
        scheme, _, given = value.strip().partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode("latin-1"), expected
        ):
            return True
    return False


def unauthorized_response() -> bytes:
    """The whole ``401 Unauthorized`` answer (HTTP/1.0, asks for a bearer token)."""
    body = b"unauthorized: send Authorization: Bearer <token>\n"
    return (
        b"HTTP/1.0 401 Unauthorized\r\nContent-Type: text/plain\r\n"
        b'WWW-Authenticate: Bearer realm="paramserver"\r\n'
        + f"Content-Length: {len(body)}\r\n\r\n".encode("latin-1")
        + body
    )
