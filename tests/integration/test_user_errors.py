"""Mistakes a new user makes get a clear, prompt answer (found by trying the README)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from paramserver.errors import InvalidArgument
from paramserver.worker_client import UpdateRule, connect, connect_sync

from .ps_helpers import ServerProcess, running_server

pytestmark = pytest.mark.timeout(90)


async def test_empty_key_is_refused_at_once_not_after_the_retry_deadline() -> None:
    async with running_server(consistency="asp") as srv:
        async with connect(srv.address, "w0") as ps:
            t0 = time.monotonic()
            with pytest.raises(InvalidArgument, match="non-empty"):
                await ps.init({"": np.zeros(2)})
            with pytest.raises(InvalidArgument, match="non-empty"):
                await ps.push({"": np.zeros(2)})
            assert time.monotonic() - t0 < 2.0


def test_restart_without_wal_refuses_to_drop_acknowledged_records(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    server = ServerProcess(tmp_path, "--consistency", "asp", "--checkpoint-dir", str(ckpt), "--wal")
    with connect_sync(server.address, "a") as ps:
        ps.init({"v": np.zeros(4, np.float32)}, UpdateRule("add"))
        ps.push({"v": np.full(4, 3, np.float32)})
        server.stop(signal.SIGKILL)
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "paramserver",
            "serve",
            "--port",
            "0",
            "--consistency",
            "asp",
            "--checkpoint-dir",
            str(ckpt),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert "--wal" in refused.stderr and "Traceback" not in refused.stderr
    again = ServerProcess(tmp_path, "--consistency", "asp", "--checkpoint-dir", str(ckpt), "--wal")
    try:
        with connect_sync(again.address, "b") as ps:
            np.testing.assert_array_equal(ps.pull(["v"])["v"], np.full(4, 3, np.float32))
    finally:
        again.stop()


def test_sigterm_worker_leaves_so_its_name_is_free_at_once(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path, "--consistency", "asp", "--lease-ms", "30000")
    try:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "paramserver",
                "worker",
                "--server",
                server.address,
                "--worker-index",
                "0",
                "--num-workers",
                "1",
                "--epochs",
                "1000",
                "--no-eval",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        with connect_sync(server.address, "probe") as ps:
            deadline = time.monotonic() + 60
            while not any(w.live and w.worker_name == "worker-0" for w in ps.status().workers):
                assert time.monotonic() < deadline, "worker never registered"
                time.sleep(0.05)
            worker.send_signal(signal.SIGTERM)
            _, err = worker.communicate(timeout=30)
            assert worker.returncode == 143, err
            assert "Traceback" not in err
            # the lease is 30 s, yet the name is free now: the worker left cleanly
            live = [w.worker_name for w in ps.status().workers if w.live]
            assert "worker-0" not in live
    finally:
        server.stop()


def test_bind_failure_is_one_line(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path, "--consistency", "asp")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "paramserver", "serve", "--port", str(server.port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        server.stop()
    assert proc.returncode == 1
    assert "could not bind" in proc.stderr and "Traceback" not in proc.stderr
