"""TrainPipeline on real servers (127.0.0.1:0): what each step reads, exactly as documented
(pipelined: this worker's gradients through step r-2; plain: through r-1), against a numpy
replay of the sgd table; the final table is the same either way."""

from __future__ import annotations

import numpy as np
import pytest

from paramserver.core.tables import Initializer, TableRule, TableSpec
from paramserver.errors import InvalidArgument
from paramserver.worker_client import connect
from tests.harness import running_cluster

torch = pytest.importorskip("torch")
from paramserver.integrations.torch_collection import (  # noqa: E402
    KeyedJaggedIds,
    RemoteBagTable,
    RemoteEmbeddingBagCollection,
)
from paramserver.integrations.torch_pipeline import TrainPipeline  # noqa: E402

pytestmark = pytest.mark.timeout(120)

N, DIM, LR, B, STEPS = 12, 2, 0.5, 4, 6
FEATURES = ["a", "b"]


def _batches() -> list[tuple[KeyedJaggedIds, dict[str, torch.Tensor]]]:
    """Bags of 1-2 ids over a few rows (so steps share rows) and integer loss weights C:
    loss = sum_f sum(pooled_f * C_f), whose row gradients do not depend on the rows."""
    rng = np.random.default_rng(4)
    out = []
    for _ in range(STEPS):
        lists = {
            f: [list(rng.integers(0, N, rng.integers(1, 3))) for _ in range(B)] for f in FEATURES
        }
        kjt = KeyedJaggedIds.from_lists(lists)
        c = {
            f: torch.from_numpy(rng.integers(-2, 3, (B, DIM)).astype(np.float32)) for f in FEATURES
        }
        out.append((kjt, c))
    return out


def _replay(
    batches: list[tuple[KeyedJaggedIds, dict[str, torch.Tensor]]], lag: int
) -> tuple[list[dict[str, np.ndarray]], np.ndarray]:
    """numpy: each step's pooled outputs when it reads the table with the gradients of steps
    < r - lag + 1 applied (lag 1: plain, 2: pipelined), and the final table."""
    grads = []
    for kjt, c in batches:
        g = np.zeros((N, DIM))
        lengths = kjt.lengths().numpy().reshape(len(FEATURES), B)
        values = kjt.values().numpy()
        pos = 0
        for fi, f in enumerate(FEATURES):
            for i in range(B):
                for _ in range(lengths[fi, i]):
                    g[values[pos]] += c[f][i].numpy()
                    pos += 1
        grads.append(g)
    seen = []
    for r, (kjt, _) in enumerate(batches):
        table = -LR * sum((grads[q] for q in range(r - lag + 1)), np.zeros((N, DIM)))
        lengths = kjt.lengths().numpy().reshape(len(FEATURES), B)
        values = kjt.values().numpy()
        pos, pooled = 0, {}
        for fi, f in enumerate(FEATURES):
            rows = np.zeros((B, DIM))
            for i in range(B):
                for _ in range(lengths[fi, i]):
                    rows[i] += table[values[pos]]
                    pos += 1
            pooled[f] = rows
        seen.append(pooled)
    return seen, -LR * sum(grads, np.zeros((N, DIM)))


@pytest.mark.parametrize(("shards", "pipelined"), [(1, True), (2, True), (1, False)])
async def test_steps_read_what_the_pipeline_promises(shards: int, pipelined: bool) -> None:
    batches = _batches()
    spec = TableSpec("t", DIM, rule=TableRule("sgd", lr=LR), initializer=Initializer("zeros"))
    async with running_cluster(shards, consistency="asp") as daemons:
        async with connect(daemons[0].address, "w") as client:
            await client.init_table(spec)
            ebc = RemoteEmbeddingBagCollection(client, [RemoteBagTable("t", DIM, FEATURES)])
            seen: list[dict[str, np.ndarray]] = []

            def step(batch: tuple[KeyedJaggedIds, dict[str, torch.Tensor]]) -> float:
                kjt, c = batch
                pooled = ebc(kjt)
                seen.append({f: pooled[f].detach().double().numpy() for f in FEATURES})
                loss = sum((pooled[f] * c[f]).sum() for f in FEATURES)
                loss.backward()  # type: ignore[union-attr]
                return float(loss.detach())  # type: ignore[union-attr]

            pipe = TrainPipeline(ebc, step, features=lambda b: b[0], pipelined=pipelined)
            losses = [loss async for loss in pipe.run(batches)]
            final = await client.pull_rows("t", np.arange(N))
            assert client.clock_value == STEPS
    want_seen, want_final = _replay(batches, 2 if pipelined else 1)
    assert len(losses) == STEPS and pipe.stats.steps == STEPS
    for r in range(STEPS):
        for f in FEATURES:
            np.testing.assert_array_equal(seen[r][f], want_seen[r][f], err_msg=f"step {r} {f}")
    np.testing.assert_array_equal(final.astype(np.float64), want_final)


def test_a_blocking_client_is_refused() -> None:
    class Blocking:  # what connect_sync's client offers: plain methods
        def pull_rows_many(self, ids: object) -> None: ...

        def push_rows_many(self, ids: object, grads: object) -> None: ...

    ebc = RemoteEmbeddingBagCollection(Blocking(), [RemoteBagTable("t", DIM, FEATURES)])
    with pytest.raises(InvalidArgument, match="async client"):
        TrainPipeline(ebc, lambda b: b)
