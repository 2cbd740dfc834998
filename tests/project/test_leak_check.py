"""The session's check for processes left behind (tests/conftest.py) finds an orphan too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import SESSION_ENV, XDIST_WORKER_ENV, processes_left

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
ROOT = Path(__file__).resolve().parents[2]


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


LEAKY_TEST = """
import subprocess, sys

def test_leaks_a_sleeper():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                     start_new_session=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("parallel", [[], ["-n", "2"]], ids=["one process", "xdist -n 2"])
def test_a_run_whose_test_leaves_a_process_fails_naming_it(
    tmp_path: Path, parallel: list[str]
) -> None:
    """A whole pytest run (this suite's conftest as a plugin) over one passing test that leaves
    a process running: the run exits 1 and names the test and the process, also when an
    xdist worker found it."""
    (tmp_path / "test_leaky.py").write_text(LEAKY_TEST)
    env = {k: v for k, v in os.environ.items() if k not in (SESSION_ENV, XDIST_WORKER_ENV)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "-q", "--rootdir", str(tmp_path), "-o", "addopts=", *parallel,
         str(tmp_path / "test_leaky.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 passed" in out.stdout, out.stdout
    assert "processes left behind" in out.stdout, out.stdout
    assert "test_leaky.py::test_leaks_a_sleeper" in out.stdout, out.stdout
    assert "time.sleep(120)" in out.stdout, out.stdout
