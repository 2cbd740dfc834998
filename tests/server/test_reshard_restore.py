"""Checkpoints of a sharded cluster restored into another shard count (3 -> 2, 3 -> 4)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from paramserver.server.config import ServerConfig
from paramserver.server.reshard import ReshardError
from paramserver.server.shard_daemon import ParameterServerDaemon
from tests.harness import run_job, running_cluster, running_server

pytestmark = pytest.mark.timeout(90)

BSP = {"consistency": "bsp", "aggregation": "mean", "slice_bytes": 1024}


async def test_restore_3_shards_into_2_and_into_4(tmp_path: Path) -> None:
    """A 3-shard BSP job checkpoints at steps 3 and 6 and stops; its cut at step 6 is resharded
    into 2 shards (``paramserver reshard``) and into 4 (``serve --restore-from``, on load); 4
    more steps on either give parameters bit-identical to 10 steps on one server."""
    async with running_server(consistency="bsp", aggregation="mean") as srv:
        reference = await run_job(srv.address, workers=4, steps=10)

    old = [tmp_path / f"old-{i}" for i in range(3)]
    async with running_cluster(
        3, checkpoint_every_steps=3, per_shard=[{"checkpoint_dir": str(d)} for d in old], **BSP
    ) as shards:
        await run_job(shards[0].address, workers=4, steps=6)
    for d in old:
        cuts = [json.loads((p / "manifest.json").read_text())["shard"] for p in d.iterdir()]
        assert {(c["cut_step"], c["exact_cut"], c["num_shards"]) for c in cuts} >= {(6, True, 3)}

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "paramserver", "reshard", "--from", *map(str, old),
        "--to-shards", "2", "--out", str(tmp_path / "two"), stdout=subprocess.PIPE,
    )  # fmt: skip
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    summary = json.loads(out)
    assert (summary["cut_step"], summary["from_shards"], summary["to_shards"]) == (6, 3, 2)
    two_dirs = [{"checkpoint_dir": str(tmp_path / "two" / f"shard-{i}")} for i in range(2)]
    async with running_cluster(2, per_shard=two_dirs, **BSP) as shards:
        two = await run_job(shards[1].address, workers=4, steps=4, init=False)

    four_dirs = [
        {"checkpoint_dir": str(tmp_path / f"four-{i}"), "restore_from": ",".join(map(str, old))}
        for i in range(4)
    ]
    async with running_cluster(4, per_shard=four_dirs, **BSP) as shards:
        four = await run_job(shards[3].address, workers=4, steps=4, init=False)

    for key, value in reference.items():
        assert two[key].tobytes() == value.tobytes(), key
        assert four[key].tobytes() == value.tobytes(), key


async def test_shard_refuses_checkpoint_of_another_cluster_shape(tmp_path: Path) -> None:
    old = [tmp_path / f"old-{i}" for i in range(3)]
    async with running_cluster(
        3, per_shard=[{"checkpoint_dir": str(d)} for d in old], **BSP
    ) as shards:
        await run_job(shards[0].address, workers=2, steps=1)
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        checkpoint_dir=str(old[0]),
        shard_index=0,
        shard_addresses="127.0.0.1:0,127.0.0.1:0",
        **BSP,
    )
    with pytest.raises(ReshardError, match="shard 0 of 3, but this is shard 0 of 2"):
        await ParameterServerDaemon(config).start()
