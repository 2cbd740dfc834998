"""``paramserver.local_cluster``: real server processes for one ``async with`` / ``with`` block,
every one of them reaped on exit, pass or fail."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import paramserver
from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.errors import InvalidArgument, Unavailable
from paramserver.worker_client import UpdateRule

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _all_reaped(cluster: paramserver.LocalCluster, procs: list[object]) -> bool:
    return not cluster.processes and all(p.returncode is not None for p in procs)  # type: ignore[attr-defined]


async def test_two_shards_run_a_bsp_step_and_are_reaped_on_exit() -> None:
    """2 shard processes, 2 workers, one BSP step with the sum rule: the stored value is the
    closed form w0 - lr * mean(g_a, g_b), and every server process has exited afterwards."""
    w0 = np.arange(6, dtype=np.float32)
    g = {"a": np.full(6, 1.0, np.float32), "b": np.full(6, 3.0, np.float32)}
    async with paramserver.local_cluster(shards=2, consistency="bsp") as cluster:
        procs = list(cluster.processes)
        assert len(cluster.addresses) == 2
        assert all(a.startswith("127.0.0.1:") for a in cluster.addresses)
        assert len(set(cluster.addresses)) == 2
        assert all(p.poll() is None for p in procs)
        async with cluster.connect("a") as a, cluster.connect("b") as b:
            assert a.sharded
            await a.init({"w": w0}, rule=UpdateRule("sgd", lr=0.5))
            await b.init({"w": w0}, rule=UpdateRule("sgd", lr=0.5))
            await asyncio.gather(a.wait_for_workers(2, timeout_s=30), b.wait_for_workers(2))
            await asyncio.gather(a.push({"w": g["a"]}), b.push({"w": g["b"]}))
            await asyncio.gather(a.clock(), b.clock())
            got = (await a.pull(["w"]))["w"]
            status = await a.status()
    np.testing.assert_allclose(got, w0 - 0.5 * (g["a"] + g["b"]) / 2)
    assert status.view.consistency == pb.CONSISTENCY_BSP
    assert _all_reaped(cluster, procs)


def test_the_blocking_twin_with_ssp_staleness_and_a_serve_flag(tmp_path: Path) -> None:
    """Plain ``with``: SSP s=3 and ``aggregation="sum"`` reach the server; the logs land in
    ``log_dir``."""
    with paramserver.local_cluster(
        consistency="ssp", staleness=3, aggregation="sum", log_dir=tmp_path
    ) as cluster:
        procs = list(cluster.processes)
        with cluster.connect_sync("w") as ps:
            ps.init({"w": np.zeros(3, np.float32)}, rule=UpdateRule("add"))
            ps.push({"w": np.ones(3, np.float32)})
            ps.clock()
            got = ps.pull(["w"])["w"]
            view = ps.status().view
    np.testing.assert_array_equal(got, np.ones(3, np.float32))
    assert (view.consistency, view.staleness) == (pb.CONSISTENCY_SSP, 3)
    assert (tmp_path / "server-0.log").exists()
    assert _all_reaped(cluster, procs)


async def test_an_error_inside_the_block_still_reaps_every_server() -> None:
    cluster = paramserver.local_cluster(shards=2, consistency="asp")
    procs: list[object] = []
    with pytest.raises(ZeroDivisionError):
        async with cluster:
            procs = list(cluster.processes)
            _ = 1 / 0
    assert len(procs) == 2
    assert _all_reaped(cluster, procs)


def test_a_server_that_cannot_start_is_unavailable_with_its_output() -> None:
    cluster = paramserver.local_cluster(no_such_flag=1)
    with pytest.raises(Unavailable, match=r"exited early with code 2.*--no-such-flag"):
        with cluster:
            pass
    assert cluster.processes == [] and cluster.addresses == []


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"shards": 0}, "shards"), ({"consistency": "x"}, "bsp")]
)
def test_bad_arguments_are_invalid_argument(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        paramserver.local_cluster(**kwargs)  # type: ignore[arg-type]


def test_a_user_script_sees_no_library_log_lines() -> None:
    """A script that configured no logging: a 2-shard cluster, a worker, a push and a pull
    print nothing but the script's own line (the library installs no handler and logs
    routine events at DEBUG; the servers' output goes to their log files)."""
    script = (
        "import numpy as np, paramserver\n"
        "from paramserver.worker_client import UpdateRule\n"
        "with paramserver.local_cluster(shards=2, consistency='asp') as c:\n"
        "    with c.connect_sync('w') as ps:\n"
        "        ps.init({'w': np.zeros(3, np.float32)}, rule=UpdateRule('add'))\n"
        "        ps.push({'w': np.ones(3, np.float32)})\n"
        "        print('pulled', ps.pull(['w'])['w'].tolist())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "pulled [1.0, 1.0, 1.0]\n"
    assert proc.stderr == ""
