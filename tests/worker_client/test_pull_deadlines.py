"""One deadline rule for every pull: ``timeout_s=0`` asks the server for a 1 ms consistency
wait on dense pulls and row pulls alike (a row pull used to ask for the server's 60 s default
under a 30 s client deadline)."""

from __future__ import annotations

import numpy as np
import pytest

import paramserver as ps
from paramserver.errors import WaitTimeout
from paramserver.protocol.table_spec import TableSpec
from tests.harness import address_of, running_server

pytestmark = pytest.mark.timeout(60)


async def test_timeout_zero_means_the_same_for_pull_and_pull_rows() -> None:
    async with running_server(consistency="ssp", staleness=0, lease_ms=600_000) as daemon:
        address = address_of(daemon)
        async with (
            ps.connect(address, worker_name="ahead") as ahead,
            ps.connect(address, worker_name="behind"),
        ):
            await ahead.init({"w": np.zeros(2, np.float32)})
            await ahead.init_table(TableSpec("emb", 2, consistency="ssp", staleness=0))
            await ahead.clock()  # now 1 clock ahead of "behind", with staleness 0
            with pytest.raises(WaitTimeout) as dense:
                await ahead.pull(["w"], timeout_s=0)
            with pytest.raises(WaitTimeout) as rows:
                await ahead.pull_rows("emb", np.array([1, 2]), timeout_s=0)
    for err in (dense.value, rows.value):
        assert "waited 0.001 s" in err.message, err.message
