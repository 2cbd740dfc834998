"""``paramserver serve --ordinal N`` (a StatefulSet pod's ordinal): with ``--replicas R`` the
server is replica N % R of shard N // R, its replicas that shard's group in
``--shard-addresses``; contradicting or impossible flags are refused naming what is wrong."""

from __future__ import annotations

import pytest

from paramserver.cli.main import build_parser
from paramserver.cli.serve import serve_config
from paramserver.errors import InvalidArgument

pytestmark = pytest.mark.timeout(30)

MAP = "a0:1|a1:1|a2:1,b0:1|b1:1|b2:1"
REPLICATED = ["--replicas", "3", "--wal", "--checkpoint-dir", "/tmp/unused"]


def config(*argv: str):  # type: ignore[no-untyped-def]
    return serve_config(build_parser(["serve"]).parse_args(["serve", *argv]), {})


@pytest.mark.parametrize("ordinal", range(6))
def test_ordinal_names_the_shard_and_the_replica(ordinal: int) -> None:
    c = config("--ordinal", str(ordinal), "--shard-addresses", MAP, *REPLICATED)
    shard, replica = ordinal // 3, ordinal % 3
    assert (c.shard_index, c.replica_index) == (shard, replica)
    assert c.replica_address_list == tuple(f"{'ab'[shard]}{k}:1" for k in range(3))


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["--ordinal", "1", "--shard-index", "0", "--shard-addresses", MAP], "--shard-index"),
        (["--ordinal", "6", "--shard-addresses", MAP, *REPLICATED], "names 2 shards"),
        (["--ordinal", "0", "--shard-addresses", "a:1|b:1,c:1|d:1", *REPLICATED], "says 3"),
        (["--ordinal", "-1", "--shard-addresses", MAP, *REPLICATED], ">= 0"),
        (["--ordinal", "0", *REPLICATED], "--shard-addresses"),
    ],
)
def test_contradictions_are_refused(argv: list[str], complaint: str) -> None:
    with pytest.raises(InvalidArgument, match=complaint.replace("|", r"\|")):
        config(*argv)
