"""The daemon as a real process: graceful SIGTERM, final checkpoint, restore, status CLI."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from paramserver.worker_client import UpdateRule, connect_sync
from tests.harness import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


def test_sigterm_checkpoints_and_restart_restores(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    server = ServerProcess(tmp_path, "--consistency", "asp", "--checkpoint-dir", str(ckpt))
    try:
        with connect_sync(server.address, "w0") as ps:
            ps.init({"w": np.zeros(3, np.float32)}, UpdateRule("sgd", lr=0.5))
            for _ in range(4):
                ps.push({"w": np.ones(3, np.float32)})
            ps.clock()
    finally:
        t0 = time.monotonic()
        assert server.stop(signal.SIGTERM) == 0, server.log()
        assert time.monotonic() - t0 < 10
    assert len(list(ckpt.glob("ckpt-*"))) == 1

    restarted = ServerProcess(tmp_path, "--consistency", "asp", "--checkpoint-dir", str(ckpt))
    try:
        with connect_sync(restarted.address, "w1") as ps:
            got = ps.pull(["w"])["w"]
            status = ps.status()
            assert ps.clock_value == 1  # a late joiner starts at the restored minimum clock
    finally:
        restarted.stop()
    np.testing.assert_array_equal(got, np.full(3, -2.0, np.float32))
    assert status.applied_updates == 4


def test_status_cli_prints_json(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path, "--consistency", "ssp", "--staleness", "3")
    try:
        with connect_sync(server.address, "w0") as ps:
            ps.init({"k": np.zeros(2)}, UpdateRule("add"))
            out = subprocess.run(
                [sys.executable, "-m", "paramserver", "status", "--json", server.address],
                capture_output=True,
                text=True,
                timeout=30,
            )
    finally:
        server.stop()
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["view"]["consistency"] == "CONSISTENCY_SSP"
    assert status["view"]["staleness"] == 3
    assert status["keys"][0]["key"] == "k"
    assert status["workers"][0]["worker_name"] == "w0"
    # Zero/false fields are printed, and 64-bit integers are JSON numbers (not strings).
    assert status["applied_updates"] == 0
    assert status["keys"][0]["shape"] == [2]
    assert status["keys"][0]["size_bytes"] == 16
    assert status["workers"][0]["clock"] == 0
    assert status["dropped_updates"]["duplicate"] == 0


def test_bad_configuration_exits_2_with_a_clear_message() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "paramserver", "serve", "--port", "0"],
        env={"PARAMSERVER_LEASE_MS": "soon", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "PARAMSERVER_LEASE_MS" in proc.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_serve_keeps_freed_memory_unless_told_not_to(tmp_path: Path) -> None:
    from paramserver.server.allocator import _glibc

    if _glibc() is None:
        pytest.skip("needs glibc")
    logs = {}
    for name, args, env in (
        ("default", (), {}),
        ("flag", ("--malloc-retain-bytes", str(64 << 20)), {}),
        ("off", (), {"PARAMSERVER_MALLOC_RETAIN_BYTES": "0"}),
        ("user", (), {"MALLOC_TRIM_THRESHOLD_": "131072"}),
    ):
        server = ServerProcess(tmp_path, "--consistency", "asp", *args, env=env)
        try:
            with connect_sync(server.address, "w0") as ps:
                ps.init({"w": np.zeros(3, np.float32)}, UpdateRule("sgd", lr=0.5))
        finally:
            assert server.stop() == 0, server.log()
        logs[name] = server.log()
    assert f"freed blocks under {512 << 20} bytes are kept for reuse" in logs["default"]
    assert f"freed blocks under {64 << 20} bytes are kept for reuse" in logs["flag"]
    assert "malloc: glibc's defaults kept (--malloc-retain-bytes 0)" in logs["off"]
    assert "the environment's own glibc malloc settings are used" in logs["user"]
