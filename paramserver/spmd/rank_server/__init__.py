"""The rank server: one rank's tier pools behind the ``paramserver.api.v1.RankServer`` service.

Modules: :mod:`.rank_config` (config, constants), :mod:`.rank_state` (pools, peers, the command
funnel), :mod:`.transfer` (local and remote transfers, one path for onboard and offload),
:mod:`.object_tier` (blocks <-> objects), :mod:`.rank_service` (the gRPC servicer and its
error decorator over :func:`paramserver.server.serving.grpc_errors`), :mod:`.rank_daemon`
(start through :func:`paramserver.server.serving.start_grpc_server`, serve).

The names below load their module on first use, so a client that needs only
:mod:`.rank_config` (the rank client, the CLI's flag parsing) does not load the server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paramserver.spmd.rank_server.rank_config import SERVICE_NAME, RankServerConfig
    from paramserver.spmd.rank_server.rank_daemon import (
        RankServerHandle,
        serve,
        start_rank_server,
    )
    from paramserver.spmd.rank_server.rank_service import RankServicer

_HOMES = {
    "SERVICE_NAME": "rank_config",
    "RankServerConfig": "rank_config",
    "RankServerHandle": "rank_daemon",
    "serve": "rank_daemon",
    "start_rank_server": "rank_daemon",
    "RankServicer": "rank_service",
}

__all__ = [
    "SERVICE_NAME",
    "RankServerConfig",
    "RankServerHandle",
    "RankServicer",
    "serve",
    "start_rank_server",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
