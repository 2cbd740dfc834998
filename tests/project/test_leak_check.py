"""The session's check for processes left behind (tests/conftest.py) finds an orphan too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import SESSION_ENV, XDIST_WORKER_ENV, processes_left

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_an_orphaned_grandchild_is_found_by_its_session_token() -> None:
    """A child starts a sleeper and exits at once: the sleeper is re-parented (no longer a
    descendant of pytest) yet carries the session token in its environment."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(60)'], start_new_session=True, "
            "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    orphan = int(out.stdout)
    try:
        left = processes_left(os.environ[SESSION_ENV], os.getpid())
        assert orphan in left
        assert "test_an_orphaned_grandchild_is_found_by_its_session_token" in left[orphan]
        assert "time.sleep(60)" in left[orphan]
        # a parallel run's worker counts only what its own tests started
        mine = os.environ.get(XDIST_WORKER_ENV)
        assert orphan not in processes_left(os.environ[SESSION_ENV], os.getpid(), "gw-other")
        if mine is not None:
            assert orphan in processes_left(os.environ[SESSION_ENV], os.getpid(), mine)
    finally:
        os.kill(orphan, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while orphan in processes_left(os.environ[SESSION_ENV], os.getpid()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
