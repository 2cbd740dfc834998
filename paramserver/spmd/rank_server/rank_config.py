"""Configuration of one rank server (:class:`RankServerConfig`) and its wire constants.

Kept apart from the servicer so that the rank client and the CLI read the constants and the
config without loading the server.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from paramserver.errors import InvalidArgument
from paramserver.security.http_access import MetricsEndpointConfig
from paramserver.security.tls import ClientSecurity, ServerSecurity
from paramserver.spmd.faults import Faults
from paramserver.spmd.layout import Layout

__all__ = [
    "CHANNEL_OPTIONS",
    "DEFAULT_MAX_OBJECT_BYTES",
    "MAX_MESSAGE_BYTES",
    "SERVICE_NAME",
    "RankServerConfig",
]

MAX_MESSAGE_BYTES = 8 << 20
"""Largest gRPC message a rank server or its clients take: chunks are <= 1 MiB, so 8 MiB leaves
ample headroom."""

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
"""Options of every channel to a rank server."""

SERVICE_NAME = "paramserver.api.v1.RankServer"
"""Full gRPC service name of the rank server (also its health-check service name)."""
#: Default largest object PutObject accepts (bytes): a block, or many, with room to spare.
DEFAULT_MAX_OBJECT_BYTES = 16 << 30


def _default_root() -> Path:
    return Path(os.environ.get("TMPDIR", "/tmp")) / "paramserver-spmd"


@dataclasses.dataclass(frozen=True)
class RankServerConfig(MetricsEndpointConfig):
    """Configuration of one rank server; the metrics endpoint (the series of
    :mod:`paramserver.spmd.rank_metrics` and the dashboard) is set by the ``metrics_*`` fields
    of :class:`~paramserver.security.http_access.MetricsEndpointConfig`.

    Precedence (applied by :func:`paramserver.cli.rank.config_from_args`): CLI flag, then the
    ``PARAMSERVER_SPMD_*`` environment variable, then the default here.

    Attributes:
        instance_id: instance (group of ranks) this rank belongs to.
        rank: rank index within the instance, from 0.
        host: interface to bind (loopback by default).
        port: TCP port; 0 picks an ephemeral port (reported via ``port_file`` and stdout).
        layout: block format (``num_blocks`` is ignored; per-tier counts below).
        host_blocks: blocks of the G2 host pool (0 = no G2).
        disk_blocks: blocks of the G3 disk pool (0 = no G3).
        device_blocks: blocks of the G1 device pool (0 = no G1; needs a GPU).
        disk_dir: directory of the G3 pool file.
        object_dir: root of the filesystem object store (G4); ``None`` = no G4.
        object_durable: fsync objects before they become visible.
        port_file: file to write the bound port to (atomically), or ``None``.
        default_timeout_s: deadline of commands that carry none, seconds.
        faults: TEST-ONLY fault injection (see :mod:`paramserver.spmd.faults`).
        security: TLS / mutual TLS and bearer tokens of this server
            (:class:`paramserver.security.tls.ServerSecurity`); None: plain text, no tokens.
        peer_security: How this rank reaches its peers' rank servers (TLS and the token it
            presents; :func:`paramserver.security.tls.peer_security`); None: plain text, no token.
        max_object_bytes: largest object ``PutObject`` accepts, bytes (larger declared sizes
            are refused, INVALID_ARGUMENT, before a byte is written).
    """

    instance_id: str
    rank: int
    host: str = "127.0.0.1"
    port: int = 0
    layout: Layout = dataclasses.field(default_factory=lambda: Layout(num_blocks=0))
    host_blocks: int = 64
    disk_blocks: int = 64
    device_blocks: int = 0
    disk_dir: Path = dataclasses.field(default_factory=lambda: _default_root() / "disk")
    object_dir: Path | None = dataclasses.field(default_factory=lambda: _default_root() / "objects")
    object_durable: bool = True
    port_file: Path | None = None
    default_timeout_s: float = 30.0
    faults: Faults = dataclasses.field(default_factory=Faults)
    security: ServerSecurity | None = None
    peer_security: ClientSecurity | None = None
    max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES

    def __post_init__(self) -> None:
        if not self.instance_id or "/" in self.instance_id:
            raise InvalidArgument(
                f"instance_id must be non-empty without '/': {self.instance_id!r}"
            )
        if self.rank < 0:
            raise InvalidArgument(f"rank must be >= 0, got {self.rank}")
        if not 0 <= self.port < 65536:
            raise InvalidArgument(f"port must be in [0, 65535], got {self.port}")
        if self.max_object_bytes < 0:
            raise InvalidArgument(
                "max_object_bytes: --max-object-bytes (PARAMSERVER_SPMD_MAX_OBJECT_BYTES) must "
                f"be >= 0, got {self.max_object_bytes}"
            )
        self.check_metrics_port(self.port)
        for name in ("host_blocks", "disk_blocks", "device_blocks"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must be >= 0")
        if self.default_timeout_s <= 0:
            raise InvalidArgument("default_timeout_s must be > 0")
