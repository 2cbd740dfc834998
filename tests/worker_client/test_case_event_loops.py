"""Case event-loops.md: client and server run under uvloop and the default asyncio loop alike.

Every async test of the suite runs on both loops (``tests/conftest.py``); the checks that need a
fresh interpreter (what importing creates, several ``asyncio.run`` calls in one process) run a
small script in a real subprocess. Expected values are counts: the ``add`` rule from zeros with
pushes of ones gives ``w == number of pushes``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from paramserver.worker_client import UpdateRule, connect
from tests.harness import ServerProcess, eventually, running_server

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a runtime dependency on POSIX
    uvloop = None

ADD = UpdateRule("add")
REPO = Path(__file__).resolve().parents[2]


def _run_script(script: str, *args: str, timeout_s: float = 60) -> dict[str, object]:
    """Run ``script`` in a fresh interpreter; it prints one JSON object as its last line."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
        env={**os.environ, "PYTHONWARNINGS": "error::RuntimeWarning"},
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.timeout(60)
async def test_round_trip_on_each_loop(request: pytest.FixtureRequest) -> None:
    """Case event-loops.md: this test runs once per loop of the suite (asyncio and uvloop, from
    the conftest hook), on the loop its id names; a server and two clients on that loop
    register, init, push, clock and pull (BSP: w == mean(1, 3) == 2)."""
    loop = asyncio.get_running_loop()
    if "uvloop" in request.node.name:
        assert uvloop is not None and isinstance(loop, uvloop.Loop)
    else:
        assert "asyncio" in request.node.name
        assert type(loop).__module__.startswith("asyncio")
    async with running_server(consistency="bsp") as srv:
        async with connect(srv.address, "a") as a, connect(srv.address, "b") as b:
            await a.init({"w": np.zeros(3)}, rule=ADD)
            await a.push({"w": np.full(3, 1.0)})
            await b.push({"w": np.full(3, 3.0)})
            await a.clock()
            await b.clock()
            np.testing.assert_array_equal((await b.pull(["w"]))["w"], np.full(3, 2.0))


def test_both_loops_are_available() -> None:
    """Case event-loops.md: uvloop is installed, so the suite really runs on both loops."""
    assert uvloop is not None


_IMPORT_THEN_UVLOOP = """
    import asyncio, gc, importlib, json, pkgutil, sys

    calls = []

    def spy(module, name):
        original = getattr(module, name)
        def wrapper(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)
        setattr(module, name, wrapper)

    for name in ("new_event_loop", "get_event_loop", "set_event_loop", "set_event_loop_policy"):
        spy(asyncio, name)
        spy(asyncio.events, name)

    import grpc.aio

    KINDS = (
        asyncio.AbstractEventLoop, asyncio.Future, asyncio.Lock, asyncio.Event,
        asyncio.Condition, asyncio.Semaphore, asyncio.Queue, grpc.aio.Channel, grpc.aio.Server,
    )

    def asyncio_objects():
        return sorted({type(o).__name__ for o in gc.get_objects() if isinstance(o, KINDS)})

    before = asyncio_objects()
    imported = []
    import paramserver.cli.main, paramserver.errors, paramserver.server, paramserver.protocol.tensor
    import paramserver.worker_client
    for pkg in (paramserver.server, paramserver.worker_client):
        for mod in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if not mod.name.endswith("__main__"):
                importlib.import_module(mod.name)
                imported.append(mod.name)
    after = asyncio_objects()
    import_calls = list(calls)  # uvloop.run below may use the same functions
    no_loop = asyncio.events._get_running_loop() is None
    policy_loop = getattr(getattr(asyncio.get_event_loop_policy(), "_local", None), "_loop", None)

    import numpy as np
    import uvloop
    from paramserver.server.config import ServerConfig
    from paramserver.server.shard_daemon import ParameterServerDaemon
    from paramserver.worker_client import UpdateRule, connect

    async def main():
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        config = ServerConfig(host="127.0.0.1", port=0, consistency="asp")
        async with ParameterServerDaemon(config) as daemon:
            async with connect(daemon.address, "w0") as ps:
                await ps.init({"w": np.zeros(4)}, rule=UpdateRule("add"))
                for _ in range(3):
                    await ps.push({"w": np.ones(4)})
                return (await ps.pull(["w"]))["w"].tolist()

    w = uvloop.run(main())
    print(json.dumps({
        "calls": import_calls, "before": before, "after": after, "imported": imported,
        "no_running_loop": no_loop, "policy_loop": repr(policy_loop), "w": w,
    }))
"""


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_import_creates_no_asyncio_objects_then_uvloop_works() -> None:
    """Case event-loops.md: in a fresh interpreter, importing every server and client module
    calls no new_event_loop/get_event_loop/set_event_loop(_policy), and leaves no event loop,
    future, task, lock, event, queue or grpc.aio channel/server behind; starting uvloop
    afterwards, an in-process server and a client on it work (3 pushes of ones: w == 3)."""
    out = _run_script(_IMPORT_THEN_UVLOOP)
    assert "paramserver.server.shard_daemon" in out["imported"]  # type: ignore[operator]
    assert "paramserver.worker_client.client" in out["imported"]  # type: ignore[operator]
    assert out["calls"] == []
    assert out["after"] == out["before"] == []
    assert out["no_running_loop"] is True
    assert out["policy_loop"] == "None"
    assert out["w"] == [3.0] * 4


_TWO_RUNS = """
    import asyncio, json, sys
    import numpy as np
    import uvloop
    from paramserver.server.config import ServerConfig
    from paramserver.server.shard_daemon import ParameterServerDaemon
    from paramserver.worker_client import UpdateRule, WorkerClient, connect, connect_sync

    address = sys.argv[1]
    shared = WorkerClient(address, "shared")  # one client object, entered on several loops

    async def session(tag):
        async with connect(address, "w-" + tag) as ps:
            await ps.init({"w": np.zeros(2)}, rule=UpdateRule("add"))
            await ps.push({"w": np.ones(2)})
            external = (await ps.pull(["w"]))["w"].tolist()
        async with shared:
            await shared.push({"w": np.ones(2)})
            after_shared = (await shared.pull(["w"]))["w"].tolist()
        config = ServerConfig(host="127.0.0.1", port=0, consistency="asp")
        async with ParameterServerDaemon(config) as daemon:
            async with connect(daemon.address, "local") as ps:
                await ps.init({"v": np.zeros(2)}, rule=UpdateRule("add"))
                await ps.push({"v": np.ones(2)})
                local = (await ps.pull(["v"]))["v"].tolist()
        return {"loop": type(asyncio.get_running_loop()).__module__, "external": external,
                "after_shared": after_shared, "local": local}

    runs = [asyncio.run(session("a")), asyncio.run(session("b")), uvloop.run(session("c")),
            asyncio.run(session("d"))]
    sync_values = []
    for tag in ("s1", "s2"):
        with connect_sync(address, tag) as ps:
            ps.push({"w": np.ones(2)})
            sync_values.append(ps.pull(["w"])["w"].tolist())
    print(json.dumps({"runs": runs, "sync": sync_values}))
"""


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_consecutive_asyncio_run_calls_each_with_own_client(tmp_path: Path) -> None:
    """Case event-loops.md: one process makes four consecutive loop runs (asyncio.run,
    asyncio.run, uvloop.run, asyncio.run); each opens its own client to a `paramserver serve`
    subprocess, re-enters one shared WorkerClient object (its channel is created per entry, not
    cached across loops), and hosts its own in-process server; then two blocking clients (each
    with a private loop) follow. Every call works: the external w counts 2 pushes per run, then
    1 per blocking client; each in-process server sees exactly its own push."""
    server = ServerProcess(tmp_path, "--consistency", "asp")
    try:
        out = _run_script(_TWO_RUNS, server.address)
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    runs = out["runs"]
    assert isinstance(runs, list)
    assert [r["loop"].split(".")[0] for r in runs] == ["asyncio", "asyncio", "uvloop", "asyncio"]
    for i, run in enumerate(runs):
        assert run["external"] == [2.0 * i + 1] * 2
        assert run["after_shared"] == [2.0 * i + 2] * 2
        assert run["local"] == [1.0, 1.0]
    assert out["sync"] == [[9.0, 9.0], [10.0, 10.0]]
    assert "Traceback" not in server.log()


WORKERS = 8
PUSHES = 2000
ELEMENTS = 64 * 1024 // 4  # float32: 64 KiB per push


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_uvloop_8_workers_2000_pushes_of_64kib_no_errors(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Case event-loops.md: a `paramserver serve` subprocess on uvloop (checked in its memory
    map) and 8 clients on uvloop in this process, each pushing 2,000 gradients of 64 KiB
    (ASP, add rule, ones): w == 16,000 everywhere, 16,000 updates applied, none duplicate or
    rejected, no client retried, and neither log holds a warning, an error or a traceback."""
    assert uvloop is not None
    caplog.set_level(logging.DEBUG, logger="paramserver")
    server = ServerProcess(tmp_path, "--consistency", "asp")
    try:
        maps = Path(f"/proc/{server.proc.pid}/maps")
        if maps.exists():
            assert "uvloop" in maps.read_text(), "the server does not run on uvloop"
        grad = np.ones(ELEMENTS, np.float32)

        async def worker(i: int) -> int:
            async with connect(server.address, f"w{i}") as ps:
                if i == 0:
                    await ps.init({"w": np.zeros(ELEMENTS, np.float32)}, rule=ADD)
                else:

                    async def declared() -> bool:
                        return "w" in {k.key for k in (await ps.status()).keys}

                    await eventually(declared, what="key w declared")
                duplicates = 0
                for _ in range(PUSHES):
                    duplicates += (await ps.push({"w": grad})).duplicate
                return duplicates

        async def main() -> tuple[list[int], np.ndarray, object]:
            assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
            duplicates = await asyncio.gather(*(worker(i) for i in range(WORKERS)))
            async with connect(server.address, "observer") as ps:
                return duplicates, (await ps.pull(["w"], observer=True))["w"], await ps.status()

        start = time.monotonic()
        duplicates, w, status = uvloop.run(main())
        elapsed_s = time.monotonic() - start
    finally:
        rc = server.stop(signal.SIGTERM)
    log = server.log()
    assert rc == 0, log
    print(f"8 x 2000 pushes of 64 KiB under uvloop: {elapsed_s:.1f} s")
    assert duplicates == [0] * WORKERS
    assert w.tobytes() == np.full(ELEMENTS, WORKERS * PUSHES, np.float32).tobytes()
    assert status.applied_updates == WORKERS * PUSHES  # type: ignore[attr-defined]
    assert status.rejected_pushes == 0  # type: ignore[attr-defined]
    assert status.duplicate_pushes == 0  # type: ignore[attr-defined]
    for word in ("WARNING", "ERROR", "CRITICAL", "Traceback", "Exception"):
        assert word not in log, log
    client_problems = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING or "retry" in r.getMessage()
    ]
    assert client_problems == []
