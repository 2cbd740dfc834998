"""RemoteEmbeddingBagCollection against one torch.nn.EmbeddingBag per feature with the same
initial rows and SGD, on a real server (127.0.0.1:0): pooled outputs, per-id weights, two
features sharing a table, one request per batch each way."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from paramserver.core.tables import Initializer, TableRule, TableSpec, initial_rows
from paramserver.worker_client import KeyedIds, connect, connect_sync
from tests.harness import running_cluster

torch = pytest.importorskip("torch")
from paramserver.integrations.torch import (  # noqa: E402
    KeyedJaggedIds,
    RemoteBagTable,
    RemoteEmbeddingBagCollection,
)

pytestmark = pytest.mark.timeout(120)

N, LR = 40, 0.2
INIT = Initializer("normal", 0.3)
# table -> (dim, seed, mode, features)
TABLES = {"users": (4, 1, "sum", ["user"]), "items": (6, 2, "mean", ["item", "history"])}
FEATURES = ["user", "item", "history"]
B = 5


def _specs() -> list[TableSpec]:
    return [
        TableSpec(n, dim, rule=TableRule("sgd", lr=LR), initializer=INIT, seed=seed)
        for n, (dim, seed, _, _) in TABLES.items()
    ]


def _bags() -> list[RemoteBagTable]:
    return [RemoteBagTable(n, dim, feats, mode) for n, (dim, _, mode, feats) in TABLES.items()]


def _batch(seed: int, weighted: bool) -> tuple[KeyedJaggedIds, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(FEATURES) * B,), generator=g)
    lengths[0] = 0  # an empty bag
    values = torch.randint(0, N, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.shape, generator=g) + 0.5 if weighted else None
    kjt = KeyedJaggedIds.from_lengths_sync(FEATURES, values, lengths, weights)
    targets = {f: torch.randn(B, TABLES[_table_of(f)][0], generator=g) for f in FEATURES}
    return kjt, targets


def _table_of(feature: str) -> str:
    return next(n for n, v in TABLES.items() if feature in v[3])


def _reference(
    steps: list[tuple[KeyedJaggedIds, dict[str, torch.Tensor]]],
) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """One torch.nn.EmbeddingBag per table (features sharing a table share its weight),
    trained with torch.optim.SGD: final weights and every step's pooled outputs."""
    mods = {}
    for n, (dim, seed, mode, _) in TABLES.items():
        w0 = torch.from_numpy(initial_rows(seed, np.arange(N, dtype=np.int64), dim, INIT))
        mods[n] = torch.nn.EmbeddingBag.from_pretrained(w0.clone(), freeze=False, mode=mode)
    opt = torch.optim.SGD([m.weight for m in mods.values()], lr=LR)
    outs = []
    for kjt, targets in steps:
        opt.zero_grad()
        kj = KeyedIds.from_torchrec(kjt)
        loss = torch.zeros(())
        pooled = {}
        for f in FEATURES:
            ids = torch.from_numpy(kj.ids_of(f))
            offsets = torch.from_numpy(kj.offsets_of(f)[:-1])
            w = kj.weights_of(f)
            out = mods[_table_of(f)](
                ids, offsets, per_sample_weights=None if w is None else torch.from_numpy(w)
            )
            pooled[f] = out.detach().numpy().copy()
            loss = loss + ((out - targets[f]) ** 2).sum()
        loss.backward()
        opt.step()
        outs.append(pooled)
    return {n: m.weight.detach().numpy() for n, m in mods.items()}, outs


@pytest.mark.parametrize("shards", [1, 2])
async def test_collection_trains_like_one_embedding_bag_per_feature(shards: int) -> None:
    global TABLES
    saved = TABLES
    TABLES = {n: (d, s, "sum", f) for n, (d, s, _, f) in saved.items()}  # weights need sum
    try:
        steps = [_batch(seed, weighted=True) for seed in range(3)]
        want_rows, want_outs = _reference(steps)
        async with running_cluster(shards, consistency="asp") as daemons:

            def remote_run() -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
                with connect_sync(daemons[0].address, "t") as ps:
                    for spec in _specs():
                        ps.init_table(spec)
                    ebc = RemoteEmbeddingBagCollection(ps, _bags())
                    outs = []
                    for kjt, targets in steps:
                        pooled = ebc(kjt)
                        outs.append({f: v.detach().numpy().copy() for f, v in pooled.items()})
                        loss = sum(((pooled[f] - targets[f]) ** 2).sum() for f in FEATURES)
                        loss.backward()  # one several-table push
                    return ps.pull_rows_many({n: np.arange(N) for n in TABLES}), outs

            got_rows, got_outs = await asyncio.to_thread(remote_run)
    finally:
        TABLES = saved
    for got, want in zip(got_outs, want_outs, strict=True):
        for f in FEATURES:
            np.testing.assert_allclose(got[f], want[f], rtol=1e-5, atol=1e-6)
    for n in want_rows:
        np.testing.assert_allclose(got_rows[n], want_rows[n], rtol=1e-5, atol=1e-6)


async def test_mean_pooling_and_the_async_client() -> None:
    steps = [_batch(seed, weighted=False) for seed in range(2)]
    want_rows, want_outs = _reference(steps)
    async with running_cluster(1, consistency="asp") as daemons:
        async with connect(daemons[0].address, "a") as ps:
            for spec in _specs():
                await ps.init_table(spec)
            ebc = RemoteEmbeddingBagCollection(ps, _bags())
            with pytest.raises(Exception, match="prefetch"):
                ebc(steps[0][0])
            for (kjt, targets), want in zip(steps, want_outs, strict=True):
                await ebc.prefetch(kjt)
                pooled = ebc(kjt)
                for f in FEATURES:
                    np.testing.assert_allclose(
                        pooled[f].detach().numpy(), want[f], rtol=1e-5, atol=1e-6
                    )
                sum(((pooled[f] - targets[f]) ** 2).sum() for f in FEATURES).backward()
                (acks,) = await ebc.push_pending()
                assert set(acks) == set(TABLES)
            got = await ps.pull_rows_many({n: np.arange(N) for n in TABLES})
    for n in want_rows:
        np.testing.assert_allclose(got[n], want_rows[n], rtol=1e-5, atol=1e-6)


def test_weights_with_a_mean_table_are_refused() -> None:
    kjt, _ = _batch(0, weighted=True)
    ebc = RemoteEmbeddingBagCollection(object(), _bags())
    with pytest.raises(Exception, match="'sum' table"):
        ebc(kjt)
