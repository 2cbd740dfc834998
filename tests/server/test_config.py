"""ServerConfig: precedence CLI > PARAMSERVER_* environment > default, and validation."""

from __future__ import annotations

import pytest

from paramserver.errors import InvalidArgument
from paramserver.server.config import ServerConfig


def test_defaults() -> None:
    cfg = ServerConfig.from_sources({}, {})
    assert (cfg.host, cfg.port, cfg.consistency, cfg.aggregation) == (
        "127.0.0.1",
        50051,
        "bsp",
        "mean",
    )
    assert cfg.lease_ms == 10_000 and cfg.max_staleness is None and not cfg.allow_non_finite


def test_environment_over_default_and_cli_over_environment() -> None:
    env = {
        "PARAMSERVER_CONSISTENCY": "ssp",
        "PARAMSERVER_STALENESS": "3",
        "PARAMSERVER_LEASE_MS": "2500",
        "PARAMSERVER_ALLOW_NON_FINITE": "true",
        "PARAMSERVER_MAX_STALENESS": "7",
        "PARAMSERVER_GRACE_S": "1.5",
        "UNRELATED": "x",
    }
    cfg = ServerConfig.from_sources({"staleness": 5, "lease_ms": None}, env)
    assert cfg.consistency == "ssp"
    assert cfg.staleness == 5  # CLI wins
    assert cfg.lease_ms == 2500  # CLI gave None: environment applies
    assert cfg.allow_non_finite is True
    assert cfg.max_staleness == 7
    assert cfg.grace_s == 1.5


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"PARAMSERVER_LEASE_MS": "soon"}, "PARAMSERVER_LEASE_MS"),
        ({"PARAMSERVER_ALLOW_NON_FINITE": "maybe"}, "PARAMSERVER_ALLOW_NON_FINITE"),
        ({"PARAMSERVER_CONSISTENCY": "eventual"}, "consistency"),
        ({"PARAMSERVER_AGGREGATION": "median"}, "aggregation"),
        ({"PARAMSERVER_DEATH_POLICY": "ignore"}, "death_policy"),
        ({"PARAMSERVER_LEASE_MS": "0"}, "lease_ms"),
        ({"PARAMSERVER_STALENESS": "-1"}, "staleness"),
        ({"PARAMSERVER_PORT": "70000"}, "port"),
    ],
)
def test_bad_values_name_the_setting(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(InvalidArgument, match=fragment):
        ServerConfig.from_sources({}, env)


def test_bsp_forces_zero_staleness_in_the_core() -> None:
    from paramserver.core.shard import ServerCore

    core = ServerCore(ServerConfig(consistency="bsp", staleness=4))
    assert core.cluster.staleness == 0
