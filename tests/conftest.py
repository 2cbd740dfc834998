"""Shared fixtures and checks of the whole suite.

* Event loops: async tests run on the default asyncio loop and on uvloop, except tests marked
  ``slow`` (subprocess-heavy: what they test runs in the processes they start, whose loop is
  their own), which run on asyncio only unless also marked ``both_loops``.
* No process left behind: every process a test starts carries ``PARAMSERVER_TEST_SESSION`` (a
  token of this run) and ``PARAMSERVER_TEST_OWNER`` (the test that was running) in its
  environment, inherited from this one. When the session ends, any process still running that
  carries the token, or descends from this pytest process, is listed with its owner and
  command line, killed, and the run fails (exit status 1), pass or fail of the tests.
* Deadlines scale with the machine: each test's pytest-timeout limit (its ``timeout`` mark, or
  the ini's 120 s) is multiplied, when the test starts, by ``harness.timing.time_scale()``:
  ``PARAMSERVER_TEST_TIME_SCALE`` (default 1) times the load average per core when above 1.
  The harness's own waits scale the same way.
* Parallel runs (``pytest -n N``, pytest-xdist): the whole run shares one token; each xdist
  worker checks, when it finishes, the processes its own tests started (their environment
  names the worker in ``PYTEST_XDIST_WORKER``), kills them and reports them to the
  controller, which checks everything carrying the token once its workers are gone, lists
  every finding and fails the run.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Callable, Generator, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.harness.timing import time_scale

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a runtime dependency on POSIX
    uvloop = None

SESSION_ENV = "PARAMSERVER_TEST_SESSION"
OWNER_ENV = "PARAMSERVER_TEST_OWNER"
#: Set by pytest-xdist in each of its worker processes (``gw0``, ``gw1``, ...).
XDIST_WORKER_ENV = "PYTEST_XDIST_WORKER"
#: How long processes still exiting (SIGTERM sent, being reaped) get before they count as left.
LEFT_GRACE_S = 10.0
#: Helper processes of the Python runtime that end with their parent, not with a test.
_PYTHON_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "both_loops: a slow test that still runs on asyncio and on uvloop"
    )
    os.environ.setdefault(SESSION_ENV, uuid.uuid4().hex)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop
    }
    if "conformance" in item.nodeid.split("::")[0].split("/"):
        return factories  # the server is under test there, not the client's event loop
    slow = item.get_closest_marker("slow") is not None
    if uvloop is not None and (not slow or item.get_closest_marker("both_loops") is not None):
        factories["uvloop"] = uvloop.new_event_loop
    return factories


def _idle_timeout_s(item: pytest.Item) -> float:
    """The test's pytest-timeout limit as written: its ``timeout`` mark, else the ini's."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    if marker is not None and "timeout" in marker.kwargs:
        return float(marker.kwargs["timeout"])
    return float(item.config.getini("timeout") or 0)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # before pytest-timeout reads the mark
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    idle_s = _idle_timeout_s(item)
    if idle_s > 0:
        marker = item.get_closest_marker("timeout")
        kwargs = {k: v for k, v in (marker.kwargs if marker else {}).items() if k != "timeout"}
        item.add_marker(pytest.mark.timeout(idle_s * time_scale(), **kwargs), append=False)
    os.environ[OWNER_ENV] = item.nodeid  # inherited by every process the test starts
    try:
        yield
    finally:
        os.environ.pop(OWNER_ENV, None)


# ---------------------------------------------------------------------- processes left behind
def _proc_environ(pid: str) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for entry in raw.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep and name in (SESSION_ENV.encode(), OWNER_ENV.encode(), XDIST_WORKER_ENV.encode()):
            out[name.decode()] = value.decode(errors="replace")
    return out


def _stat(pid: str) -> tuple[str, int] | None:
    """(state, parent pid) of a process, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def _cmdline(pid: str) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:300]


def processes_left(token: str, root: int, worker: str | None = None) -> dict[int, str]:
    """Live processes (zombies excluded) carrying ``token`` (and, when ``worker`` is given,
    started under that xdist worker) or descending from ``root``: pid -> "owner test: command
    line"."""
    if not Path("/proc/self/stat").exists():  # pragma: no cover - Linux only
        return {}
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != root:
            st = _stat(entry)
            if st is not None and st[0] != "Z":
                stats[int(entry)] = st[1]
    left = {}
    for pid in stats:
        env = _proc_environ(str(pid))
        descends, seen, p = False, set(), pid
        while p in stats and p not in seen:
            seen.add(p)
            p = stats[p]
            if p == root:
                descends = True
                break
        mine = env.get(SESSION_ENV) == token and (
            worker is None or env.get(XDIST_WORKER_ENV) == worker
        )
        if mine or descends:
            command = _cmdline(str(pid))
            if any(helper in command for helper in _PYTHON_HELPERS):
                continue  # lives as long as pytest itself, by design
            owner = env.get(OWNER_ENV, "unknown test")
            left[pid] = f"{owner}: {command}"
    return left


#: What the xdist workers reported left behind (controller only), in ``pytest_testnodedown``.
_LEFT_BY_WORKERS: list[str] = []
#: The ``workeroutput`` key a worker reports its left-behind processes under.
_WORKER_OUTPUT_KEY = "paramserver_processes_left"


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """(pytest-xdist, controller) A worker finished: keep what it found left behind."""
    output = getattr(node, "workeroutput", None) or {}
    _LEFT_BY_WORKERS.extend(output.get(_WORKER_OUTPUT_KEY, []))


@pytest.hookimpl(trylast=True)  # under xdist, after the controller has stopped its workers
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    token = os.environ.get(SESSION_ENV, "")
    me = os.getpid()
    worker = os.environ.get(XDIST_WORKER_ENV)
    deadline = time.monotonic() + LEFT_GRACE_S
    left = processes_left(token, me, worker)
    while left and time.monotonic() < deadline:  # processes being stopped get a moment
        time.sleep(0.2)
        left = processes_left(token, me, worker)
    lines = [f"  pid {pid}  {what}" for pid, what in sorted(left.items())]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its controller reports and fails the run
        workeroutput[_WORKER_OUTPUT_KEY] = [f"{line}  [{worker}]" for line in lines]
        return
    lines += _LEFT_BY_WORKERS
    if not lines:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = (
        f"{len(lines)} process(es) started by tests were still running at the end of the "
        "session (now killed):\n" + "\n".join(lines)
    )
    if reporter is not None:
        reporter.write_sep("=", "processes left behind", red=True)
        reporter.write_line(message)
    else:  # pragma: no cover
        print(message)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
