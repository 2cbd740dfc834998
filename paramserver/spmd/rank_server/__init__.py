"""The rank server: one rank's tier pools behind the ``paramserver.api.v1.RankServer`` service.

Modules: :mod:`.rank_config` (config, constants), :mod:`.rank_state` (pools, peers, the command
funnel), :mod:`.transfer` (local and remote transfers, one path for onboard and offload),
:mod:`.object_tier` (blocks <-> objects), :mod:`.rank_service` (the gRPC servicer and its
error decorator over :func:`paramserver.server.serving.grpc_errors`), :mod:`.rank_daemon`
(start through :func:`paramserver.server.serving.start_grpc_server`, serve).
"""

from paramserver.spmd.rank_server.rank_config import SERVICE_NAME, RankServerConfig
from paramserver.spmd.rank_server.rank_daemon import RankServerHandle, serve, start_rank_server
from paramserver.spmd.rank_server.rank_service import RankServicer

__all__ = [
    "SERVICE_NAME",
    "RankServerConfig",
    "RankServerHandle",
    "RankServicer",
    "serve",
    "start_rank_server",
]
