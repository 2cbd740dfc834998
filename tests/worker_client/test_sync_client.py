"""The blocking client (``connect_sync``) offers what the async client offers: push with
``base_version``, pull and push_pull with ``copy=False`` views, observer pulls."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from paramserver.errors import InvalidArgument
from paramserver.worker_client import UpdateRule, connect_sync
from tests.harness import running_server

pytestmark = pytest.mark.timeout(60)


def test_sync_client_matches_the_async_surface() -> None:
    """ASP, sgd lr 1 on w = zeros(5); expected values are the closed form -k after k pushes of
    ones. A push based on version 0 with max_staleness 1 after two updates is dropped."""

    async def serve_and_run() -> None:
        async with running_server(consistency="asp", max_staleness=1) as srv:

            def work() -> None:
                with connect_sync(srv.address, "s0", heartbeat=False) as ps:
                    ps.init({"w": np.zeros(5, np.float32)}, rule=UpdateRule("sgd", lr=1.0))
                    ones = np.ones(5, np.float32)
                    view = ps.push_pull({"w": ones}, copy=False)["w"]
                    np.testing.assert_array_equal(view, -ones)
                    fresh = ps.push_pull({"w": ones}, base_version=1, timeout_s=10)["w"]
                    np.testing.assert_array_equal(fresh, -2 * ones)
                    fresh[:] = 7  # a copy: writing it changes nothing on the server
                    ack = ps.push({"w": ones}, base_version=0, timeout_s=10)
                    assert ack.dropped_stale
                    got = ps.pull(["w"], observer=True, copy=False)["w"]
                    np.testing.assert_array_equal(got, -2 * ones)
                    with pytest.raises(InvalidArgument, match="at least one gradient"):
                        ps.push({})

            await asyncio.get_running_loop().run_in_executor(None, work)

    asyncio.run(serve_and_run())
