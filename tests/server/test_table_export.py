"""``paramserver export-tables`` and ExportedTables: a trained 2-shard cluster's checkpoints
exported and loaded answer pulls bit for bit as the live cluster did, stored and unstored ids
alike (paramserver.server.table_export)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from paramserver.core.tables import Initializer, TableRule, TableSpec
from paramserver.errors import InvalidArgument, TableNotFound
from paramserver.server.table_export import ExportedTables
from paramserver.worker_client import connect
from tests.harness import running_cluster

pytestmark = pytest.mark.timeout(120)

SPECS = [
    TableSpec(
        "users", 8, rule=TableRule("adagrad", lr=0.1), initializer=Initializer("normal", 0.1)
    ),
    TableSpec("items", 4, rule=TableRule("adam", lr=0.05), dtype="bfloat16", seed=4),
    TableSpec("tags", 3, rule=TableRule("sgd", lr=0.5), dtype="float16", seed=2, min_pushes=2),
]


async def test_export_answers_pulls_as_the_cluster(tmp_path: Path) -> None:
    dirs = [tmp_path / f"shard-{i}" for i in range(2)]
    per_shard = [{"checkpoint_dir": str(d)} for d in dirs]
    probe = np.arange(3000, dtype=np.int64)  # stored ids and many never touched
    rng = np.random.default_rng(3)
    async with running_cluster(2, consistency="asp", per_shard=per_shard) as daemons:
        async with connect(daemons[0].address, "w") as w:
            for s in SPECS:
                await w.init_table(s)
            for _ in range(4):
                ids = {s.name: (rng.zipf(1.3, 300) % 1000).astype(np.int64) for s in SPECS}
                grads = {
                    s.name: rng.normal(size=(300, s.dim)).astype(np.float32) * np.float32(0.1)
                    for s in SPECS
                }
                await w.push_rows_many(ids, grads)
            live = await w.pull_rows_many({s.name: probe for s in SPECS})
            stored = sum(t.rows for t in (await w.status()).tables)
        for d in daemons:
            await d.request_checkpoint()
    out = tmp_path / "export"
    proc = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "paramserver",
            "export-tables",
            "--checkpoint-dir",
            *map(str, dirs),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert sum(json.loads(proc.stdout)["rows"].values()) == stored
    loaded = ExportedTables(out)
    assert loaded.specs() == {s.name: s for s in SPECS}
    for s in SPECS:
        got = loaded.pull(s.name, probe)
        assert got.dtype == live[s.name].dtype
        assert got.tobytes() == live[s.name].tobytes(), s.name
    with pytest.raises(TableNotFound):
        loaded.pull("nope", [1])
    with pytest.raises(InvalidArgument):
        loaded.pull("users", [-1])
