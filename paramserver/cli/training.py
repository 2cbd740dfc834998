"""``paramserver worker``, ``demo`` and ``torch-demo``: their flags.

What they run is :mod:`paramserver.cli.demos.digits` (the worker) and
:mod:`paramserver.cli.demos.digits_demo` (the demo; :mod:`paramserver.cli.demos.movielens` for
``demo --model movielens``), imported only when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from paramserver.cli.flags import Subcommands, add_client_security_flags, deferred
from paramserver.cli.server_arg import add_server_arguments

__all__ = [
    "CONSISTENCY_MODELS",
    "FRAMEWORKS",
    "add_model_flags",
    "add_subcommands",
    "consistency_list",
]

_DIGITS = "paramserver.cli.demos.digits"
_DIGITS_DEMO = "paramserver.cli.demos.digits_demo"

#: Model implementations of the digits job.
FRAMEWORKS = ("numpy", "torch")

CONSISTENCY_MODELS = ("bsp", "ssp", "asp")


def consistency_list(text: str) -> list[str]:
    """``--consistency`` value: one model or a comma-separated list (``bsp,ssp,asp``).

    Raises:
        argparse.ArgumentTypeError: an unknown or repeated model.
    """
    names = [n.strip().lower() for n in text.split(",")]
    bad = [n for n in names if n not in CONSISTENCY_MODELS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown consistency model(s) {', '.join(map(repr, bad))} in {text!r}; "
            f"expected a comma-separated list of {', '.join(CONSISTENCY_MODELS)}"
        )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"consistency model repeated in {text!r}")
    return names


def add_model_flags(p: argparse.ArgumentParser, *, epochs: int) -> None:
    """The digits job's flags (epochs, batch size, learning rate, momentum, hidden units, seed,
    minimum accuracy), shared by ``worker``, ``demo`` and ``ray-launch``."""
    p.add_argument("--epochs", type=int, default=epochs, help=f"epochs (default {epochs})")
    p.add_argument("--batch-size", type=int, default=32, help="examples per push (default 32)")
    p.add_argument(
        "--lr", type=float, default=0.1, help="server-side SGD learning rate (default 0.1)"
    )
    p.add_argument(
        "--momentum", type=float, default=0.9, help="server-side SGD momentum (default 0.9)"
    )
    p.add_argument(
        "--hidden",
        type=int,
        default=32,
        help="hidden units of the MLP; 0 = softmax regression (default 32)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the initial parameters, the data split and the batch order (default 0)",
    )
    p.add_argument(
        "--min-accuracy",
        type=float,
        default=0.93,
        help="exit 1 when the final test accuracy is below this bar (default 0.93)",
    )


def _add_training_flags(p: argparse.ArgumentParser, *, epochs: int, framework: bool = True) -> None:
    add_model_flags(p, epochs=epochs)
    p.add_argument("--no-uvloop", action="store_true", help="use the default asyncio loop")
    p.add_argument(
        "--compression",
        choices=["none", "fp16", "bf16", "topk"],
        default="none",
        help="wire compression of pushed gradients: fp16 / bf16 casts, or topk (the largest "
        "--topk-ratio of entries, with error feedback) (default none)",
    )
    p.add_argument(
        "--topk-ratio",
        type=float,
        default=0.1,
        help="topk: fraction of entries sent per push (default 0.1)",
    )
    if framework:
        p.add_argument(
            "--framework",
            choices=FRAMEWORKS,
            default="numpy",
            help="model implementation: a numpy MLP, or a torch.nn MLP through "
            "paramserver.integrations.torch (needs the torch extra) (default numpy)",
        )


def add_subcommands(sub: Subcommands) -> None:
    """Register ``worker`` and ``demo``."""
    w = sub.add_parser(
        "worker",
        help="train the digits model against a running server",
        description="Train the digits model against a running server: paramserver worker "
        "ADDR --worker-index I --num-workers N (ADDR: any shard; --server ADDR is the same). "
        "While it waits (the server does not answer, workers still to register, a dead "
        "peer's lease to lapse) it says for what on stderr, within 2 s and then every ~5 s.",
    )
    add_server_arguments(w, "the parameter server (any shard)")
    w.add_argument(
        "--worker-index",
        type=int,
        required=True,
        help="this worker's index in [0, --num-workers): it trains on slice i::n of the data",
    )
    w.add_argument(
        "--num-workers",
        type=int,
        required=True,
        help="workers of the job; training starts once that many are registered",
    )
    w.add_argument("--no-eval", action="store_true", help="skip per-epoch test evaluation")
    w.add_argument(
        "--slow-factor",
        type=float,
        default=1.0,
        help="straggler simulation: each step takes this many times longer (default 1)",
    )
    w.add_argument(
        "--replace",
        action="store_true",
        help=(
            "take over the name worker-INDEX while an earlier registration of it is still live "
            "(a restarted worker, or an engine's retry of index i): the old registration is "
            "fenced (its next call is refused with FAILED_PRECONDITION). Without it such a "
            "start exits 1 with AlreadyExists"
        ),
    )
    w.add_argument(
        "--retry-deadline-s",
        type=float,
        help="how long calls retry an unavailable server, e.g. while a shard restarts (default "
        "30); meanwhile the worker prints the address and this deadline every ~5 s",
    )
    w.add_argument(
        "--progress",
        choices=["text", "json"],
        default=None,
        help="progress on stdout: text, one readable line per epoch, or json, one object per "
        "line (events start, epoch, done); default: json under --log-format json, else text",
    )
    _add_training_flags(w, epochs=10)
    add_client_security_flags(w)
    w.set_defaults(func=deferred(_DIGITS, "cmd_worker"))

    d = sub.add_parser(
        "demo", help="start a local cluster (1 server + N workers) training on digits"
    )
    _add_demo_flags(d, workers=4)
    d.add_argument(
        "--model",
        choices=["digits", "movielens"],
        default="digits",
        help="digits (an MLP on scikit-learn's digits) or movielens (biased matrix "
        "factorization on real MovieLens ratings with user and movie embedding tables on the "
        "server; needs paramserver[recsys]; see docs/embedding-tables.md; default digits)",
    )
    _add_movielens_flags(d)
    d.set_defaults(func=deferred(_DIGITS_DEMO, "cmd_demo"))

    t = sub.add_parser(
        "torch-demo",
        help="the demo with torch.nn workers (= demo --framework torch --workers 2)",
    )
    _add_demo_flags(t, workers=2, framework=False)
    t.set_defaults(func=deferred(_DIGITS_DEMO, "cmd_demo"), framework="torch")


def _add_demo_flags(d: argparse.ArgumentParser, *, workers: int, framework: bool = True) -> None:
    d.add_argument(
        "--workers",
        type=int,
        default=workers,
        help=f"worker processes, each training on its slice of the data (default {workers})",
    )
    d.add_argument(
        "--consistency",
        type=consistency_list,
        default=["ssp"],
        metavar="MODEL[,MODEL...]",
        help="bsp, ssp or asp; a comma-separated list (bsp,ssp,asp) runs the cluster once per "
        "model, one after another (default ssp)",
    )
    d.add_argument(
        "--plot",
        type=Path,
        metavar="PNG",
        help="write test accuracy against wall time, one curve per consistency model "
        "(needs matplotlib: the plot extra) (default: no plot)",
    )
    d.add_argument(
        "--staleness",
        type=int,
        default=2,
        help="SSP staleness bound in clocks: a pull waits until the slowest worker is at most "
        "this many clocks behind (default 2; ignored by bsp and asp)",
    )
    d.add_argument(
        "--aggregation",
        choices=["mean", "sum", "weighted_mean"],
        default="mean",
        help="how the server combines one BSP step's gradients (default mean)",
    )
    d.add_argument(
        "--lease-ms",
        type=int,
        default=10_000,
        help="worker lease in ms: a worker silent this long is evicted (default 10000)",
    )
    d.add_argument("--shards", type=int, default=1, help="parameter-server shards (default 1)")
    d.add_argument(
        "--slice-bytes",
        type=int,
        help="with --shards > 1: slice tensors above this many bytes over the shards "
        "(default 4 MiB)",
    )
    d.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="give up after this many seconds (default 600)",
    )
    _add_training_flags(d, epochs=10, framework=framework)


def _add_movielens_flags(d: argparse.ArgumentParser) -> None:
    """Flags of the movielens demo (on ``paramserver demo``)."""
    g = d.add_argument_group("--model movielens")
    g.add_argument("--factors", type=int, default=16, help="latent factors k (default 16)")
    g.add_argument(
        "--reg", type=float, default=0.05, help="L2 weight of the factors (default 0.05)"
    )
    g.add_argument(
        "--limit", type=int, help="use only the first N ratings, for short runs (default: all)"
    )
    g.add_argument(
        "--rmse-tolerance",
        type=float,
        default=0.01,
        help="relative RMSE gap allowed (default 0.01)",
    )
