"""The rank server: one rank's tier pools behind the ``paramserver.api.v1.RankServer`` service.

Modules: :mod:`.rank_config` (config, constants), :mod:`.rank_state` (pools, peers, the command
funnel), :mod:`.transfer` (local and remote transfers, one path for onboard and offload),
:mod:`.object_tier` (blocks <-> objects), :mod:`.rank_service` (the gRPC servicer and its
error decorator over :func:`paramserver.serving.error_status.grpc_errors`), :mod:`.rank_daemon`
(start through :func:`paramserver.serving.bootstrap.start_grpc_server`, serve).

The names below load their module on first use, so a client that needs only
:mod:`.rank_config` (the rank client, the CLI's flag parsing) does not load the server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names, for type checkers (re-exported as such)
    from paramserver.spmd.rank_server.rank_config import SERVICE_NAME as SERVICE_NAME
    from paramserver.spmd.rank_server.rank_config import RankServerConfig as RankServerConfig
    from paramserver.spmd.rank_server.rank_daemon import RankServerHandle as RankServerHandle
    from paramserver.spmd.rank_server.rank_daemon import serve as serve
    from paramserver.spmd.rank_server.rank_daemon import start_rank_server as start_rank_server
    from paramserver.spmd.rank_server.rank_service import RankServicer as RankServicer

_HOMES = {
    "rank_config": ("SERVICE_NAME", "RankServerConfig"),
    "rank_daemon": ("RankServerHandle", "serve", "start_rank_server"),
    "rank_service": ("RankServicer",),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_HOME_OF)


def __getattr__(name: str) -> object:
    if name not in _HOME_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME_OF[name]}"), name)
