"""Push+pull throughput: paramserver side by side with Ray, torch.distributed.rpc and ceilings.

The common workload of issue 7: one server shard holding one dense float32 tensor of N elements;
W worker processes; each round a worker pushes a gradient of N float32 (all ones) and pulls the
whole tensor back; ASP, the server applies ``w -= lr * g`` (sgd, lr = 2**-10) on every push.
Every timed phase starts on a barrier; a probe phase (also the warm-up) sizes the phases to about
``--phase-s`` seconds; the median of 3 timed phases is reported as

- ``rounds_per_s``: rounds of all workers together per second (S·W / s);
- ``payload_gb_s``: 2·N·4·S·W / s / 1e9 (bytes pushed plus bytes pulled).

Afterwards every update is checked to have been applied exactly once: the server's applied-update
count equals the pushes the workers made, and the value equals ``-lr * pushes`` exactly (every
such value is representable in float32 here).

Systems (each config of each system runs in a fresh subprocess, config by config so that the
ratios compare figures taken close in time on a noisy host; a missing system is reported as
skipped, with the reason, in its JSON line):

- ``paramserver``: ``paramserver serve --consistency asp`` + :class:`WorkerClient.push_pull`
  (one round trip per round on the persistent Session, which moves from its gRPC stream to the
  server's local-link Unix socket since client and server share the host; tensor bytes inline
  when small, through shared memory otherwise), on uvloop.
- ``paramserver-view``: the same, pulling with ``copy=False`` (the pulled values are views of
  the client's shared-memory pull region, valid until its next request: no copy out, as Ray's
  ``ray.get`` hands back zero-copy read-only views of its object store).
- ``paramserver-grpc``: the same with the Session kept on its gRPC stream (``local_link=False``;
  ``paramserver`` moves it to the server's same-host local-link socket).
- ``paramserver-net``: the same with shared memory off on both sides (``--no-shared-memory``,
  ``shared_memory=False``), as between hosts: small tensors inline on the Session stream, large
  ones over the chunked Push and Pull streams.
- ``ray``: a Ray actor parameter server (``benchlib/ray_ps.py``), one call per round.
- ``torch_rpc``: a torch.distributed.rpc parameter server (``benchlib/torch_rpc_ps.py``).
- ``grpc_raw`` (a new bidi stream echo per round, 1 MiB chunks; the issue's "raw grpc.aio
  stream echo"), ``grpc_raw_unary`` (one unary echo per round), ``grpc_raw_session`` (one
  long-lived bidi stream), ``socket`` (TCP ping-pong of blocking sockets), ``asyncio_unix``
  (a uvloop ``asyncio.Protocol`` echo of length-prefixed frames on an abstract Unix socket: the
  local link's transport, framing and event loops with no work on either side, so the floor
  of any asyncio request/reply design on this host), ``memcpy``: the ceilings
  (``benchlib/ceilings.py``).

``--model resnet50|resnet18|bert-base`` (comma-separated for several) runs the workload of a real
model instead: one float32 key per parameter tensor of that architecture (shapes written out in
``benchlib/models.py``, their count and total checked against the documented figures), every key
pushed and pulled in one ``push_pull`` per round (Ray: one ``apply_gradient_list`` call with the
list of arrays; torch.rpc: one ``rpc_sync`` with the list of tensors; the fused one-call
patterns). Each system of each model config also runs the same bytes as *one* tensor (``layout``
``flat``) right after it, so the per-key cost reads off directly::

    us_per_key = (s_per_round[model] - s_per_round[flat]) / (keys - 1)

The ceilings (``grpc_raw*``, ``memcpy``...) run the flat bytes only. The model default systems
are ``paramserver``, ``paramserver-net``, ``ray``, ``torch_rpc``, ``grpc_raw``,
``grpc_raw_session`` and ``memcpy``.

``--profile-server DIR`` samples the paramserver server with py-spy during each config and writes
a collapsed-stack file plus a summary of the hottest functions.

Usage: ``python benchmarks/push_pull.py [--quick] [--systems paramserver,ray] [--sizes 1000]``,
``python benchmarks/push_pull.py --model resnet50 --workers 1,2``.
Everything runs on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import benchlib
import numpy as np
from benchlib import models, profile
from benchlib.ps_worker import keys_for

SYSTEMS = (
    "paramserver",
    "paramserver-view",
    "paramserver-grpc",
    "paramserver-net",
    "ray",
    "torch_rpc",
    "grpc_raw",
    "grpc_raw_unary",
    "grpc_raw_session",
    "grpc_raw_seq",
    "socket",
    "asyncio_unix",
    "memcpy",
)
RAW_GRPC = ("grpc_raw", "grpc_raw_unary", "grpc_raw_session")
PEERS = ("ray", "torch_rpc")
MODEL_SYSTEMS = (
    "paramserver",
    "paramserver-net",
    "ray",
    "torch_rpc",
    "grpc_raw",
    "grpc_raw_session",
    "memcpy",
)
#: Systems that hold keys (run in both layouts of a model config); the rest move bytes only.
KEYED = ("paramserver", "paramserver-view", "paramserver-grpc", "paramserver-net", *PEERS)
LR = 2.0**-10
DEFAULT_SIZES = (1_000, 1_000_000, 16_000_000)
QUICK_SIZES = (1_000, 1_000_000)
DEFAULT_WORKERS = (1, 2)
DEFAULT_PHASE_S = 1.0
QUICK_PHASE_S = 0.25
SYSTEM_TIMEOUT_S = 600.0  # per child process (one system, its configs)


def _record(system: str, n: int, workers: int) -> dict[str, Any]:
    return {"bench": "push_pull", "system": system, "n": n, "workers": workers}


def _layout(args: argparse.Namespace) -> dict[str, Any]:
    """``{"model", "layout", "keys"}`` of the running child (empty for a plain size run)."""
    if not getattr(args, "model", None):
        return {}
    keys = len(args.shapes) if args.shapes else 1
    return {"model": args.model[0], "layout": args.layout, "keys": keys}


def _configs(args: argparse.Namespace) -> list[tuple[int, int]]:
    return [(n, w) for n in args.sizes for w in args.workers]


def _result_record(
    system: str,
    n: int,
    workers: int,
    result: dict[str, Any],
    extra: dict[str, Any],
    layout: dict[str, Any] | None = None,
) -> dict[str, Any]:
    layout = layout or {}
    rec = _record(system, n, workers)
    rec.update(benchlib.rates(n, workers, result["rounds_per_phase"], result["median_s"]))
    rec.update(result)
    rec.update(extra)
    rec.update(layout)
    return rec


# ---------------------------------------------------------------------- paramserver
def _run_paramserver(args: argparse.Namespace, system: str = "paramserver") -> None:
    network_only = system == "paramserver-net"
    server_args = ["--consistency", "asp", "--lease-ms", "60000"]
    if network_only:
        server_args.append("--no-shared-memory")
    for n, workers in _configs(args):
        with benchlib.paramserver(server_args) as server:
            profiler = _start_profiler(args, server.pid, n, workers)
            cfg = {
                "address": server.address,
                "n": n,
                "lr": LR,
                "shared_memory": not network_only,
                "copy": system != "paramserver-view",
                "local_link": system != "paramserver-grpc",
                "shapes": args.shapes,
            }
            with benchlib.WorkerPool("benchlib.ps_worker:push_pull", cfg, workers) as pool:
                result = benchlib.measure(pool.phase, n_elements=n, target_s=args.phase_s)
                reports = pool.finish()
            profile = _stop_profiler(profiler)
            keys = keys_for(args.shapes)
            status, values = benchlib.observer_read(server.address, keys)
            pushes = sum(r["pushes"] for r in reports)
            want = np.float32(-LR * pushes)
            value_exact = len(values) == len(keys) and all(
                bool(np.all(values[k] == want)) for k in keys
            )
            # Every key updated once per push (the minimum over keys; -1 if a key is missing).
            per_key = {k.key: k.updates for k in status.keys}
            key_updates = min((per_key.get(k, -1) for k in keys), default=-1)
            if max((per_key.get(k, -1) for k in keys), default=-1) != key_updates:
                key_updates = -1
            extra = {
                "pushes": pushes,
                "applied_updates": status.applied_updates,
                "key_updates": key_updates,
                "duplicates": sum(r["duplicates"] for r in reports),
                "value_exact": value_exact,
                "verified": status.applied_updates == pushes == key_updates and value_exact,
                "server_peak_rss_bytes": benchlib.peak_rss_bytes(server.pid),
                "pattern": (
                    "push_pull on the Session: 1 round trip/round"
                    + (", network only" if network_only else ", shared memory when large")
                    + (", gRPC stream" if system == "paramserver-grpc" else "")
                ),
                "paths": _paths(reports),
            }
            if profile:
                extra["profile"] = profile
        benchlib.emit(_result_record(system, n, workers, result, extra, _layout(args)))


def _paths(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """How the workers' bytes travelled (from their fast-path state)."""
    return {
        "shm_active": all(r.get("shm_active") for r in reports),
        "shm_declined": sorted({str(r.get("shm_declined")) for r in reports}),
        "sessions_opened": sum(int(r.get("sessions_opened", 0)) for r in reports),
        "local_link": all(r.get("local_link") for r in reports),
    }


def _start_profiler(
    args: argparse.Namespace, pid: int, n: int, workers: int
) -> tuple[subprocess.Popen[bytes], Path] | None:
    if not args.profile_server:
        return None
    out_dir = Path(args.profile_server)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"server_n{n}_w{workers}.collapsed"
    cmd = ["py-spy", "record", "--pid", str(pid), "--rate", "250", "--format", "raw"]
    cmd += ["--output", str(out)]
    if args.profile_native:
        cmd.append("--native")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attaches
    return proc, out


def _stop_profiler(profiler: tuple[subprocess.Popen[bytes], Path] | None) -> dict[str, Any]:
    if profiler is None:
        return {}
    proc, out = profiler
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if not out.exists():
        return {"error": "py-spy wrote nothing (is ptrace allowed?)"}
    return {"collapsed": str(out), **profile.summarize_collapsed(out)}


# ---------------------------------------------------------------------- ceilings
def _serve_in_process(target: str) -> tuple[Any, int]:
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    module, _, name = target.partition(":")
    fn = getattr(__import__(module, fromlist=[name]), name)
    proc = ctx.Process(target=fn, args=(ports,), daemon=True)
    proc.start()
    return proc, int(ports.get(timeout=60))


def _run_ceiling(system: str, args: argparse.Namespace) -> None:
    factory = {
        "memcpy": "benchlib.ceilings:memcpy",
        "socket": "benchlib.ceilings:socket_pingpong",
        "asyncio_unix": "benchlib.ceilings:asyncio_unix_echo",
        "grpc_raw": "benchlib.ceilings:grpc_echo",
        "grpc_raw_unary": "benchlib.ceilings:grpc_unary_echo",
        "grpc_raw_session": "benchlib.ceilings:grpc_session_echo",
        "grpc_raw_seq": "benchlib.ceilings:grpc_seq_echo",
    }[system]
    server = {
        "socket": "benchlib.ceilings:socket_echo_serve",
        "asyncio_unix": "benchlib.ceilings:asyncio_unix_echo_serve",
        "grpc_raw": "benchlib.ceilings:grpc_echo_serve",
        "grpc_raw_unary": "benchlib.ceilings:grpc_echo_serve",
        "grpc_raw_session": "benchlib.ceilings:grpc_echo_serve",
        "grpc_raw_seq": "benchlib.ceilings:grpc_echo_serve",
    }.get(system)
    proc, port = _serve_in_process(server) if server else (None, 0)
    try:
        for n, workers in _configs(args):
            cfg = {"n": n, "port": port}
            with benchlib.WorkerPool(factory, cfg, workers) as pool:
                result = benchlib.measure(pool.phase, n_elements=n, target_s=args.phase_s)
                reports = pool.finish()
            extra = {"verified": all(r["ok"] for r in reports)}
            if system == "grpc_raw":
                extra["pattern"] = "bidi stream, 1 MiB chunks echoed as they arrive"
            elif system == "grpc_raw_unary":
                extra["pattern"] = "one unary call per round, whole payload each way"
            elif system == "grpc_raw_session":
                extra["pattern"] = "one long-lived bidi stream, 1 MiB chunks per round"
            elif system == "grpc_raw_seq":
                extra["pattern"] = "bidi stream per round: whole payload up, then back (no overlap)"
            elif system == "socket":
                extra["pattern"] = "TCP_NODELAY ping-pong, server echoes after the whole message"
            elif system == "asyncio_unix":
                extra["pattern"] = "uvloop Protocol echo of one framed message, Unix socket"
            else:
                extra["pattern"] = "two np.copyto of N*4 bytes per round"
            benchlib.emit(_result_record(system, n, workers, result, extra, _layout(args)))
    finally:
        if proc is not None:
            proc.terminate()
            proc.join(timeout=10)


# ---------------------------------------------------------------------- peers
def _missing(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed (pip install 'paramserver[bench]')"
    return None


def _run_ray(args: argparse.Namespace) -> None:
    from benchlib import ray_ps

    def report(n: int, workers: int, result: dict[str, Any], check: dict[str, Any]) -> None:
        extra = dict(check)
        extra["verified"] = check["applied_updates"] == check["pushes"] and check["value_exact"]
        extra["pattern"] = (
            "apply_gradient_list(grads) returns the weights list: 1 call/round"
            if args.shapes
            else "apply_gradients returns weights: 1 call/round"
        )
        benchlib.emit(_result_record("ray", n, workers, result, extra, _layout(args)))

    ray_ps.run(_configs(args), LR, benchlib.measure, report, args.phase_s, args.shapes)


def _run_torch(args: argparse.Namespace) -> None:
    import torch.distributed.rpc as rpc
    from benchlib import torch_rpc_ps

    if not rpc.is_available():
        for n, w in _configs(args):
            benchlib.emit({**_record("torch_rpc", n, w), "skipped": "torch built without rpc"})
        return
    torch_rpc_ps.run(_configs(args), LR, args.phase_s, args.shapes, _layout(args))


def run_system(system: str, args: argparse.Namespace) -> None:
    """Measure one system for every config (the body of a ``--system`` subprocess)."""
    missing = {
        "ray": _missing("ray"),
        "torch_rpc": _missing("torch"),
        "asyncio_unix": None if sys.platform.startswith("linux") else "abstract sockets: Linux",
    }.get(system)
    if missing:
        for n, w in _configs(args):
            benchlib.emit({**_record(system, n, w), **_layout(args), "skipped": missing})
        return
    if system in ("paramserver", "paramserver-view", "paramserver-grpc", "paramserver-net"):
        _run_paramserver(args, system)
    elif system == "ray":
        _run_ray(args)
    elif system == "torch_rpc":
        _run_torch(args)
    else:
        _run_ceiling(system, args)


# ---------------------------------------------------------------------- orchestration
def _child_argv(
    system: str, configs: list[tuple[int, int]], args: argparse.Namespace, layout: str = ""
) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--system", system]
    if args.model:
        argv += ["--model", args.model[0], "--layout", layout or "flat"]
    argv += ["--sizes", ",".join(str(n) for n in sorted({n for n, _ in configs}))]
    argv += ["--workers", ",".join(str(w) for w in sorted({w for _, w in configs}))]
    argv += ["--phase-s", str(args.phase_s)]
    if args.profile_server:
        argv += ["--profile-server", args.profile_server]
    if args.profile_native:
        argv.append("--profile-native")
    return argv


def _run_child(
    system: str, configs: list[tuple[int, int]], args: argparse.Namespace, layout: str = ""
) -> list[dict[str, Any]]:
    """Measure ``configs`` of one system in a fresh subprocess; returns (and echoes) its lines."""
    records: list[dict[str, Any]] = []
    proc = subprocess.Popen(
        _child_argv(system, configs, args, layout),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so a timeout can kill its whole process group
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + SYSTEM_TIMEOUT_S
    while True:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            print(f"[{system}] timed out after {SYSTEM_TIMEOUT_S} s", file=sys.stderr)
            break
        if line is None:
            break
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            print(f"[{system}] {line.rstrip()}", file=sys.stderr)
            continue
        if isinstance(rec, dict) and rec.get("bench") == "push_pull":
            records.append(rec)
            benchlib.emit(rec)
    if proc.poll() is None:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    done = {(r["n"], r["workers"]) for r in records}
    for n, w in configs:
        if (n, w) not in done:
            rec = {**_record(system, n, w), "error": f"no result (exit code {proc.returncode})"}
            if args.model:
                rec.update(model=args.model[0], layout=layout or "flat")
            records.append(rec)
            benchlib.emit(rec)
    return records


def _value(
    records: dict[tuple[str, int, int], dict[str, Any]], key: tuple[str, int, int], field: str
) -> float | None:
    rec = records.get(key)
    if rec is None or field not in rec:
        return None
    return float(rec[field])


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(records: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The closing tables: rounds/s, payload GB/s and the issue's target ratios."""
    by = {(r["system"], r["n"], r["workers"]): r for r in records}
    systems = [s for s in args.systems]
    for field, title in (("rounds_per_s", "rounds/s"), ("payload_gb_s", "payload GB/s")):
        rows = []
        for n, w in _configs(args):
            rows.append([n, w, *(_value(by, (s, n, w), field) for s in systems)])
        benchlib.print_table(f"push_pull: {title} (median of 3 phases)", ["N", "W", *systems], rows)
    rows = []
    for n, w in _configs(args):
        ps_r = _value(by, ("paramserver", n, w), "rounds_per_s")
        ps_g = _value(by, ("paramserver", n, w), "payload_gb_s")
        best_r = _best(by, PEERS, n, w, "rounds_per_s")
        best_g = _best(by, PEERS, n, w, "payload_gb_s")
        small = n <= 10_000
        # The raw-gRPC target is the network path's: paramserver-net when it ran (large N).
        net_g = _value(by, ("paramserver-net", n, w), "payload_gb_s")
        net_g = ps_g if small or net_g is None else net_g
        stream_g = _value(by, ("grpc_raw", n, w), "payload_gb_s")
        seq_g = _value(by, ("grpc_raw_seq", n, w), "payload_gb_s")
        raw_g = _best(by, RAW_GRPC, n, w, "payload_gb_s")
        peer_ratio = _ratio(ps_r, best_r) if small else _ratio(ps_g, best_g)
        view_g = _value(by, ("paramserver-view", n, w), "payload_gb_s")
        view_ratio = None if small else _ratio(view_g, best_g)
        peer_target = 5.0 if small else 2.0
        # How many times the best peer an asyncio request/reply with no work at all reaches:
        # the room any Python asyncio design has for its own work at this size.
        floor_r = _value(by, ("asyncio_unix", n, w), "rounds_per_s")
        floor_ratio = _ratio(floor_r, best_r) if small else None
        verified = by.get(("paramserver", n, w), {}).get("verified")
        rows.append(
            [
                n,
                w,
                peer_ratio,
                f">= {peer_target:g} ({'rounds/s' if small else 'GB/s'})",
                _met(peer_ratio, peer_target),
                floor_ratio,
                view_ratio,
                _ratio(net_g, stream_g),
                _ratio(net_g, raw_g),
                ">= 0.8",
                _met(_ratio(net_g, raw_g), 0.8),
                _ratio(net_g, seq_g),
                verified,
            ]
        )
    benchlib.print_table(
        "push_pull: paramserver against the issue-7 targets (ratios within this run; "
        "best raw = max(grpc_raw, grpc_raw_unary, grpc_raw_session); the raw-gRPC columns use "
        "paramserver-net, the network path, for N > 10,000 when it ran; grpc seq = whole payload "
        "up then back, the no-overlap ceiling of an atomic push followed by a pull; "
        "asyncio floor = asyncio_unix, an echo with no work)",
        [
            "N",
            "W",
            "ps/best peer",
            "target",
            "met",
            "asyncio floor/best peer",
            "view/best peer",
            "ps/grpc stream",
            "ps/best raw grpc",
            "target",
            "met",
            "ps/grpc seq",
            "exactly-once",
        ],
        rows,
    )


def _best(
    by: dict[tuple[str, int, int], dict[str, Any]],
    systems: tuple[str, ...],
    n: int,
    w: int,
    field: str,
) -> float | None:
    values = [v for s in systems if (v := _value(by, (s, n, w), field)) is not None]
    return max(values) if values else None


def _met(ratio: float | None, target: float) -> str:
    if ratio is None:
        return "n/a"
    return "yes" if ratio >= target else "NO"


def _s_per_round(rec: dict[str, Any] | None) -> float | None:
    """Seconds one worker spends per round (the median phase over its rounds)."""
    if not rec or "median_s" not in rec:
        return None
    return float(rec["median_s"]) / float(rec["rounds_per_phase"])


def summarize_model(records: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Per-key cost and ratios of one model run: each keyed system, model layout against flat."""
    model = args.model[0]
    keys = len(models.shapes(model))
    by = {(r["system"], r.get("layout", "flat"), r["workers"]): r for r in records}
    rows = []
    for n, w in _configs(args):
        for system in args.systems:
            if system not in KEYED:
                continue
            t_model = _s_per_round(by.get((system, "model", w)))
            t_flat = _s_per_round(by.get((system, "flat", w)))
            us_key = (t_model - t_flat) / (keys - 1) * 1e6 if t_model and t_flat else None
            rec = by.get((system, "model", w), {})
            line = {
                "bench": "push_pull",
                "summary": "per_key",
                "model": model,
                "keys": keys,
                "n": n,
                "workers": w,
                "system": system,
                "s_per_round_model": t_model,
                "s_per_round_flat": t_flat,
                "flat_over_model": _ratio(t_model, t_flat),
                "us_per_key": us_key,
                "verified": rec.get("verified"),
            }
            benchlib.emit(line)
            rows.append([system, w, t_model, t_flat, line["flat_over_model"], us_key])
    benchlib.print_table(
        f"push_pull --model {model}: {keys} keys, {models.EXPECTED[model][1]:,} float32 "
        "parameters; s/round per worker; us/key = (model - flat) / (keys - 1)",
        ["system", "W", "s/round model", "s/round flat", "model/flat time", "us/key"],
        rows,
    )
    rows = []
    for _n, w in _configs(args):
        ps = _value_l(by, ("paramserver", "model", w))
        peers = [v for p in PEERS for lay in ("model", "flat") if (v := _value_l(by, (p, lay, w)))]
        peers_model = [v for p in PEERS if (v := _value_l(by, (p, "model", w)))]
        net = _value_l(by, ("paramserver-net", "model", w), "payload_gb_s")
        raw = [
            v for r in RAW_GRPC if (v := _value_l(by, (r, "flat", w), "payload_gb_s")) is not None
        ]
        rows.append(
            [
                w,
                _ratio(ps, max(peers_model) if peers_model else None),
                _ratio(ps, max(peers) if peers else None),
                _met(_ratio(ps, max(peers) if peers else None), 2.0),
                _ratio(net, max(raw) if raw else None),
                _met(_ratio(net, max(raw) if raw else None), 0.8),
            ]
        )
    benchlib.print_table(
        f"push_pull --model {model}: paramserver against the targets (rounds/s; best peer of "
        "either layout; raw gRPC = best of grpc_raw* moving the same bytes)",
        ["W", "ps/best peer (model)", "ps/best peer (any)", ">= 2x", "net/raw grpc", ">= 0.8x"],
        rows,
    )


def _value_l(
    by: dict[tuple[str, str, int], dict[str, Any]],
    key: tuple[str, str, int],
    field: str = "rounds_per_s",
) -> float | None:
    rec = by.get(key)
    return float(rec[field]) if rec and field in rec else None


def _run_model(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every system of one model, config by config; keyed systems in both layouts."""
    records: list[dict[str, Any]] = []
    for config in _configs(args):
        for system in args.systems:
            for layout in ("model", "flat") if system in KEYED else ("flat",):
                records += _run_child(system, [config], args, layout)
    summarize_model(records, args)
    return records


def _parse_ints(text: str) -> list[int]:
    return [int(float(t)) for t in text.split(",") if t.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small N, short phases")
    parser.add_argument("--sizes", type=_parse_ints, help="N values, comma-separated")
    parser.add_argument("--workers", type=_parse_ints, help="W values, comma-separated")
    parser.add_argument("--systems", help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument("--phase-s", type=float, help="target seconds per timed phase")
    parser.add_argument(
        "--no-interleave",
        dest="interleave",
        action="store_false",
        help="measure each system's configs in one process (faster; ratios less robust)",
    )
    parser.add_argument("--profile-server", metavar="DIR", help="py-spy the paramserver server")
    parser.add_argument("--profile-native", action="store_true", help="py-spy --native")
    parser.add_argument(
        "--model",
        help=f"real-model workload, comma-separated subset of {','.join(models.MODELS)}",
    )
    parser.add_argument("--system", help=argparse.SUPPRESS)  # internal: one system, one process
    parser.add_argument("--layout", choices=("model", "flat"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.model = args.model.split(",") if args.model else []
    unknown_models = set(args.model) - set(models.MODELS)
    if unknown_models:
        parser.error(f"unknown models {sorted(unknown_models)}; choose from {models.MODELS}")
    args.shapes = None
    quick = args.quick or benchlib.quick_from_env()
    args.sizes = args.sizes or list(QUICK_SIZES if quick else DEFAULT_SIZES)
    args.workers = args.workers or list(DEFAULT_WORKERS)
    args.phase_s = args.phase_s or (QUICK_PHASE_S if quick else DEFAULT_PHASE_S)
    default_systems = MODEL_SYSTEMS if args.model else SYSTEMS
    args.systems = args.systems.split(",") if args.systems else list(default_systems)
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    if args.system:
        if args.model:
            shapes = models.shapes(args.model[0])
            args.sizes = [sum(models.numel(s) for s in shapes)]
            args.shapes = [list(s) for s in shapes] if args.layout == "model" else None
        run_system(args.system, args)
        return 0
    benchlib.emit({"bench": "push_pull", "machine": benchlib.machine_info(), "lr": LR})
    records: list[dict[str, Any]] = []
    if args.model:
        for model in args.model:
            sub = argparse.Namespace(**vars(args))
            sub.model = [model]
            sub.sizes = [sum(models.numel(s) for s in models.shapes(model))]
            records += _run_model(sub)
        failed = [r for r in records if "error" in r or r.get("verified") is False]
        return 1 if failed else 0
    if args.interleave:
        # One config at a time across all systems: on a shared, noisy host the ratios within
        # a config are then measured minutes apart at most.
        for config in _configs(args):
            for system in args.systems:
                records += _run_child(system, [config], args)
    else:
        for system in args.systems:
            records += _run_child(system, _configs(args), args)
    summarize(records, args)
    failed = [r for r in records if "error" in r or r.get("verified") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
