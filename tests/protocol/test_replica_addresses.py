"""A replicated shard's address: its replicas, one channel that calls the primary."""

from __future__ import annotations

import json

import pytest

from paramserver.errors import InvalidArgument
from paramserver.protocol.addresses import (
    PS_SERVICE,
    channel_target,
    parse_addresses,
    parse_server,
)


def test_replica_groups_are_checked_and_kept() -> None:
    got = parse_addresses("127.0.0.1:1|127.0.0.1:2, 10.0.0.1:3|10.0.0.2:4")
    assert got == ("127.0.0.1:1|127.0.0.1:2", "10.0.0.1:3|10.0.0.2:4")
    with pytest.raises(InvalidArgument, match="not HOST:PORT"):
        parse_addresses("127.0.0.1:1|127.0.0.1")


def test_plain_address_is_its_own_target() -> None:
    assert channel_target("127.0.0.1:5") == ("127.0.0.1:5", [])


def test_replicas_share_one_health_checked_round_robin_channel() -> None:
    target, options = channel_target("127.0.0.1:5|127.0.0.2:6")
    assert target == "ipv4:127.0.0.1:5,127.0.0.2:6"
    ((name, value),) = options
    assert name == "grpc.service_config"
    config = json.loads(value)
    assert config["healthCheckConfig"] == {"serviceName": PS_SERVICE}
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert channel_target("[::1]:5|[::1]:6")[0] == "ipv6:[::1]:5,[::1]:6"
    assert channel_target("localhost:5|localhost:6")[0].startswith(("ipv4:", "ipv6:"))
    with pytest.raises(InvalidArgument, match="mix IPv4 and IPv6"):
        channel_target("[::1]:5|127.0.0.1:6")


def test_a_client_may_be_given_a_replicated_shard() -> None:
    assert parse_server(" 127.0.0.1:1|127.0.0.1:2 ", "ADDR") == "127.0.0.1:1|127.0.0.1:2"
    assert parse_server("h:5") == "h:5"
    with pytest.raises(InvalidArgument, match="ADDR"):
        parse_server("127.0.0.1:1|127.0.0.1:0", "ADDR")
