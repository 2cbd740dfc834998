"""``ServerOptimizer`` and ``ShardSampler`` against a single-process torch oracle.

Under BSP with N workers on equal batches, mean aggregation and the same SGD rule, the
parameters after k steps equal single-process ``torch.optim.SGD`` on the union batch (up to
float32 rounding: the mean of N gradients is summed in another order than the union's); the
same with the gradients pushed from backward hooks. The sampler's shards equal
``DistributedSampler``'s, and a resumed sampler skips exactly the batches already trained.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from paramserver.errors import InvalidArgument  # noqa: E402
from paramserver.integrations.torch import ServerOptimizer, ShardSampler  # noqa: E402
from paramserver.worker_client import UpdateRule, connect_sync  # noqa: E402
from tests.harness import running_server  # noqa: E402

pytestmark = pytest.mark.timeout(120)

WORKERS = 2
BATCH = 8
STEPS = 5


_SEEDING = threading.Lock()  # torch's global generator: one thread at a time


def make_model() -> Any:
    with _SEEDING:
        torch.manual_seed(7)
        return torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
        ).float()


def batches() -> list[tuple[Any, Any]]:
    gen = torch.Generator().manual_seed(11)
    return [
        (
            torch.randn(WORKERS * BATCH, 6, generator=gen),
            torch.randint(0, 3, (WORKERS * BATCH,), generator=gen),
        )
        for _ in range(STEPS)
    ]


def single_process(rule: dict[str, float]) -> dict[str, Any]:
    """The oracle: plain torch on the union batch of every step."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=rule["lr"], momentum=rule.get("momentum", 0.0))
    for x, y in batches():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def worker(address: str, index: int, rule: dict[str, float], overlap: bool) -> dict[str, Any]:
    model = make_model()
    with connect_sync(address, f"w{index}") as client:
        opt = ServerOptimizer(
            model.named_parameters(),
            UpdateRule("sgd", **rule),
            client=client,
            num_workers=WORKERS,
            overlap=overlap,
        )
        for x, y in batches():
            part = slice(index * BATCH, (index + 1) * BATCH)  # equal halves of the union
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[part]), y[part]).backward()
            opt.step()
        assert opt.steps == STEPS and client.clock_value == STEPS
        opt.close()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("overlap", [False, True], ids=["push-in-step", "push-from-hooks"])
@pytest.mark.parametrize(
    "rule", [{"lr": 0.5}, {"lr": 0.2, "momentum": 0.9}], ids=["sgd", "momentum"]
)
async def test_bsp_workers_equal_single_process_sgd_on_the_union_batch(
    rule: dict[str, float], overlap: bool
) -> None:
    expected = single_process(rule)
    async with running_server(consistency="bsp", aggregation="mean") as daemon:
        address = f"127.0.0.1:{daemon.port}"
        got = await asyncio.gather(
            *(asyncio.to_thread(worker, address, i, rule, overlap) for i in range(WORKERS))
        )
    start = make_model().state_dict()
    for key, want in expected.items():
        assert not torch.equal(want, start[key])  # training moved it
        for params in got:
            torch.testing.assert_close(params[key], want, rtol=1e-5, atol=1e-6)


async def test_state_dict_names_the_keys_and_rule_and_refuses_another() -> None:
    async with running_server(consistency="asp") as daemon:
        model = make_model()
        address = f"127.0.0.1:{daemon.port}"

        def run() -> None:
            with connect_sync(address, "w") as client:
                opt = ServerOptimizer(model.parameters(), UpdateRule("adam"), client=client)
                model(torch.randn(2, 6)).sum().backward()
                opt.step()
                state = opt.state_dict()
                mine = state["paramserver"]
                assert mine["keys"] == [f"param.{i}" for i in range(4)]
                assert (mine["rule"]["kind"], mine["steps"], mine["clock"]) == ("adam", 1, 1)
                other = copy.deepcopy(state)
                other["paramserver"]["rule"]["lr"] = 1.0
                with pytest.raises(InvalidArgument, match="rule"):
                    opt.load_state_dict(other)
                state["paramserver"]["steps"] = 9
                opt.load_state_dict(state)
                assert opt.steps == 9

        await asyncio.to_thread(run)


# ---------------------------------------------------------------------------------- sampler
@pytest.mark.parametrize("size", [10, 11, 16])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_equal_distributed_samplers(size: int, drop_last: bool, shuffle: bool) -> None:
    from torch.utils.data import DistributedSampler

    data = list(range(size))
    for rank in range(3):
        ours = ShardSampler(data, num_workers=3, worker_index=rank, shuffle=shuffle, seed=4,
                            drop_last=drop_last)  # fmt: skip
        theirs = DistributedSampler(data, num_replicas=3, rank=rank, shuffle=shuffle, seed=4,
                                    drop_last=drop_last)  # fmt: skip
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def test_a_resumed_sampler_skips_exactly_the_batches_trained() -> None:
    data = list(range(23))
    full = ShardSampler(data, num_workers=2, worker_index=1, batch_size=3)
    plan = []  # every batch of 3 epochs, uninterrupted
    for epoch in range(3):
        full.set_epoch(epoch)
        indices = list(full)
        plan += [indices[i : i + 3] for i in range(0, len(indices), 3)]
    per_epoch = len(plan) // 3
    assert per_epoch == 4  # 12 indices per worker and epoch
    for done in (0, 2, per_epoch, per_epoch + 3, 3 * per_epoch):
        resumed = ShardSampler(data, num_workers=2, worker_index=1, batch_size=3, progress=done)
        rest = []
        for epoch in range(3):
            resumed.set_epoch(epoch)
            indices = list(resumed)
            assert len(indices) == len(resumed)
            rest += [indices[i : i + 3] for i in range(0, len(indices), 3)]
        assert rest == plan[done:]


def test_each_pass_without_set_epoch_is_the_next_epoch() -> None:
    data = list(range(17))
    explicit = ShardSampler(data, num_workers=2, worker_index=0, batch_size=2)
    implicit = ShardSampler(data, num_workers=2, worker_index=0, batch_size=2)
    resumed = ShardSampler(data, num_workers=2, worker_index=0, batch_size=2, progress=6)
    plan, rest = [], []
    for epoch in range(3):
        explicit.set_epoch(epoch)
        this_epoch = list(explicit)
        assert len(this_epoch) == 9
        plan += this_epoch
        assert list(implicit) == this_epoch
        rest += list(resumed)
    assert rest == plan[9 + 2 :]  # 5 batches of 9 per epoch: epoch 0 and 1 batch skipped


def test_sampler_refuses_an_index_out_of_range() -> None:
    with pytest.raises(InvalidArgument, match="worker_index"):
        ShardSampler([1, 2], num_workers=2, worker_index=2)


def test_optimizer_refuses_no_parameters_and_repeats() -> None:
    with pytest.raises(InvalidArgument, match="no parameters"):
        ServerOptimizer([], client=object())  # type: ignore[arg-type]
    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(InvalidArgument, match="repeats"):
        ServerOptimizer([("a", w), ("a", w)], client=object())  # type: ignore[arg-type]
    assert np.asarray([0]).size == 1
