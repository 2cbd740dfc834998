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


# ------------------------------------------------------------------ EmbeddingBag's arguments
PAD = 4  # a padding id that occurs in every batch


def _bag_inputs(
    form: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(input, offsets, per-entry weights, target) of one step; PAD occurs, alone in a bag too.

    2d: 4 bags of 3; offsets: 12 ids in bags [0, 3), [3, 3) (empty), [3, 8), [8, 12);
    last_offset: the same with the end (12) appended (include_last_offset).
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, N, (12,), generator=g)
    ids[[1, 5, 6]] = PAD
    if form == "2d":
        ids[9:12] = PAD  # the last bag is padding only
        ids = ids.reshape(4, 3)
        offsets = None
    else:
        ids[8:12] = PAD  # the last bag is padding only
        offsets = torch.tensor([0, 3, 3, 8] + ([12] if form == "last_offset" else []))
    weights = torch.rand(ids.shape, generator=g) + 0.5
    target = torch.randn(4, DIM, generator=g)
    return ids, offsets, weights, target


BAG_CASES = [
    (mode, form, pad, psw)
    for mode in ("sum", "mean")
    for form in ("2d", "offsets", "last_offset")
    for pad in (None, PAD)
    for psw in ((False, True) if mode == "sum" else (False,))
]


@pytest.mark.parametrize(("mode", "form", "pad", "psw"), BAG_CASES)
async def test_bag_arguments_train_like_torch_embedding_bag(
    mode: str, form: str, pad: int | None, psw: bool
) -> None:
    """Forward outputs, per_sample_weights' gradients and the rows after three SGD steps on the
    server equal torch.nn.EmbeddingBag's (same initial rows, torch.optim.SGD); the padding id's
    row is never pushed, so the server stores no row for it."""
    last = form == "last_offset"
    steps = [_bag_inputs(form, seed) for seed in range(3)]
    async with running_server(consistency="asp") as d:

        def remote_run() -> tuple[
            np.ndarray, list[torch.Tensor], list[torch.Tensor], int, np.ndarray
        ]:
            with connect_sync(d.address, "t") as ps:
                ps.init_table(_spec())
                initial = ps.pull_rows("emb", np.arange(N))
                mod = RemoteEmbeddingBag(
                    ps, "emb", DIM, mode=mode, include_last_offset=last, padding_idx=pad
                )
                outs, psw_grads = [], []
                for ids, offsets, weights, target in steps:
                    w = weights.clone().requires_grad_(True) if psw else None
                    out = mod(ids, offsets, per_sample_weights=w)
                    ((out - target) ** 2).sum().backward()  # pushes the rows' gradients
                    outs.append(out.detach())
                    if w is not None:
                        assert w.grad is not None
                        psw_grads.append(w.grad)
                rows = ps.status().tables[0].rows
                return initial, outs, psw_grads, rows, ps.pull_rows("emb", np.arange(N))

        initial, outs, psw_grads, stored, got = await asyncio.to_thread(remote_run)
    local = torch.nn.EmbeddingBag(
        N, DIM, mode=mode, include_last_offset=last, padding_idx=pad, sparse=True
    )
    with torch.no_grad():
        local.weight.copy_(torch.from_numpy(initial))
    opt = torch.optim.SGD(local.parameters(), lr=LR)
    for i, (ids, offsets, weights, target) in enumerate(steps):
        opt.zero_grad()
        w = weights.clone().requires_grad_(True) if psw else None
        out = local(ids, offsets, per_sample_weights=w)
        torch.testing.assert_close(outs[i], out.detach(), rtol=1e-6, atol=1e-6)
        ((out - target) ** 2).sum().backward()
        opt.step()
        if w is not None:
            torch.testing.assert_close(psw_grads[i], w.grad, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got, local.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    touched = {int(i) for ids, *_ in steps for i in ids.reshape(-1)}
    assert stored == len(touched - {pad})  # pad None: every touched id has a row
    if pad is not None:
        assert got[pad].tobytes() == initial[pad].tobytes()
        assert pad in touched


async def test_async_bag_with_padding_prefetches_and_pushes_no_padding_row() -> None:
    ids = torch.tensor([[PAD, 2, 2], [PAD, PAD, PAD], [7, PAD, 1]])
    weights = torch.tensor([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0], [0.5, 9.0, 4.0]])
    async with running_server(consistency="asp") as d:
        async with connect(d.address, "a") as ps:
            await ps.init_table(_spec())
            mod = RemoteEmbeddingBag(ps, "emb", DIM, mode="sum", padding_idx=PAD)
            await mod.prefetch(ids)
            assert mod._prefetched is not None
            assert mod._prefetched[0].tolist() == [1, 2, 7]
            out = mod(ids, per_sample_weights=weights)
            out.sum().backward()
            (ack,) = await mod.push_pending()
            assert ack.distinct == 3
            got = await ps.pull_rows("emb", np.array([1, 2, 7, PAD]))
            assert (await ps.status()).tables[0].rows == 3
    init = initial_rows(9, np.array([1, 2, 7, PAD]), DIM, INIT)
    want_out = np.stack([5 * init[1], np.zeros(DIM, np.float32), 0.5 * init[2] + 4 * init[0]])
    np.testing.assert_allclose(out.detach().numpy(), want_out, rtol=1e-6, atol=1e-7)
    # d(sum of outputs)/d(row) = the row's summed weights; sgd: row - lr * that
    summed = np.array([4.0, 5.0, 0.5, 0.0], np.float32)
    np.testing.assert_allclose(got, init - np.float32(LR) * summed[:, None], rtol=1e-6)


@pytest.mark.parametrize(
    ("mode", "call"),
    [
        ("mean", "psw"),  # per_sample_weights only with mode="sum": NotImplementedError
        ("sum", "psw_shape"),  # per_sample_weights not of input's shape: ValueError
        ("sum", "2d_offsets"),  # 2-D input with offsets: ValueError
        ("sum", "1d_no_offsets"),  # 1-D input without offsets: ValueError
    ],
)
async def test_bag_refuses_what_torch_refuses_with_its_error_before_any_pull(
    mode: str, call: str
) -> None:
    ids = torch.tensor([1, 2, 3, 4])
    offsets: torch.Tensor | None = torch.tensor([0, 2])
    weights: torch.Tensor | None = torch.rand(4)
    if call == "psw_shape":
        weights = torch.rand(3)
    elif call == "2d_offsets":
        ids, weights = ids.reshape(2, 2), None
    elif call == "1d_no_offsets":
        offsets, weights = None, None
    local = torch.nn.EmbeddingBag(N, DIM, mode=mode)
    with pytest.raises(Exception) as torch_err:  # any class: torch's own
        local(ids, offsets, per_sample_weights=weights)
    async with running_server(consistency="asp") as d:

        def remote() -> tuple[BaseException, int]:
            with connect_sync(d.address, "t") as ps:
                ps.init_table(_spec())
                mod = RemoteEmbeddingBag(ps, "emb", DIM, mode=mode)
                with pytest.raises(Exception) as err:
                    mod(ids, offsets, per_sample_weights=weights)
                return err.value, ps.status().tables[0].pulls

        err, pulls = await asyncio.to_thread(remote)
    assert type(err) is type(torch_err.value)
    assert str(err) == str(torch_err.value)
    assert pulls == 0  # refused before any row was pulled


@pytest.mark.parametrize("bad", [-1, 2.0, True])
def test_bag_padding_idx_must_be_an_id(bad: object) -> None:
    from paramserver.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="padding_idx"):
        RemoteEmbeddingBag(object(), "emb", DIM, padding_idx=bad)  # type: ignore[arg-type]
