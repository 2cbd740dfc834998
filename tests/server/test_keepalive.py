"""HTTP/2 keepalive (issue 19, item 4): a client pinging every 10 s survives a 90 s silent
BSP wait; the server's ping policy is documented in docs/robustness.md and
``paramserver/protocol/keepalive.py``."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from paramserver.protocol.keepalive import CLIENT_KEEPALIVE_OPTIONS, SERVER_KEEPALIVE_OPTIONS
from paramserver.worker_client import UpdateRule, connect
from paramserver.worker_client.retry import RetryPolicy
from tests.harness import ServerProcess

KEEPALIVE_10S = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SILENT_WAIT_S = 90.0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_10s_keepalive_client_survives_a_90s_silent_bsp_wait(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path, "--consistency", "bsp", "--lease-ms", "600000")

    async def body() -> float:
        no_retry = RetryPolicy(deadline_s=0.0)
        waiter = connect(
            server.address,
            "waiter",
            heartbeat=False,
            retry=no_retry,
            channel_options=KEEPALIVE_10S,
            local_link=False,  # the wait must ride the HTTP/2 connection itself
            session=False,
            wait_timeout_s=SILENT_WAIT_S + 60,
            rpc_timeout_s=SILENT_WAIT_S + 60,
        )
        late = connect(server.address, "late", heartbeat=False, retry=no_retry)
        await waiter.open()
        await late.open()
        try:
            await waiter.init({"w": np.zeros(3, np.float32)}, rule=UpdateRule("add"))
            await late.init({"w": np.zeros(3, np.float32)}, rule=UpdateRule("add"))
            await waiter.pull(["w"])
            await waiter.push({"w": np.ones(3, np.float32)})
            await waiter.clock()
            t0 = time.monotonic()
            pull = asyncio.ensure_future(waiter.pull(["w"]))  # waits on "late": silence
            await asyncio.sleep(SILENT_WAIT_S)
            assert not pull.done(), pull  # a GOAWAY would have ended it (UNAVAILABLE)
            await late.pull(["w"])
            await late.push({"w": np.full(3, 2, np.float32)})
            await late.clock()
            got = (await asyncio.wait_for(pull, 30))["w"]
            np.testing.assert_array_equal(got, np.full(3, 1.5, np.float32))  # mean of 1, 2
            return time.monotonic() - t0
        finally:
            await late.close()
            await waiter.close()

    try:
        waited = asyncio.run(body())
        assert waited >= SILENT_WAIT_S
        assert "too_many_pings" not in server.log().lower()
    finally:
        server.stop()


def test_the_documented_ping_policy_admits_the_product_clients() -> None:
    server = dict(SERVER_KEEPALIVE_OPTIONS)
    client = dict(CLIENT_KEEPALIVE_OPTIONS)
    assert server["grpc.keepalive_permit_without_calls"] == 1
    assert (
        client["grpc.keepalive_time_ms"] >= server["grpc.http2.min_ping_interval_without_data_ms"]
    )
    assert 10_000 >= server["grpc.http2.min_ping_interval_without_data_ms"]
