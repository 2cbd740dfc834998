"""paramserver worker runners for :class:`benchlib.WorkerPool`.

``push_pull``: each round pushes a gradient of ones (float32, N elements) and pulls the whole
tensor back in one round trip (:meth:`WorkerClient.push_pull`; ASP, the server applies
``w -= lr * g`` on every push). ``cfg["shared_memory"]`` False forces the network path.
``cfg["shapes"]`` (a list of shapes) holds one key per shape instead (:func:`keys_for`), all
pushed and pulled in one ``push_pull`` per round, as a training step of a real model does.

``bsp_step``: each round is one BSP/SSP iteration: pull (waits as the model requires), a
simulated compute of ``compute_s`` (``slow_factor`` times longer on the straggler ranks), push,
clock.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from paramserver.core.optimizers import UpdateRule
from paramserver.worker_client.client import WorkerClient

KEY = "w"


def keys_for(shapes: list[tuple[int, ...]] | None) -> list[str]:
    """The key of each shape (``["w"]`` for the single tensor)."""
    return [KEY] if not shapes else [f"p{i:03d}" for i in range(len(shapes))]


class _Base:
    def __init__(self, rank: int, cfg: dict[str, Any]) -> None:
        self.rank = rank
        self.cfg = cfg
        self.n = int(cfg["n"])
        self.client = WorkerClient(
            cfg["address"],
            f"bench-{rank}",
            rpc_timeout_s=300.0,
            wait_timeout_s=300.0,
            channel_options=[("grpc.max_receive_message_length", 64 << 20)],
            shared_memory=bool(cfg.get("shared_memory", True)),
            local_link=bool(cfg.get("local_link", True)),
        )
        shapes = [tuple(s) for s in cfg.get("shapes") or [(self.n,)]]
        self.keys = keys_for(cfg.get("shapes"))
        self.shapes = dict(zip(self.keys, shapes, strict=True))
        self.grads = {k: np.ones(s, dtype=np.float32) for k, s in self.shapes.items()}
        self.grad = self.grads[self.keys[0]]
        self.copy = bool(cfg.get("copy", True))
        self.pushes = 0
        self.duplicates = 0
        self.dropped = 0

    async def setup(self) -> None:
        await self.client.open()
        rule = UpdateRule("sgd", lr=float(self.cfg["lr"]))
        await self.client.init(
            {k: np.zeros(s, dtype=np.float32) for k, s in self.shapes.items()}, rule=rule
        )

    async def _push(self) -> None:
        ack = await self.client.push({KEY: self.grad})
        self.pushes += 1
        self.duplicates += ack.duplicate
        self.dropped += ack.dropped_stale

    async def finish(self) -> dict[str, Any]:
        fp = self.client.fastpath
        paths = {
            "shm_active": fp.shm_active if fp else False,
            "shm_declined": fp.shm_declined if fp else "no session",
            "sessions_opened": fp.sessions_opened if fp else 0,
            "local_link": fp.on_local_link if fp else False,
        }
        await self.client.close()
        return {
            "pushes": self.pushes,
            "duplicates": self.duplicates,
            "dropped": self.dropped,
            **paths,
        }


class PushPull(_Base):
    async def round(self) -> None:
        pulled = await self.client.push_pull(self.grads, copy=self.copy)
        self.pushes += 1
        assert len(pulled) == len(self.shapes)


class BspStep(_Base):
    def __init__(self, rank: int, cfg: dict[str, Any]) -> None:
        super().__init__(rank, cfg)
        slow = rank in cfg.get("stragglers", ())
        self.compute_s = float(cfg["compute_s"]) * (float(cfg["slow_factor"]) if slow else 1.0)

    async def round(self) -> None:
        await self.client.pull([KEY])
        await asyncio.sleep(self.compute_s)
        await self._push()
        await self.client.clock()


def push_pull(rank: int, cfg: dict[str, Any]) -> PushPull:
    return PushPull(rank, cfg)


def bsp_step(rank: int, cfg: dict[str, Any]) -> BspStep:
    return BspStep(rank, cfg)
