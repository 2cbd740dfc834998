"""Shared harness of the benchmark scripts in ``benchmarks/`` (not a benchmark itself).

- :func:`emit` prints one JSON line per configuration; :func:`print_table` the closing summary.
- :class:`WorkerPool` runs W worker *processes* (spawned, so no gRPC state crosses a fork), each
  built from a factory named ``"module:function"``; every timed phase starts on a shared
  :class:`multiprocessing.Barrier` and lasts from the earliest start to the latest end
  (``time.monotonic`` is one system-wide clock on Linux, so stamps compare across processes).
- :func:`measure` turns a phase runner into the common figure: a probe phase, then warm-up
  phases until the system stops getting faster (Ray's object store does, for seconds), sizing
  the timed phases to about ``target_s`` seconds; then the median of 3 timed phases.
- :func:`start_paramserver` runs ``paramserver serve`` as a subprocess on 127.0.0.1 and
  :func:`peak_rss_bytes` reads a process's ``VmHWM`` from ``/proc/<pid>/status``.

Units: GB = 1e9 bytes; times in seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import multiprocessing as mp
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent.parent
RESULTS_DIR = BENCH_DIR / "results"
QUICK_ENV = "PARAMSERVER_BENCH_QUICK"
REPEATS = 3
#: Warm-up: phases of about half the timed length, until one is less than this fraction faster
#: per round than the one before, at most :data:`MAX_SETTLE_PHASES` of them.
SETTLE_GAIN = 0.05
MAX_SETTLE_PHASES = 6


def quick_from_env() -> bool:
    """``PARAMSERVER_BENCH_QUICK=1`` makes ``make bench`` a smoke run (same as ``--quick``)."""
    return os.environ.get(QUICK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def emit(record: dict[str, Any]) -> None:
    """Print one configuration's result as a JSON line (flushed at once)."""
    print(json.dumps(record, sort_keys=False, default=_json_default), flush=True)


def _json_default(obj: object) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def machine_info() -> dict[str, Any]:
    """Where the figures come from (cores, memory, Python, key library versions)."""
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["mem_total_gib"] = round(int(line.split()[1]) / (1 << 20), 1)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git = ["git", "-C", str(BENCH_DIR.parent)]
        info["git_commit"] = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "paramserver"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        info["paramserver_tree_dirty"] = bool(dirty)
    with contextlib.suppress(OSError):
        info["load_avg_1m"] = os.getloadavg()[0]
    for mod in ("numpy", "grpc", "ray", "torch"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            info[mod] = None
    return info


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain-text table on stdout (after the JSON lines)."""
    cells = [[str(c) for c in header]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}", flush=False)
    for i, row in enumerate(cells):
        print(
            "  ".join(
                c.rjust(w) if j else c.ljust(w)
                for j, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if i == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


# ---------------------------------------------------------------------- timing
def probe_rounds(n_elements: int) -> int:
    """Rounds of the probe (warm-up) phase: enough to settle, cheap for big tensors."""
    if n_elements <= 10_000:
        return 50
    if n_elements <= 2_000_000:
        return 6
    return 3


def measure(
    run_phase: Callable[[int], float],
    *,
    n_elements: int,
    target_s: float,
    repeats: int = REPEATS,
    min_rounds: int = 3,
) -> dict[str, Any]:
    """Probe, warm up until no longer faster, then time ``repeats`` phases of equal rounds.

    Args:
        run_phase: Runs one phase of the given rounds per worker and returns its duration (s).
        n_elements: Tensor size (elements), for the probe length.
        target_s: Wanted duration of each timed phase.
        repeats: Timed phases (the median is reported).
        min_rounds: Fewest rounds per timed phase.

    Returns:
        ``{"probe_rounds", "warmup_s_per_round", "rounds_per_phase", "phase_s", "median_s"}``
        (``warmup_s_per_round``: seconds per round of each warm-up phase).
    """
    probe = probe_rounds(n_elements)
    per_round = max(run_phase(probe) / probe, 1e-7)
    # Warm up until the system stops getting faster: a fixed short probe times some systems
    # (Ray's object store, 16e6 floats) while they still speed up phase after phase.
    settle: list[float] = []
    for _ in range(MAX_SETTLE_PHASES):
        rounds = max(min_rounds, round(target_s / 2 / per_round))
        now = max(run_phase(rounds) / rounds, 1e-7)
        settle.append(round(now, 9))
        settled = now > per_round * (1 - SETTLE_GAIN)
        per_round = min(per_round, now)
        if settled:
            break
    rounds = max(min_rounds, round(target_s / per_round))
    phases = [run_phase(rounds) for _ in range(repeats)]
    return {
        "probe_rounds": probe,
        "warmup_s_per_round": settle,
        "rounds_per_phase": rounds,
        "phase_s": [round(p, 6) for p in phases],
        "median_s": statistics.median(phases),
    }


def rates(n_elements: int, workers: int, rounds: int, seconds: float) -> dict[str, float]:
    """rounds/s (all workers together) and payload GB/s = 2·N·4·S·W / s (float32 push+pull)."""
    return {
        "rounds_per_s": rounds * workers / seconds,
        "payload_gb_s": 2 * n_elements * 4 * rounds * workers / seconds / 1e9,
    }


# ---------------------------------------------------------------------- worker processes
class WorkerError(RuntimeError):
    """A worker process failed; carries its traceback text."""


def _resolve(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    fn: Callable[..., Any] = getattr(__import__(module, fromlist=[name]), name)
    return fn


def _worker_main(
    factory: str,
    rank: int,
    cfg: dict[str, Any],
    commands: Any,
    results: Any,
    barrier: Any,
) -> None:
    """Entry point of one worker process: build the runner, then obey phase commands."""
    try:
        runner = _resolve(factory)(rank, cfg)
        if inspect.iscoroutinefunction(runner.round):
            _run_async(runner, rank, cfg, commands, results, barrier)
        else:
            _run_sync(runner, rank, commands, results, barrier)
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))


def _run_sync(runner: Any, rank: int, commands: Any, results: Any, barrier: Any) -> None:
    runner.setup()
    results.put(("ready", rank, None))
    step = runner.round
    while True:
        cmd = commands.get()
        if cmd is None:
            results.put(("done", rank, runner.finish()))
            return
        barrier.wait()
        t0 = time.monotonic()
        for _ in range(cmd):
            step()
        results.put(("phase", rank, (t0, time.monotonic())))


def _run_async(
    runner: Any, rank: int, cfg: dict[str, Any], commands: Any, results: Any, barrier: Any
) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        await runner.setup()
        results.put(("ready", rank, None))
        step = runner.round
        while True:
            # Wait in a thread so the loop keeps serving background tasks (heartbeats).
            cmd = await loop.run_in_executor(None, commands.get)
            if cmd is None:
                results.put(("done", rank, await runner.finish()))
                return
            await loop.run_in_executor(None, barrier.wait)
            t0 = time.monotonic()
            for _ in range(cmd):
                await step()
            results.put(("phase", rank, (t0, time.monotonic())))

    if cfg.get("uvloop", True):
        try:
            import uvloop
        except ImportError:
            asyncio.run(main())
        else:
            uvloop.run(main())
    else:
        asyncio.run(main())


class WorkerPool:
    """W spawned worker processes driven phase by phase.

    The factory (``"module:function"``, importable in a fresh interpreter) is called in each
    process as ``factory(rank, cfg)`` and returns a runner with ``setup()``, ``round()`` and
    ``finish() -> dict`` (all three sync, or all three ``async``).

    Args:
        factory: Import path of the runner factory.
        cfg: Picklable configuration handed to every worker.
        workers: Number of worker processes.
        timeout_s: Longest wait for any one worker answer.
    """

    def __init__(
        self, factory: str, cfg: dict[str, Any], workers: int, *, timeout_s: float = 300.0
    ) -> None:
        self.workers = workers
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._commands = [ctx.Queue() for _ in range(workers)]
        self._barrier = ctx.Barrier(workers)
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(factory, rank, cfg, self._commands[rank], self._results, self._barrier),
                name=f"bench-worker-{rank}",
                daemon=True,
            )
            for rank in range(workers)
        ]

    def __enter__(self) -> WorkerPool:
        for p in self._procs:
            p.start()
        self._collect("ready")
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()

    def _collect(self, kind: str) -> list[Any]:
        out: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(out) < self.workers:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerError(f"workers did not answer {kind!r} within {self.timeout_s} s")
            try:
                what, rank, payload = self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [p.name for p in self._procs if p.exitcode not in (None, 0)]
                if dead:
                    raise WorkerError(f"worker process(es) died: {dead}") from None
                continue
            if what == "error":
                raise WorkerError(f"worker {rank} failed:\n{payload}")
            if what != kind:
                raise WorkerError(f"worker {rank} answered {what!r}, expected {kind!r}")
            out[rank] = payload
        return [out[r] for r in range(self.workers)]

    def phase(self, rounds: int) -> float:
        """Every worker runs ``rounds`` rounds from a common barrier; returns the span (s)."""
        for q in self._commands:
            q.put(rounds)
        stamps = self._collect("phase")
        return max(end for _, end in stamps) - min(start for start, _ in stamps)

    def finish(self) -> list[dict[str, Any]]:
        """Stop the workers; returns each one's ``finish()`` report, by rank."""
        for q in self._commands:
            q.put(None)
        reports: list[dict[str, Any]] = self._collect("done")
        return reports


# ---------------------------------------------------------------------- servers
@dataclass
class ServerProcess:
    """A ``paramserver serve`` subprocess bound to 127.0.0.1."""

    proc: subprocess.Popen[bytes]
    address: str
    tmpdir: tempfile.TemporaryDirectory[str]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM (graceful), then SIGKILL after ``timeout_s``; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.tmpdir.cleanup()
        return int(self.proc.returncode)


async def timed_calls(
    clients: Sequence[Any], call: Callable[[Any], Any], seconds: float
) -> tuple[int, float]:
    """Run ``await call(client)`` in a loop on every (opened) client at once for ``seconds``;
    returns (calls completed, elapsed seconds), checked exactly once: the server's applied
    updates (Status of the first client) must equal the calls (each call one push)."""
    counts = [0] * len(clients)
    t0 = time.monotonic()

    async def run(i: int) -> None:
        while time.monotonic() - t0 < seconds:
            await call(clients[i])
            counts[i] += 1

    await asyncio.gather(*(run(i) for i in range(len(clients))))
    elapsed = time.monotonic() - t0
    status = await clients[0].status()
    assert status.applied_updates == sum(counts), (status.applied_updates, counts)
    return sum(counts), elapsed


def start_paramserver(
    args: Sequence[str], *, prefix: Sequence[str] = (), timeout_s: float = 30.0
) -> ServerProcess:
    """Start ``paramserver serve ARGS`` on 127.0.0.1 with an ephemeral port.

    Args:
        args: Extra ``serve`` flags (e.g. ``["--consistency", "asp"]``).
        prefix: Command words before ``-m paramserver`` (e.g. a profiler), after the
            interpreter's own ``-m``-less invocation is built.
        timeout_s: Longest wait for the port file.

    Raises:
        RuntimeError: the server exited or did not report its port in time.
    """
    tmp = tempfile.TemporaryDirectory(prefix="paramserver-bench-")
    port_file = Path(tmp.name) / "port"
    cmd = [
        *(prefix or [sys.executable]),
        "-m",
        "paramserver",
        "--log-level",
        "WARNING",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        *args,
    ]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_file.exists():
            port = port_file.read_text().strip()
            return ServerProcess(proc, f"127.0.0.1:{port}", tmp)
        if proc.poll() is not None:
            tmp.cleanup()
            raise RuntimeError(f"paramserver serve exited with code {proc.returncode}")
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    tmp.cleanup()
    raise RuntimeError(f"paramserver serve did not report its port within {timeout_s} s")


@contextlib.contextmanager
def paramserver(args: Sequence[str], **kwargs: Any) -> Iterator[ServerProcess]:
    """``with paramserver([...]) as server:`` — started, then stopped gracefully."""
    server = start_paramserver(args, **kwargs)
    try:
        yield server
    finally:
        server.stop()


def proc_status(pid: int) -> dict[str, int]:
    """``VmRSS`` / ``VmHWM`` (bytes) of a live process, from ``/proc/<pid>/status``."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(rest.split()[0]) * 1024
    return out


def peak_rss_bytes(pid: int) -> int:
    """Peak resident set (``VmHWM``) of a live process, in bytes."""
    return proc_status(pid)["VmHWM"]


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (for libraries that want a port up front)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def observer_read(address: str, keys: Sequence[str] = ()) -> tuple[Any, dict[str, Any]]:
    """Status and an observer pull (no registration, no wait) of a running server.

    Returns:
        ``(StatusResponse, {key: ndarray})``.
    """
    import grpc

    from paramserver.api.v1 import parameter_server_pb2 as pb
    from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
    from paramserver.protocol import tensor

    async def read() -> tuple[Any, dict[str, Any]]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.ParameterServerStub(channel)
            status = await stub.Status(pb.StatusRequest(), timeout=60)
            assembler = tensor.TensorAssembler()
            values: dict[str, Any] = {}
            async for resp in stub.Pull(pb.PullRequest(keys=list(keys)), timeout=300):
                if resp.WhichOneof("body") == "frame":
                    done = assembler.feed(resp.frame)
                    if done is not None:
                        values[done[0]] = done[1]
            assembler.finish()
            return status, values

    return asyncio.run(read())
