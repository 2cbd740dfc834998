"""``paramserver.worker_client.env``: the environment ``paramserver run`` gives a script,
replicated shards (``h:p|h:p``) included, and its refusals naming the variable."""

from __future__ import annotations

import pytest

from paramserver.errors import InvalidArgument
from paramserver.worker_client.env import WorkerEnv

pytestmark = pytest.mark.timeout(30)

SHARD_0 = "127.0.0.1:5001|127.0.0.1:5002"  # two replicas of shard 0
SHARD_1 = "127.0.0.1:5003|127.0.0.1:5004"


def test_shard_addresses_of_replicated_shards_are_read_whole() -> None:
    env = WorkerEnv.from_env(
        {
            "PARAMSERVER_SHARD_ADDRESSES": f"{SHARD_0}, {SHARD_1}",
            "WORKER_INDEX": "1",
            "NUM_WORKERS": "2",
        }
    )
    assert env.shard_addresses == (SHARD_0, SHARD_1)
    assert env.address == SHARD_0


def test_a_replicated_single_address_is_read_whole() -> None:
    env = WorkerEnv.from_env({"PARAMSERVER_ADDRESS": "127.0.0.1:5001|127.0.0.1:5002"})
    assert env.address == "127.0.0.1:5001|127.0.0.1:5002"


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({}, "PARAMSERVER_ADDRESS"),
        ({"PARAMSERVER_ADDRESS": "nohost"}, "PARAMSERVER_ADDRESS"),
        ({"PARAMSERVER_SHARD_ADDRESSES": "127.0.0.1:1|bad"}, "PARAMSERVER_SHARD_ADDRESSES"),
    ],
)
def test_bad_environments_are_refused_naming_the_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(InvalidArgument, match=named):
        WorkerEnv.from_env(env)
