"""The rank server: one rank's tier pools behind the ``paramserver.api.v1.RankServer`` service."""
