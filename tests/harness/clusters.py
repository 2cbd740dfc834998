"""In-process servers and sharded clusters on 127.0.0.1 (ephemeral ports), and a deterministic
BSP job."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import numpy as np

from paramserver.cli.serve import daemon_for
from paramserver.core.sharding import ShardMap
from paramserver.server.config import ServerConfig
from paramserver.server.shard_daemon import ParameterServerDaemon
from paramserver.worker_client import UpdateRule, connect
from paramserver.worker_client.client import WorkerClient


def address_of(daemon: ParameterServerDaemon) -> str:
    """``host:port`` of an in-process daemon on 127.0.0.1 (its ephemeral port once bound)."""
    return f"127.0.0.1:{daemon.port}"


@asynccontextmanager
async def running_server(**config: Any) -> AsyncIterator[Any]:
    """An in-process server on 127.0.0.1, ephemeral port (the daemon of ``mode``)."""
    config.setdefault("host", "127.0.0.1")
    config.setdefault("port", 0)
    daemon = daemon_for(ServerConfig(**config))
    await daemon.start()
    try:
        yield daemon
    finally:
        await daemon.stop(grace_s=0.2)


@asynccontextmanager
async def running_cluster(
    shards: int, *, per_shard: Sequence[dict[str, Any]] | None = None, **config: Any
) -> AsyncIterator[list[ParameterServerDaemon]]:
    """``shards`` daemons bound to ephemeral ports, each serving the cluster's shard map.

    The ports are known only once bound, so the map is installed after every shard started
    (the daemons' ``shard_map`` attribute); ``shard_addresses`` holds placeholders of the
    right count so each shard knows its index and the shard count.
    """
    config.setdefault("host", "127.0.0.1")
    config.setdefault("port", 0)
    if shards > 1:
        config.setdefault("shard_addresses", ",".join(["127.0.0.1:0"] * shards))
    daemons = []
    try:
        for i in range(shards):
            own = dict(config)
            own.update(per_shard[i] if per_shard else {})
            d = ParameterServerDaemon(ServerConfig(shard_index=i, **own))
            await d.start()
            daemons.append(d)
        shard_map = ShardMap(
            tuple(d.address for d in daemons),
            slice_bytes=config.get("slice_bytes", 4 << 20),
            epoch=config.get("shard_map_epoch", 0),
        )
        for d in daemons:
            d.shard_map = shard_map
        yield daemons
    finally:
        for d in daemons:
            await d.stop(grace_s=0.2)


def job_params() -> dict[str, np.ndarray]:
    """Initial parameters: small keys (whole) and large ones (sliced at 1 KiB)."""
    rng = np.random.default_rng(11)
    return {
        "w": rng.normal(size=1000).astype(np.float32),  # 4000 B: 4 slices
        "m": rng.normal(size=(30, 10)).astype(np.float32),  # 1200 B: 2 slices
        "b": np.float32(0.25) * np.ones((), np.float32),  # scalar, whole
        "h": rng.normal(size=64).astype(np.float16),  # 128 B, whole
        "a": rng.normal(size=(20, 40)).astype(np.float32),  # 3200 B: 4 slices, adam
    }


RULES = {
    "sgd": UpdateRule("sgd", lr=0.05, momentum=0.9),
    "adam": UpdateRule("adam", lr=0.01),
}


def job_grad(key: str, value: np.ndarray, worker: int, step: int) -> np.ndarray:
    """Deterministic gradient of one key from the pulled value, worker and step."""
    rng = np.random.default_rng([worker, step, sum(map(ord, key))])
    noise = rng.normal(size=value.shape)
    return (0.5 * value.astype(np.float64) + noise).astype(value.dtype)


async def open_workers(address: str, workers: int, **kwargs: Any) -> list[WorkerClient]:
    clients = [connect(address, f"w{i}", **kwargs) for i in range(workers)]
    await asyncio.gather(*(c.open() for c in clients))
    return clients


async def run_job(
    address: str, workers: int, steps: int, *, init: bool = True
) -> dict[str, np.ndarray]:
    """``workers`` workers (all registered before any step) run ``steps`` BSP steps from the
    cluster's current clock; returns the parameters read at the end."""
    clients = await open_workers(address, workers)
    try:
        if init:
            params = job_params()
            sgd = {k: v for k, v in params.items() if k != "a"}
            await clients[0].init(sgd, rule=RULES["sgd"])
            await clients[0].init({"a": params["a"]}, rule=RULES["adam"])

        async def work(i: int) -> None:
            ps = clients[i]
            for _ in range(steps):
                t = ps.clock_value
                pulled = await ps.pull(sorted(job_params()))
                await ps.push({k: job_grad(k, v, i, t) for k, v in pulled.items()}, num_samples=8)
                await ps.clock()

        await asyncio.gather(*(work(i) for i in range(workers)))
        return await clients[0].pull(sorted(job_params()))
    finally:
        await asyncio.gather(*(c.close() for c in clients))
