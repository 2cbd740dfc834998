"""``paramserver ray-launch``: a job on a running Ray cluster (shards as actors, workers as
tasks; :mod:`paramserver.integrations.ray.placement`). Ray is imported only when the command
runs."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import shlex
import sys
from typing import TYPE_CHECKING

from paramserver.cli.flags import Subcommands
from paramserver.cli.training import add_model_flags

if TYPE_CHECKING:
    from paramserver.integrations.ray import ClusterJob, RayJobConfig, ScriptJob, TrainFunction


def _load_function(spec: str) -> TrainFunction:
    """``package.module:function`` -> the function (importable on every Ray node too)."""
    from paramserver.errors import InvalidArgument

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise InvalidArgument(f"--train must be MODULE:FUNCTION, got {spec!r}")
    try:
        fn: object = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise InvalidArgument(f"--train {spec}: {exc}") from None
    if not callable(fn):
        raise InvalidArgument(f"--train {spec}: not a function")
    return fn


#: RayJobConfig field -> the ray-launch flag that sets it (for error messages).
_FLAG_OF = {
    "num_shards": "--shards",
    "num_workers": "--workers",
    "replicas": "--replicas",
    "base_port": "--base-port",
    "worker_failure": "--worker-failure",
    "shard_max_restarts": "--shard-max-restarts",
    "worker_max_retries": "--worker-max-retries",
    "start_timeout_s": "--start-timeout-s",
    "job_timeout_s": "--timeout-s",
    "retry_deadline_s": "--retry-deadline-s",
    "server: ": "--serve-args: ",  # the messages about RayJobConfig.server
    "strategy": "--strategy",
}


def server_settings(serve_args: str) -> dict[str, object]:
    """``--serve-args`` (``paramserver serve`` flags, one string) as the
    :class:`~paramserver.server.config.ServerConfig` fields they set, the form
    :class:`~paramserver.integrations.ray.RayJobConfig` takes (each shard reads its own
    ``PARAMSERVER_*`` variables under them).

    Raises:
        InvalidArgument: a value ``serve`` refuses (INVALID_ARGUMENT).
        SystemExit: a flag ``serve`` does not have (argparse's usage error, exit 2).
    """
    from paramserver.cli.main import build_parser
    from paramserver.cli.serve import serve_config
    from paramserver.server.config import ServerConfig

    args = build_parser(["serve"]).parse_args(["serve", *shlex.split(serve_args)])
    given, default = serve_config(args, {}), ServerConfig()
    return {
        f.name: getattr(given, f.name)
        for f in dataclasses.fields(ServerConfig)
        if getattr(given, f.name) != getattr(default, f.name)
    }


def script_job(args: argparse.Namespace) -> ScriptJob:
    """``--script SCRIPT ARGS...`` (and ``--env``) as a
    :class:`~paramserver.integrations.ray.ScriptJob`: the script's absolute path (the same
    file on every node), its arguments as given, this directory as its working directory.

    Raises:
        InvalidArgument: no script, a ``.py`` script that does not exist here, ``--train``
            as well, or an ``--env`` that is not ``NAME=VALUE`` (INVALID_ARGUMENT).
    """
    from paramserver.errors import InvalidArgument
    from paramserver.integrations.ray import ScriptJob

    if not args.script:
        raise InvalidArgument("--script needs the script: --script train.py ARGS...")
    if args.train:
        raise InvalidArgument("give the job once: --script or --train")
    script, *script_args = args.script
    if os.path.exists(script):
        script = os.path.abspath(script)
    elif script.endswith(".py"):
        raise InvalidArgument(f"no such script: {script}")
    env = {}
    for item in args.env:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise InvalidArgument(f"--env {item!r}: give NAME=VALUE")
        env[name] = value
    return ScriptJob(script, tuple(script_args), env=env, cwd=os.getcwd())


def _job_config(args: argparse.Namespace, config_class: type[RayJobConfig]) -> RayJobConfig:
    return config_class(
        num_shards=args.shards,
        num_workers=args.workers,
        replicas=args.replicas,
        base_port=args.base_port,
        state_dir=args.state_dir,
        server=server_settings(args.serve_args),
        strategy=args.strategy,
        shard_max_restarts=args.shard_max_restarts,
        worker_max_retries=args.worker_max_retries,
        worker_failure=args.worker_failure,
        shard_num_cpus=args.shard_cpus,
        worker_num_cpus=args.worker_cpus,
        start_timeout_s=args.start_timeout_s,
        job_timeout_s=args.timeout_s,
        retry_deadline_s=args.retry_deadline_s,
        name=args.name,
    )


class HeadWatchdog:
    """Ends the command with a failed JobResult (one JSON object on stdout, one error line on
    stderr, exit 1) when the Ray head's GCS has not accepted a TCP connection for
    ``timeout_s`` seconds: Ray itself would end the process later with no result."""

    def __init__(self, timeout_s: float) -> None:
        import threading

        self.timeout_s = timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ray-head-watchdog", daemon=True)
        self.gcs = ""

    def start(self) -> None:
        import ray

        self.gcs = str(ray.get_runtime_context().gcs_address)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _reachable(self) -> bool:
        import socket

        host, _, port = self.gcs.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return True
        except (OSError, ValueError):
            return False

    def _run(self) -> None:
        import time

        from paramserver.integrations.ray import JobResult

        lost_since: float | None = None
        while not self._stop.wait(1.0):
            if self._reachable():
                lost_since = None
                continue
            now = time.monotonic()
            lost_since = lost_since or now
            if now - lost_since >= self.timeout_s and not self._stop.is_set():
                error = (
                    f"lost the Ray head: its GCS at {self.gcs} has refused connections for "
                    f"{self.timeout_s:g} s (the job's shards and workers went with the cluster)"
                )
                print(JobResult.failed(error).to_json(), flush=True)
                print(f"paramserver ray-launch: the job failed: {error}", file=sys.stderr)
                sys.stderr.flush()
                os._exit(1)


def _cmd_ray_launch(args: argparse.Namespace) -> int:
    try:
        import ray
    except ImportError:
        print("paramserver ray-launch: needs Ray: pip install 'paramserver[ray]'", file=sys.stderr)
        return 2
    from paramserver.cli.demos.digits import DigitsJob
    from paramserver.errors import InvalidArgument
    from paramserver.integrations.ray.placement import RayJobConfig, launch

    job: ClusterJob | ScriptJob | TrainFunction
    if args.script is not None:
        job = script_job(args)

    try:
        cfg = _job_config(args, RayJobConfig)
    except InvalidArgument as exc:  # named as the flags, not as the config's fields
        message = exc.message
        for field_name, flag in _FLAG_OF.items():
            message = message.replace(field_name, flag)
        raise InvalidArgument(message) from None
    if args.script is not None:
        pass
    elif args.train:
        job = _load_function(args.train)
    else:
        job = DigitsJob(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DigitsJob)})
    from paramserver.integrations.ray import JobResult

    try:
        ray.init(address=args.address, log_to_driver=args.worker_logs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        result = JobResult.failed(f"cannot join the Ray cluster at {args.address}: {exc}")
        print(result.to_json(), flush=True)
        print(f"paramserver ray-launch: {result.error}", file=sys.stderr)
        return 1
    watchdog = HeadWatchdog(args.head_timeout_s)
    watchdog.start()
    try:
        result = launch(cfg, job)
    finally:
        watchdog.stop()
        ray.shutdown()
    print(result.to_json(), flush=True)
    if result.error is not None:
        print(f"paramserver ray-launch: the job failed: {result.error}", file=sys.stderr)
    for w in result.workers:
        if not w.ok:
            print(f"paramserver ray-launch: worker {w.index} failed: {w.error}", file=sys.stderr)
    if not result.ok:
        return 1
    accuracy = result.metrics.get("test_accuracy")
    if accuracy is not None and accuracy < args.min_accuracy:
        print(
            f"paramserver ray-launch: test accuracy {accuracy:.4f} is below --min-accuracy "
            f"{args.min_accuracy}",
            file=sys.stderr,
        )
        return 1
    return 0


def add_subcommands(sub: Subcommands) -> None:
    """Register ``ray-launch``."""
    p = sub.add_parser(
        "ray-launch",
        allow_abbrev=False,  # the script's own flags pass through, never taken for ours
        help="run a job on a Ray cluster: shards as actors, workers as tasks (paramserver[ray])",
        description="Run a paramserver job on a running Ray cluster: S shards as restartable "
        "Ray actors in a placement group (each bound to its node's IP on BASE_PORT + i, with "
        "its own checkpoints and write-ahead log), N workers as Ray tasks running the digits "
        "job, --train MODULE:FUNCTION, or your training script unchanged (--script SCRIPT "
        "ARGS..., last on the line: each task runs it with the environment `paramserver run` "
        "gives it). Prints the job result as one JSON object; exit 0 iff every worker "
        "returned (and the digits job reached --min-accuracy).",
    )
    p.add_argument("--address", default="auto", help="Ray cluster address (default auto)")
    p.add_argument("--shards", type=int, default=2, help="server shards (default 2)")
    p.add_argument("--workers", type=int, default=4, help="worker tasks (default 4)")
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="replicas of each shard, on different nodes: a primary streams every mutation to "
        "its backups and a backup takes over within seconds when the primary's node is lost "
        "(default: 2 when the cluster has >= 2 nodes with CPUs, else 1)",
    )
    p.add_argument(
        "--base-port",
        type=int,
        default=50051,
        help="replica k of shard i listens on BASE_PORT + i * REPLICAS + k",
    )
    p.add_argument(
        "--head-timeout-s",
        type=float,
        default=10.0,
        help="end with a failed result once the Ray head has been unreachable this long",
    )
    p.add_argument(
        "--state-dir",
        help="per-node directory of shard-<i>/checkpoints and shard-<i>/wal; the same one "
        "again resumes a job (default: one per job, <system temp dir>/paramserver-ray/<job "
        "id>, named in the result's state_dir)",
    )
    p.add_argument(
        "--serve-args",
        default="",
        help="extra `paramserver serve` flags for every shard, one string "
        "(e.g. '--consistency ssp --staleness 2 --checkpoint-every-s 30')",
    )
    p.add_argument(
        "--strategy",
        choices=["SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK"],
        default="SPREAD",
        help="placement-group strategy of the shards (default SPREAD)",
    )
    p.add_argument(
        "--shard-max-restarts",
        type=int,
        default=3,
        help="times Ray restarts a dead shard (0: a dead shard fails the job; default 3)",
    )
    p.add_argument(
        "--worker-max-retries",
        type=int,
        default=0,
        help="times Ray re-runs a failed worker task (default 0)",
    )
    p.add_argument(
        "--worker-failure",
        choices=["fail", "continue"],
        default="fail",
        help="a worker that failed for good: cancel the others and fail (default), or let "
        "them continue",
    )
    p.add_argument("--shard-cpus", type=float, default=1.0, help="Ray CPUs per shard")
    p.add_argument("--worker-cpus", type=float, default=1.0, help="Ray CPUs per worker")
    p.add_argument("--start-timeout-s", type=float, default=120.0)
    p.add_argument("--timeout-s", type=float, default=3600.0, help="deadline of the workers")
    p.add_argument(
        "--retry-deadline-s",
        type=float,
        default=120.0,
        help="how long workers retry an unavailable shard (a restart must fit)",
    )
    p.add_argument("--name", default="paramserver", help="prefix of actor and worker names")
    p.add_argument(
        "--train",
        metavar="MODULE:FUNCTION",
        help="run train(client, worker_index, num_workers) instead of the digits job",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable of the --script workers (repeatable; e.g. "
        "PARAMSERVER_TOKEN_FILE=/path)",
    )
    p.add_argument("--worker-logs", action="store_true", help="stream worker output here")
    add_model_flags(p, epochs=10)
    p.add_argument("--slow-factor", type=float, default=1.0, help="workers x slower")
    p.add_argument(
        "--script",
        nargs=argparse.REMAINDER,
        metavar="SCRIPT [ARGS ...]",
        help="run this training script (and the arguments after it: the rest of the line) as "
        "every worker, with PARAMSERVER_ADDRESS, PARAMSERVER_SHARD_ADDRESSES, WORKER_INDEX, "
        "NUM_WORKERS, WORKER_NAME and PARAMSERVER_REPLACE=1 set, as `paramserver run` does; "
        "the script must be at the same path on every node",
    )
    p.set_defaults(func=_cmd_ray_launch)
