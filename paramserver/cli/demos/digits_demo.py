"""``paramserver demo`` and ``torch-demo``: the digits job on a local cluster.

Starts ``--shards`` servers and ``--workers`` ``paramserver worker`` processes on 127.0.0.1
(under each ``--consistency`` model in turn), prints worker 0's per-epoch loss and test
accuracy with every worker's loss, and the final test accuracy of the cluster's parameters
against ``--min-accuracy``; ``--plot`` draws the accuracy curves. The job itself is
:mod:`paramserver.cli.demos.digits`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paramserver.cli.demos.digits import ProgressEvent, digits_model, load_digits_split
from paramserver.cli.demos.local_cluster import start_servers, stop_servers
from paramserver.errors import InvalidArgument, Unavailable
from paramserver.waiting import Wait
from paramserver.worker_client.cluster import connect


def compression_note(kind: str, topk_ratio: float) -> str:
    """The demo's start line says when pushed gradients are compressed (empty when not)."""
    if kind == "none":
        return ""
    if kind == "topk":
        return f", compression topk ({topk_ratio:g} of entries, error feedback)"
    return f", compression {kind} (gradients cast for the wire)"


def _model_label(consistency: str, staleness: int) -> str:
    return f"ssp (s={staleness})" if consistency == "ssp" else consistency


def check_demo_args(args: argparse.Namespace) -> None:
    """Refuse bad demo flags before any process starts (not after minutes of training).

    Raises:
        InvalidArgument: the flag and its value named (INVALID_ARGUMENT; exit 2).
        SystemExit: ``--plot`` without matplotlib installed.
    """
    from paramserver.server.config import ServerConfig

    for flag, value, low in (
        ("--workers", args.workers, 1),
        ("--epochs", args.epochs, 1),
        ("--batch-size", args.batch_size, 1),
        ("--shards", args.shards, 1),
        ("--staleness", args.staleness, 0),
        ("--hidden", args.hidden, 0),
        ("--lease-ms", args.lease_ms, 1),
    ):
        if value < low:
            raise InvalidArgument(f"{flag} must be >= {low}, got {value}")
    if not args.timeout_s > 0:
        raise InvalidArgument(f"--timeout-s must be > 0, got {args.timeout_s}")
    if not 0 < args.topk_ratio <= 1:
        raise InvalidArgument(f"--topk-ratio must be in (0, 1], got {args.topk_ratio}")
    for consistency in args.consistency:  # what the demo's servers would refuse, refused here
        ServerConfig(
            consistency=consistency,
            staleness=args.staleness,
            aggregation=args.aggregation,
            lease_ms=args.lease_ms,
            **({"slice_bytes": args.slice_bytes} if args.slice_bytes is not None else {}),
        )
    if args.plot is not None:
        from paramserver.cli.demos.plot import require_matplotlib

        require_matplotlib()
        import matplotlib.figure

        kinds = matplotlib.figure.Figure().canvas.get_supported_filetypes()
        suffix = args.plot.suffix.lower().lstrip(".")
        if suffix not in kinds:
            raise InvalidArgument(
                f"--plot {str(args.plot)!r}: the file name must end in a figure format "
                f"matplotlib writes ({', '.join('.' + k for k in sorted(kinds))})"
            )


def cmd_demo(args: argparse.Namespace) -> int:
    if getattr(args, "model", "digits") == "movielens":
        from paramserver.cli.demos import movielens

        return movielens.main(args)
    check_demo_args(args)
    curves: dict[str, list[tuple[float, float]]] = {}
    finals: dict[str, float] = {}
    rc = 0
    for consistency in args.consistency:
        code, curve, final = _demo_run(args, consistency)
        label = _model_label(consistency, args.staleness)
        curves[label] = curve
        finals[label] = final
        rc = rc or code
    if len(args.consistency) > 1:
        print(
            "summary: "
            + ", ".join(f"{label} {acc:.4f}" for label, acc in finals.items())
            + f" (bar {args.min_accuracy:.2f}): {'OK' if rc == 0 else 'FAILED'}",
            flush=True,
        )
    if args.plot is not None:
        from paramserver.cli.demos.plot import plot_accuracy_curves

        for label in [label for label, points in curves.items() if not points]:
            print(f"plot: no accuracy reports from the {label} run; left out", file=sys.stderr)
            del curves[label]
        if not curves:
            print("plot: nothing to plot, no file written", file=sys.stderr)
            return rc or 1
        path = plot_accuracy_curves(
            curves,
            args.plot,
            title=(
                f"paramserver demo: {args.workers} {args.framework} workers, digits, "
                f"{args.epochs} epochs"
            ),
            bar=args.min_accuracy,
        )
        print(f"plot: {path} ({len(curves)} curves: {', '.join(curves)})", flush=True)
    return rc


def _demo_run(
    args: argparse.Namespace, consistency: str
) -> tuple[int, list[tuple[float, float]], float]:
    """One local cluster under ``consistency``; returns (exit code, worker 0's
    (seconds since start, test accuracy) points, final test accuracy)."""
    py = sys.executable
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    with tempfile.TemporaryDirectory(prefix="paramserver-demo-") as tmp:
        server_cmd = [
            py,
            "-m",
            "paramserver",
            "--log-level",
            "WARNING",
            "serve",
            "--consistency",
            consistency,
            "--staleness",
            str(args.staleness),
            "--aggregation",
            args.aggregation,
            "--lease-ms",
            str(args.lease_ms),
        ]
        if args.no_uvloop:
            server_cmd.append("--no-uvloop")
        try:
            servers, addresses = start_servers(
                server_cmd, args.shards, Path(tmp), env=env, slice_bytes=args.slice_bytes
            )
        except Unavailable as exc:  # its own error line is already on stderr
            raise Unavailable(f"the demo's parameter server did not start: {exc.message}") from None
        workers: list[subprocess.Popen[str]] = []
        try:
            address = addresses[0]  # any shard: workers fetch the shard map from it
            where = address if args.shards == 1 else f"{args.shards} shards {','.join(addresses)}"
            print(
                f"paramserver demo: server on {where} ({consistency}"
                f"{f', staleness {args.staleness}' if consistency == 'ssp' else ''}), "
                f"{args.workers} {args.framework} workers, {args.epochs} epochs on digits"
                f"{compression_note(args.compression, args.topk_ratio)}",
                flush=True,
            )
            t0 = time.monotonic()
            for i in range(args.workers):
                cmd = [
                    py,
                    "-m",
                    "paramserver",
                    "--log-level",
                    "WARNING",
                    "worker",
                    "--progress",  # parsed below; the workers' own logs keep the user's format
                    "json",
                    "--server",
                    address,
                    "--worker-index",
                    str(i),
                    "--num-workers",
                    str(args.workers),
                    "--epochs",
                    str(args.epochs),
                    "--batch-size",
                    str(args.batch_size),
                    "--lr",
                    str(args.lr),
                    "--momentum",
                    str(args.momentum),
                    "--hidden",
                    str(args.hidden),
                    "--seed",
                    str(args.seed),
                    "--compression",
                    args.compression,
                    "--topk-ratio",
                    str(args.topk_ratio),
                    "--framework",
                    args.framework,
                    "--min-accuracy",  # the demo's bar, not the worker's default
                    str(args.min_accuracy),
                ]
                if i != 0:
                    cmd.append("--no-eval")
                if args.no_uvloop:
                    cmd.append("--no-uvloop")
                workers.append(
                    subprocess.Popen(
                        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                    )
                )
            rc, curve = _follow(workers, args, t0)
            accuracy_final = _final_accuracy(address, args)
            elapsed = time.monotonic() - t0
            ok = rc == 0 and accuracy_final >= args.min_accuracy
            print(
                f"final test accuracy {accuracy_final:.4f} (bar {args.min_accuracy:.2f}) in "
                f"{elapsed:.1f} s: {'OK' if ok else 'FAILED'}",
                flush=True,
            )
            return (0 if ok else 1), curve, accuracy_final
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
                    w.wait()
            stop_servers(servers)


def _follow(
    workers: list[subprocess.Popen[str]], args: argparse.Namespace, t0: float
) -> tuple[int, list[tuple[float, float]]]:
    """Print worker 0's per-epoch report as it arrives, with every worker's loss.

    Returns:
        The exit code (1 when a worker failed or the demo timed out) and worker 0's (seconds
        since every worker registered, test accuracy) points: its ``start`` and ``epoch``
        reports.
    """
    import queue
    import threading

    lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
    last_errors = [collections.deque[str](maxlen=3) for _ in workers]
    pumps: list[threading.Thread] = []

    def pump(i: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put((i, line))
        lines.put((i, None))

    def pump_errors(i: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:  # passed on as they come (JSON log lines stay JSON), the
            sys.stderr.write(line)  # last ones kept to say why the worker failed
            sys.stderr.flush()
            if line.strip():
                last_errors[i].append(line.strip())

    for i, w in enumerate(workers):
        threading.Thread(target=pump, args=(i, w), daemon=True).start()
        pumps.append(threading.Thread(target=pump_errors, args=(i, w), daemon=True))
        pumps[-1].start()
    losses: dict[int, dict[int, float]] = {}
    curve: list[tuple[float, float]] = []
    open_streams = len(workers)
    deadline = time.monotonic() + args.timeout_s
    started: set[int] = set()  # workers past their start barrier
    # Until every worker trains, the demo waits for them (reported: paramserver.waiting).
    starting: Wait | None = Wait(
        f"{len(workers)} workers to start training",
        detail=f"0 of {len(workers)} started",
        deadline=deadline,
    ).open()
    try:
        while open_streams:
            try:
                if starting is not None:
                    starting.tick()
                    i, line = lines.get(timeout=max(0.05, min(0.25, deadline - time.monotonic())))
                else:
                    i, line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                if time.monotonic() < deadline:
                    continue
                print(f"demo timed out after {args.timeout_s} s", file=sys.stderr)
                return 1, curve
            if line is None:
                open_streams -= 1
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                print(f"[worker {i}] {line.rstrip()}")
                continue
            if starting is not None and event.get("event") in ("start", "epoch", "done"):
                started.add(i)
                starting.update(detail=f"{len(started)} of {len(workers)} started")
                if len(started) == len(workers):
                    starting.close()
                    starting = None
            _show_event(i, event, args, t0, losses, curve, len(workers))
    finally:
        if starting is not None:
            starting.close()
    rc = 0
    for i, w in enumerate(workers):
        code = w.wait(timeout=max(1.0, deadline - time.monotonic()))
        pumps[i].join(timeout=2.0)  # its stderr is read to the end
        if code != 0:
            reason = " | ".join(last_errors[i]) or "no error output"
            print(f"worker {i} exited with code {code}: {reason}", file=sys.stderr)
            rc = 1
    return rc, curve


def _show_event(
    i: int,
    event: ProgressEvent,
    args: argparse.Namespace,
    t0: float,
    losses: dict[int, dict[int, float]],
    curve: list[tuple[float, float]],
    workers: int,
) -> None:
    """Take in worker ``i``'s progress ``event``: worker 0's accuracy goes on ``curve``, every
    worker's epoch loss into ``losses``, and worker 0's epoch is printed."""
    if i == 0 and "test_accuracy" in event:
        if event.get("event") == "start":
            curve.append((0.0, float(event["test_accuracy"])))
        elif event.get("event") == "epoch" and "train_elapsed_s" in event:
            curve.append((float(event["train_elapsed_s"]), float(event["test_accuracy"])))
    if event.get("event") == "epoch":
        epoch = int(event["epoch"])
        losses.setdefault(epoch, {})[i] = float(event["loss"])
        if i == 0:
            per = losses[epoch]
            print(
                f"epoch {event['epoch']:>3}/{args.epochs}  loss {event['loss']:.4f}  "
                f"test accuracy {event.get('test_accuracy', float('nan')):.4f}  "
                # seconds since every worker registered: the plot's time axis too
                f"clock {event['clock']}  "
                f"[{event.get('train_elapsed_s', time.monotonic() - t0):6.1f} s]  "
                f"({len(per)}/{workers} workers reported)",
                flush=True,
            )


def _final_accuracy(address: str, args: argparse.Namespace) -> float:
    from paramserver.serving.bootstrap import run_loop

    async def read() -> float:
        async with connect(address, worker_name="demo-evaluator", heartbeat=False) as ps:
            params = await ps.pull(observer=True)
        data = load_digits_split(args.seed)
        model = digits_model(args.framework, args.hidden, args.seed)
        return model.accuracy(params, data.x_test, data.y_test)

    return float(run_loop(read(), use_uvloop=not args.no_uvloop))
