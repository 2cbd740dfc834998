"""A ready worker that trains a real model on a real data set (``paramserver worker``).

Data: scikit-learn's bundled digits set (1,797 8x8 images, shipped inside the scikit-learn wheel,
no download), split 80/20 with a fixed seed and standardised with training statistics. Model: a
one-hidden-layer MLP (tanh, 64 -> hidden -> 10) or, with ``--hidden 0``, softmax regression,
trained with cross-entropy. Worker i trains on slice ``i::n`` of the training split; each
iteration is pull -> gradient -> push -> clock, the server applying SGD with momentum.

``paramserver worker`` runs one worker against a server anywhere; ``paramserver demo``
(:mod:`paramserver.cli.demos.digits_demo`) starts a server and N worker processes on 127.0.0.1
and reports per-epoch loss and test accuracy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from paramserver.cli.demos.resume import resume_point
from paramserver.cli.logs import resolve_log_format
from paramserver.cli.server_arg import server_address
from paramserver.cli.training import FRAMEWORKS
from paramserver.core.optimizers import UpdateRule
from paramserver.security.tls import (
    ClientSecurity,
    client_security_from_args,
)
from paramserver.worker_client.cluster import connect
from paramserver.worker_client.compression import Cast, Compression, TopK
from paramserver.worker_client.retry import RetryPolicy

T = TypeVar("T")

#: One progress event (``start``, ``epoch``, ``done``): JSON-ready values by name.
ProgressEvent = dict[str, str | int | float]


@dataclass(frozen=True)
class DigitsData:
    """Standardised digits split. X: float64 (n, 64); y: int64 (n,) in [0, 10)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_digits_split(seed: int = 0, test_fraction: float = 0.2) -> DigitsData:
    """Load scikit-learn's bundled digits and split/standardise deterministically.

    Raises:
        SystemExit: scikit-learn is not installed (``pip install 'paramserver[demo]'``).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:  # pragma: no cover - depends on the environment
        raise SystemExit(
            "the digits job needs scikit-learn: pip install 'paramserver[demo]'"
        ) from None
    x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    n_test = round(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    mean = x[train].mean(axis=0)
    std = x[train].std(axis=0) + 1e-6
    xs = (x - mean) / std
    return DigitsData(xs[train], y[train].astype(np.int64), xs[test], y[test].astype(np.int64))


def init_params(
    hidden: int, seed: int = 0, dtype: npt.DTypeLike = np.float32
) -> dict[str, np.ndarray]:
    """Glorot-uniform initial parameters of the MLP (or softmax regression if hidden == 0)."""
    rng = np.random.default_rng(seed)
    dims = [64, hidden, 10] if hidden else [64, 10]
    params = {}
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        limit = np.sqrt(6.0 / (a + b))
        params[f"layer{i}/weight"] = rng.uniform(-limit, limit, size=(a, b)).astype(dtype)
        params[f"layer{i}/bias"] = np.zeros(b, dtype=dtype)
    return params


def _forward(params: dict[str, np.ndarray], x: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    n_layers = len(params) // 2
    acts = [x]
    h = x
    for i in range(n_layers):
        z = h @ params[f"layer{i}/weight"].astype(np.float64) + params[f"layer{i}/bias"]
        h = np.tanh(z) if i < n_layers - 1 else z
        acts.append(h)
    return acts, h


def loss_and_grads(
    params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray
) -> tuple[float, dict[str, np.ndarray]]:
    """Mean cross-entropy of a batch and its gradients (each in its parameter's dtype)."""
    acts, logits = _forward(params, x)
    logits = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    n = len(y)
    loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
    delta = p
    delta[np.arange(n), y] -= 1.0
    delta /= n
    grads: dict[str, np.ndarray] = {}
    n_layers = len(params) // 2
    for i in reversed(range(n_layers)):
        w = params[f"layer{i}/weight"]
        grads[f"layer{i}/weight"] = (acts[i].T @ delta).astype(w.dtype)
        grads[f"layer{i}/bias"] = delta.sum(axis=0).astype(w.dtype)
        if i:
            delta = (delta @ w.astype(np.float64).T) * (1.0 - acts[i] ** 2)
    return loss, grads


def accuracy(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    """Fraction of ``x`` classified as ``y``."""
    _, logits = _forward(params, x)
    return float((logits.argmax(axis=1) == y).mean())


class DigitsModel(Protocol):
    """What the digits loop needs of a model: parameters by key, gradients, accuracy.

    ``x`` is float64 (n, 64) standardised pixels, ``y`` int64 (n,) labels in [0, 10).
    """

    def initial_params(self) -> dict[str, np.ndarray]: ...

    def loss_and_grads(
        self, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray
    ) -> tuple[float, dict[str, np.ndarray]]: ...

    def accuracy(self, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float: ...


@dataclass(frozen=True)
class NumpyMLP:
    """The numpy MLP above (keys ``layer{i}/weight`` (in, out) and ``layer{i}/bias``)."""

    hidden: int
    seed: int = 0

    def initial_params(self) -> dict[str, np.ndarray]:
        return init_params(self.hidden, self.seed)

    def loss_and_grads(
        self, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray
    ) -> tuple[float, dict[str, np.ndarray]]:
        return loss_and_grads(dict(params), x, y)

    def accuracy(self, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
        return accuracy(dict(params), x, y)


def digits_model(framework: str, hidden: int, seed: int = 0) -> DigitsModel:
    """The digits model of ``framework``: ``numpy`` (:class:`NumpyMLP`) or ``torch``
    (:class:`~paramserver.cli.demos.torch_digits.TorchMLP`, one torch thread).

    Raises:
        ValueError: an unknown framework.
        SystemExit: ``torch`` without PyTorch installed (``pip install 'paramserver[torch]'``).
    """
    if framework == "numpy":
        return NumpyMLP(hidden, seed)
    if framework == "torch":
        try:
            from paramserver.cli.demos.torch_digits import TorchMLP
        except ImportError as exc:
            raise SystemExit(
                f"--framework torch needs PyTorch: pip install 'paramserver[torch]' ({exc})"
            ) from None
        return TorchMLP(hidden, seed, threads=1)
    raise ValueError(f"unknown framework {framework!r}; expected one of {', '.join(FRAMEWORKS)}")


@dataclass(frozen=True)
class DigitsJob:
    """The digits job's hyperparameters, the same on every worker (``paramserver worker``,
    ``demo``, and the Ray launcher's worker tasks: a
    :class:`~paramserver.integrations.ray.ClusterJob`).

    Attributes:
        epochs: Passes over the worker's slice of the training data.
        batch_size: Examples per push.
        lr: Server-side SGD learning rate.
        momentum: Server-side SGD momentum.
        hidden: Hidden units of the MLP (0: softmax regression).
        seed: Seed of the initial parameters, the data split and the batch order.
        slow_factor: Each step takes this many times longer (a slow worker, for demos).
    """

    epochs: int = 10
    batch_size: int = 32
    lr: float = 0.1
    momentum: float = 0.9
    hidden: int = 32
    seed: int = 0
    slow_factor: float = 1.0

    def run_worker(
        self, address: str, index: int, num_workers: int, *, name: str, retry: RetryPolicy
    ) -> ProgressEvent:
        """Train as worker ``index`` of ``num_workers`` against the cluster that serves
        ``address``; returns the worker's ``done`` summary. It registers as
        ``worker-<index>`` with ``replace=True`` (a retried task fences its predecessor);
        ``name`` is the launcher's prefix, unused here."""
        from paramserver.serving.bootstrap import run_loop

        cfg = TrainConfig(
            server=address,
            worker_index=index,
            num_workers=num_workers,
            evaluate=False,
            replace=True,
            retry=retry,
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(DigitsJob)},
        )
        return run_loop(train_worker(cfg))

    def final_metrics(self, address: str) -> dict[str, float]:
        """``test_accuracy`` of the cluster's current parameters (an observer read)."""
        from paramserver.serving.bootstrap import run_loop

        async def read() -> dict[str, float]:
            async with connect(address, "digits-evaluator", heartbeat=False) as ps:
                params = await ps.pull(observer=True)
            data = load_digits_split(self.seed)
            model = digits_model("numpy", self.hidden, self.seed)
            return {"test_accuracy": model.accuracy(params, data.x_test, data.y_test)}

        return run_loop(read())


@dataclass(frozen=True, kw_only=True)
class TrainConfig(DigitsJob):
    """One worker's training job (digits): the job's hyperparameters and where it runs."""

    server: str
    worker_index: int
    num_workers: int
    evaluate: bool = True
    start_timeout_s: float = 60.0
    compression: str = "none"
    topk_ratio: float = 0.1
    framework: str = "numpy"
    #: Fence a live registration of this worker's name (a restarted worker) instead of
    #: failing with AlreadyExists; the fenced process's next call is refused.
    replace: bool = False
    #: TLS / token of the worker's channels (:class:`paramserver.security.tls.ClientSecurity`).
    security: ClientSecurity | None = None
    #: Backoff for UNAVAILABLE while a shard restarts (None: the client's default, 30 s).
    retry: RetryPolicy | None = None
    #: Progress on stdout: ``text`` (one readable line per event) or ``json`` (one object).
    progress: str = "text"


def compression_schemes(kind: str, keys: list[str], topk_ratio: float) -> dict[str, Compression]:
    """Wire compression for every key: ``none``, ``fp16``, ``bf16`` or ``topk``."""
    if kind == "none":
        return {}
    scheme: Compression
    if kind in ("fp16", "bf16"):
        scheme = Cast("float16" if kind == "fp16" else "bfloat16")
    elif kind == "topk":
        scheme = TopK(topk_ratio)
    else:
        raise ValueError(f"unknown compression {kind!r}")
    return dict.fromkeys(keys, scheme)


def _emit(event: ProgressEvent, progress: str = "json") -> None:
    """Print one progress event: a JSON object, or with ``progress="text"`` a line such as
    ``worker 0: epoch 3/10  loss 0.2120  test accuracy 0.9500  clock 33  [1.2 s]``."""
    print(json.dumps(event) if progress == "json" else progress_line(event), flush=True)


def progress_line(event: Mapping[str, str | int | float]) -> str:
    """The human-readable form of a ``start`` / ``epoch`` / ``done`` progress event."""
    who = f"worker {event.get('worker', '?')}:"
    acc = event.get("test_accuracy")
    acc_text = f"  test accuracy {acc:.4f}" if isinstance(acc, float) else ""
    kind = event.get("event")
    if kind == "start":
        if event.get("resumed_steps"):
            return (
                f"{who} resuming: {event['resumed_steps']} of {event.get('planned_steps', '?')} "
                f"steps done before, training the rest{acc_text}"
            )
        return f"{who} every worker registered, training starts{acc_text}"
    if kind == "epoch":
        epochs = f"/{event['epochs']}" if "epochs" in event else ""
        return (
            f"{who} epoch {event['epoch']}{epochs}  loss {event['loss']:.4f}{acc_text}  "
            f"clock {event['clock']}  [{event.get('train_elapsed_s', 0.0):.1f} s]"
        )
    if kind == "done":
        resumed = event.get("resumed_steps")
        return (
            f"{who} done after {event['steps']} steps"
            f"{f' ({resumed} done before this process)' if resumed else ''} in "
            f"{event['elapsed_s']:.1f} s, test accuracy {event['test_accuracy']:.4f}"
        )
    return f"{who} " + "  ".join(f"{k} {v}" for k, v in event.items() if k != "worker")


@contextlib.asynccontextmanager
async def _in_thread(fn: Callable[..., T], *args: object) -> AsyncIterator[asyncio.Future[T]]:
    """``fn(*args)`` running in the loop's default executor for the block; a result nobody
    awaited (the block failed first) is dropped on exit."""
    future = asyncio.get_running_loop().run_in_executor(None, fn, *args)
    try:
        yield future
    finally:
        if not future.done():
            future.cancel()
        elif not future.cancelled():
            future.exception()  # retrieved: an error the block never reached is not logged


async def train_worker(cfg: TrainConfig) -> ProgressEvent:
    """Train on slice ``worker_index::num_workers``; prints progress on stdout (JSON lines
    with ``progress="json"``, else readable lines): a ``start`` event once every worker is
    registered (with the initial test accuracy when evaluating), one ``epoch`` event per epoch
    (``train_elapsed_s``: seconds since ``start``), and ``done``.

    The plan is ``epochs`` x ``steps`` iterations, one batch each, in an order fixed by the
    seed, the epoch and the worker index. A worker whose name already completed iterations on
    the cluster (a restarted worker, or one that replaces a lost one with ``replace``) asks
    :meth:`~paramserver.worker_client.ClusterWorkerClient.progress`, skips that many and trains
    the rest in the same order (:mod:`paramserver.cli.demos.resume`), so no batch is trained
    twice; ``start`` and ``done`` say how many it skipped (``resumed_steps``).

    Returns:
        The final summary: ``{"event": "done", "worker": i, "test_accuracy": a, "steps":
        planned, "resumed_steps": skipped, "trained_steps": planned - skipped, ...}``.
    """
    model = digits_model(cfg.framework, cfg.hidden, cfg.seed)
    rule = UpdateRule("sgd", lr=cfg.lr, momentum=cfg.momentum)
    t0 = time.monotonic()
    initial = model.initial_params()
    schemes = compression_schemes(cfg.compression, sorted(initial), cfg.topk_ratio)
    # The data loads (scikit-learn's import takes seconds on a busy machine) while the client
    # connects: a server that does not answer is reported without waiting for it.
    async with (
        _in_thread(load_digits_split, cfg.seed) as loading,
        connect(
            cfg.server,
            worker_name=f"worker-{cfg.worker_index}",
            compression=schemes,
            security=cfg.security,
            replace=cfg.replace,
            resume=True,  # it skips what its name completed: the batch in flight is one push
            retry=cfg.retry,
        ) as ps,
    ):
        params = await ps.init(initial, rule=rule)
        data = await loading
        mine = np.arange(cfg.worker_index, len(data.y_train), cfg.num_workers)
        steps = max(1, (len(data.y_train) // cfg.num_workers) // cfg.batch_size)
        keys = sorted(params)
        # what this worker's name completed before (0 for a first start): skipped below
        resume = resume_point((await ps.progress()).steps, cfg.epochs, steps)
        await ps.wait_for_workers(cfg.num_workers, timeout_s=cfg.start_timeout_s)
        t_train = time.monotonic()
        start: ProgressEvent = {
            "event": "start",
            "worker": cfg.worker_index,
            "resumed_steps": resume.skipped,
            "planned_steps": resume.planned,
        }
        if cfg.evaluate:
            start["test_accuracy"] = model.accuracy(params, data.x_test, data.y_test)
        _emit(start, cfg.progress)
        acc = float("nan")
        for epoch in range(resume.epoch, cfg.epochs):
            rng = np.random.default_rng([cfg.seed, epoch, cfg.worker_index])
            order = rng.permutation(mine)  # the same order as an uninterrupted run's
            losses = []
            for step in resume.steps_of(epoch, steps):
                params = await ps.pull(keys)
                t_step = time.monotonic()
                idx = order[(step * cfg.batch_size) % len(order) :][: cfg.batch_size]
                loss, grads = model.loss_and_grads(params, data.x_train[idx], data.y_train[idx])
                if cfg.slow_factor > 1.0:
                    await asyncio.sleep(
                        (time.monotonic() - t_step) * (cfg.slow_factor - 1.0)
                        + 0.002 * cfg.slow_factor
                    )
                await ps.push(grads, num_samples=len(idx))
                await ps.clock()
                losses.append(loss)
            event: ProgressEvent = {
                "event": "epoch",
                "worker": cfg.worker_index,
                "epoch": epoch + 1,
                "epochs": cfg.epochs,
                "loss": float(np.mean(losses)),
                "clock": ps.clock_value,
                "elapsed_s": round(time.monotonic() - t0, 3),
            }
            if cfg.evaluate:
                params = await ps.pull(keys)
                acc = model.accuracy(params, data.x_test, data.y_test)
                event["test_accuracy"] = acc
            event["train_elapsed_s"] = round(time.monotonic() - t_train, 4)
            _emit(event, cfg.progress)
        params = await ps.pull(keys)  # waits for the last step, so our update is in
        acc = model.accuracy(params, data.x_test, data.y_test)
    summary: ProgressEvent = {
        "event": "done",
        "worker": cfg.worker_index,
        "test_accuracy": acc,
        "steps": resume.planned,
        "resumed_steps": resume.skipped,
        "trained_steps": resume.planned - resume.skipped,
        "elapsed_s": round(time.monotonic() - t0, 3),
    }
    _emit(summary, cfg.progress)
    return summary


# ---------------------------------------------------------------------- CLI: worker
def progress_format(args: argparse.Namespace, env: Mapping[str, str]) -> str:
    """The worker's progress format: ``--progress``, else the log format (``--log-format``,
    then ``PARAMSERVER_LOG_FORMAT``, then ``text``)."""
    return str(args.progress or resolve_log_format(getattr(args, "log_format", None), env))


def cmd_worker(args: argparse.Namespace) -> int:
    from paramserver.serving.bootstrap import run_loop

    cfg = TrainConfig(
        server=server_address(args),
        worker_index=args.worker_index,
        num_workers=args.num_workers,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        momentum=args.momentum,
        hidden=args.hidden,
        seed=args.seed,
        evaluate=not args.no_eval,
        slow_factor=args.slow_factor,
        compression=args.compression,
        topk_ratio=args.topk_ratio,
        framework=args.framework,
        replace=args.replace,
        security=client_security_from_args(args, os.environ),
        retry=RetryPolicy(deadline_s=args.retry_deadline_s)
        if args.retry_deadline_s is not None
        else None,
        progress=args.progress or resolve_log_format(getattr(args, "log_format", None), os.environ),
    )
    if args.retry_deadline_s is not None and not args.retry_deadline_s > 0:
        print("paramserver worker: --retry-deadline-s must be > 0", file=sys.stderr)
        return 2
    if cfg.num_workers < 1 or not 0 <= cfg.worker_index < cfg.num_workers:
        print(
            f"paramserver worker: --num-workers must be >= 1 and --worker-index in "
            f"[0, --num-workers); got {cfg.worker_index} of {cfg.num_workers}",
            file=sys.stderr,
        )
        return 2
    if cfg.batch_size < 1 or cfg.epochs < 0:
        print("paramserver worker: --batch-size must be >= 1 and --epochs >= 0", file=sys.stderr)
        return 2
    summary = run_loop(_until_sigterm(train_worker(cfg)), use_uvloop=not args.no_uvloop)
    if summary is None:
        print("paramserver worker: stopped by SIGTERM (left the cluster)", file=sys.stderr)
        return 143
    if summary["test_accuracy"] < args.min_accuracy:
        print(
            f"paramserver worker: test accuracy {summary['test_accuracy']:.4f} is below "
            f"--min-accuracy {args.min_accuracy}",
            file=sys.stderr,
        )
        return 1
    return 0


async def _until_sigterm(job: Awaitable[T]) -> T | None:
    """Run ``job``; SIGTERM cancels it, so its ``async with connect(...)`` leaves cleanly (the
    worker's name is free at once instead of after its lease). Returns None when cancelled."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(job)
    try:
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
        pass
    try:
        return await task
    except asyncio.CancelledError:
        me = asyncio.current_task()
        if me is not None and me.cancelling():  # we were cancelled ourselves: propagate
            raise
        return None
    finally:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGTERM)
