"""RemoteEmbedding / RemoteEmbeddingBag against torch.nn.Embedding / EmbeddingBag with the
same initial rows and SGD (docs/embedding-tables.md)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from paramserver.core.tables import Initializer, TableRule, TableSpec, initial_rows
from paramserver.worker_client import connect, connect_sync
from tests.harness import running_server

torch = pytest.importorskip("torch")
from paramserver.integrations.torch import RemoteEmbedding, RemoteEmbeddingBag  # noqa: E402

pytestmark = pytest.mark.timeout(120)

N, DIM, LR = 50, 6, 0.1
INIT = Initializer("normal", 0.3)


def _spec() -> TableSpec:
    return TableSpec("emb", DIM, rule=TableRule("sgd", lr=LR), initializer=INIT, seed=9)


def _local(bag: str | None) -> torch.nn.Module:
    w0 = torch.from_numpy(initial_rows(9, np.arange(N, dtype=np.int64), DIM, INIT))
    if bag is None:
        return torch.nn.Embedding.from_pretrained(w0.clone(), freeze=False, sparse=True)
    return torch.nn.EmbeddingBag.from_pretrained(w0.clone(), freeze=False, mode=bag, sparse=True)


def _steps() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(4):
        ids = torch.randint(0, N, (12,), generator=g)
        offsets = torch.tensor([0, 3, 3, 8])  # one empty bag
        target = torch.randn(12, DIM, generator=g)
        out.append((ids, offsets, target))
    return out


@pytest.mark.parametrize("bag", [None, "sum", "mean"])
async def test_remote_modules_train_like_torch(bag: str | None) -> None:
    async with running_server(consistency="asp") as d:

        def remote_run() -> np.ndarray:
            with connect_sync(d.address, "t") as ps:
                ps.init_table(_spec())
                mod = (
                    RemoteEmbedding(ps, "emb", DIM)
                    if bag is None
                    else RemoteEmbeddingBag(ps, "emb", DIM, mode=bag)
                )
                for ids, offsets, target in _steps():
                    out = mod(ids) if bag is None else mod(ids, offsets)
                    loss = ((out - target[: out.shape[0]]) ** 2).sum()
                    loss.backward()  # pushes the rows' sparse gradients
                return ps.pull_rows("emb", np.arange(N))

        got = await asyncio.to_thread(remote_run)
    local = _local(bag)
    opt = torch.optim.SGD(local.parameters(), lr=LR)
    for ids, offsets, target in _steps():
        opt.zero_grad()
        out = local(ids) if bag is None else local(ids, offsets)
        ((out - target[: out.shape[0]]) ** 2).sum().backward()
        opt.step()
    np.testing.assert_allclose(got, local.weight.detach().numpy(), rtol=1e-5, atol=1e-6)


async def test_async_client_prefetch_and_push_pending() -> None:
    async with running_server(consistency="asp") as d:
        async with connect(d.address, "a") as ps:
            await ps.init_table(_spec())
            mod = RemoteEmbedding(ps, "emb", DIM)
            ids = torch.tensor([[1, 2], [2, 7]])
            with pytest.raises(Exception, match="prefetch"):
                mod(ids)
            await mod.prefetch(ids)
            mod(ids).sum().backward()
            (ack,) = await mod.push_pending()
            assert ack.distinct == 3
            got = await ps.pull_rows("emb", np.array([1, 2, 7, 3]))
    init = initial_rows(9, np.array([1, 2, 7, 3]), DIM, INIT)
    want = init - np.float32(LR) * np.array([1, 2, 1, 0], np.float32)[:, None]
    np.testing.assert_allclose(got, want, rtol=1e-6)
