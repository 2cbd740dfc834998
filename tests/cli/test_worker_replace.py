"""``paramserver worker --replace``: a restarted worker takes over its name while the old
registration's lease is still live (issue 19, item 8); without it the refusal says to pass
``--replace`` (issue 28)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from paramserver.worker_client import connect_sync
from tests.harness import ServerProcess

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def _worker(address: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "paramserver",
            "worker",
            "--server",
            address,
            "--worker-index",
            "0",
            "--num-workers",
            "1",
            "--epochs",
            "1",
            "--no-eval",
            "--min-accuracy",
            "0",
            "--progress",
            "json",  # one JSON object per event: the test reads the "done" event
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=150,
    )


def test_worker_replace_takes_over_a_live_name(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path, "--consistency", "asp", "--lease-ms", "60000")
    try:
        old = connect_sync(server.address, "worker-0", heartbeat=False).open()
        try:
            refused = _worker(server.address)
            assert refused.returncode == 1, refused.stderr
            assert "AlreadyExists (ALREADY_EXISTS)" in refused.stderr, refused.stderr
            # the hint names the flag a command-line user passes, not the Python keyword
            assert "pass --replace to fence it" in refused.stderr, refused.stderr
            assert "replace=True" not in refused.stderr, refused.stderr
            replaced = _worker(server.address, "--replace")
            assert replaced.returncode == 0, replaced.stderr
            assert '"event": "done"' in replaced.stdout
        finally:
            try:
                old.close()
            except Exception:  # the fenced registration's leave is refused
                pass
    finally:
        server.stop()


def test_worker_help_documents_replace() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "paramserver", "worker", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "--replace" in out.stdout and "AlreadyExists" in out.stdout
