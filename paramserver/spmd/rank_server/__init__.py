"""paramserver.spmd.rank_server."""
