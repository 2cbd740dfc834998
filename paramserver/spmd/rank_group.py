"""The ranks of one instance, opened together, and the one fan-out that calls them all.

:class:`RankGroup` is the base of :class:`~paramserver.spmd.group.SpmdParallelWorkers`: it
owns one :class:`~paramserver.spmd.rank_client.RankClient` per rank, opens them in the running
loop and reads every rank's metadata and layouts (refusing a rank that serves another index or
another instance), and runs a call on every rank concurrently, one task per rank, collecting
every outcome before it reports the failures, each naming its rank (after hivemind's
``averaging/allreduce.py``). The commands themselves (what is validated, what is sent) are the
subclass's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Self, TypeVar

import grpc
from google.protobuf.message import Message

from paramserver.api.v1 import spmd_pb2
from paramserver.closing import AsyncClosing
from paramserver.errors import InvalidArgument, ParamServerError
from paramserver.security.tls import ClientSecurity
from paramserver.spmd.layout import Layout, Tier
from paramserver.spmd.notification import TransferCompleteNotification
from paramserver.spmd.planning import Placement, RankTransferResult, Verdict
from paramserver.spmd.rank_client import RankClient, rank_error
from paramserver.spmd.transfer_errors import RankFailures

__all__ = ["RankGroup", "layouts_of"]

T = TypeVar("T")


def layouts_of(md: spmd_pb2.RankMetadata) -> dict[Tier, Layout]:
    """A rank's exported layouts by tier (Layout.from_proto validates each)."""
    return {Tier.parse(int(spec.tier)): Layout.from_proto(spec) for spec in md.layouts}


def _placement(p: spmd_pb2.Placement) -> Placement:
    src_obj = p.WhichOneof("source") == "sequence_hash"
    dst_obj = p.WhichOneof("destination") == "dst_sequence_hash"
    return Placement(
        src=int(p.sequence_hash if src_obj else p.src_block_id),
        dst=int(p.dst_sequence_hash if dst_obj else p.dst_block_id),
        src_is_object=src_obj,
        dst_is_object=dst_obj,
    )


def _rank_result(rank: int, response: spmd_pb2.TransferResponse) -> RankTransferResult:
    return RankTransferResult(
        rank=rank,
        bytes_moved=int(response.bytes_moved),
        elapsed_s=response.elapsed_us / 1e6,
        placements=tuple(_placement(p) for p in response.placements),
        path=response.path,
    )


class RankGroup(AsyncClosing):
    """The rank servers of one instance: their channels, metadata and layouts, and the fan-out.

    Its arguments (the rank addresses in rank order, the default deadline of commands, the
    security towards every rank) are documented where they are used:
    :class:`~paramserver.spmd.group.SpmdParallelWorkers`.
    """

    def __init__(
        self,
        rank_addresses: Sequence[str],
        *,
        default_timeout_s: float = 30.0,
        security: ClientSecurity | None = None,
    ) -> None:
        if not rank_addresses:
            raise InvalidArgument("SpmdParallelWorkers needs at least one rank address")
        if default_timeout_s <= 0:
            raise InvalidArgument("default_timeout_s must be > 0")
        self.rank_addresses = list(rank_addresses)
        self.default_timeout_s = default_timeout_s
        self._clients = [RankClient(a, r, security) for r, a in enumerate(self.rank_addresses)]
        self._metadata: list[spmd_pb2.RankMetadata] = []
        self._layouts: list[dict[Tier, Layout]] = []
        self._opened = False

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def create(
        cls,
        rank_addresses: Sequence[str],
        *,
        default_timeout_s: float = 30.0,
        security: ClientSecurity | None = None,
    ) -> Self:
        """Construct and open a group (``await group.close()`` when done)."""
        group = cls(rank_addresses, default_timeout_s=default_timeout_s, security=security)
        await group.open()
        return group

    async def open(self, timeout_s: float = 10.0) -> None:
        """Open a channel per rank in the running loop and read every rank's metadata.

        Raises:
            RankFailures: a rank is unreachable or serves another rank index than its position
                (every failing rank named).
        """
        for client in self._clients:
            await client.open()
        try:
            metadata = await self._fan_out("open", lambda c: c.export_metadata(timeout_s))
        except BaseException:
            await self.close()
            raise
        problems: dict[int, ParamServerError] = {}
        for rank, md in metadata.items():
            if md.rank != rank:
                problems[rank] = InvalidArgument(
                    f"rank {rank} ({self.rank_addresses[rank]}): server reports rank {md.rank}"
                )
        instances = {md.instance_id for md in metadata.values()}
        if len(instances) > 1:
            for rank, md in metadata.items():
                problems.setdefault(
                    rank,
                    InvalidArgument(f"rank {rank}: instance {md.instance_id} (mixed: {instances})"),
                )
        if problems:
            await self.close()
            raise RankFailures("open", problems, {}, self.worker_count())
        self._metadata = [metadata[r] for r in range(self.worker_count())]
        self._layouts = [layouts_of(md) for md in self._metadata]
        self._opened = True

    async def close(self) -> None:
        """Close every channel (idempotent)."""
        self._opened = False
        for client in self._clients:
            await client.close()

    # ------------------------------------------------------------------ plain accessors

    def worker_count(self) -> int:
        """Number of ranks in the group (local state, so not a coroutine)."""
        return len(self._clients)

    @property
    def instance_id(self) -> str:
        """The instance id the ranks reported."""
        self._require_open()
        return str(self._metadata[0].instance_id)

    def layouts(self, rank: int) -> dict[Tier, Layout]:
        """The layouts rank ``rank`` exported when the group was opened."""
        self._require_open()
        return dict(self._layouts[rank])

    def client(self, rank: int) -> RankClient:
        """The per-rank client (for block reads/writes and object streams)."""
        return self._clients[rank]

    def _require_open(self) -> None:
        if not self._opened:
            raise InvalidArgument("SpmdParallelWorkers is not open (use async with or create())")

    def _timeout(self, timeout_s: float | None) -> float:
        t = self.default_timeout_s if timeout_s is None else float(timeout_s)
        if t <= 0:
            raise InvalidArgument(f"timeout_s must be > 0, got {t}")
        return t

    # ------------------------------------------------------------------ fan-out helpers

    async def _fan_out(
        self,
        operation: str,
        call: Callable[[RankClient], Awaitable[T]],
        *,
        ranks: Sequence[int] | None = None,
    ) -> dict[int, T]:
        """Run ``call`` on every rank concurrently (one task per rank); every rank's result.

        Raises:
            RankFailures: at least one rank failed, naming all (after every rank ended).
        """
        results, failures = await self._outcomes(call, ranks)
        if failures:
            raise RankFailures(operation, failures, results, self.worker_count())
        return results

    async def _fan_out_settled(
        self, call: Callable[[RankClient], Awaitable[T]], *, ranks: Sequence[int] | None = None
    ) -> dict[int, T | ParamServerError]:
        """Run ``call`` on every rank concurrently (one task per rank); every rank's result or
        error (the results first)."""
        results, failures = await self._outcomes(call, ranks)
        return {**results, **failures}

    async def _outcomes(
        self, call: Callable[[RankClient], Awaitable[T]], ranks: Sequence[int] | None
    ) -> tuple[dict[int, T], dict[int, ParamServerError]]:
        """Run ``call`` on ``ranks`` (default: all) at once; their results and their errors."""
        chosen = list(range(self.worker_count())) if ranks is None else list(ranks)
        tasks = {r: asyncio.create_task(self._guard(r, call)) for r in chosen}
        if tasks:
            await asyncio.wait(tasks.values())
        results: dict[int, T] = {}
        failures: dict[int, ParamServerError] = {}
        for r, task in tasks.items():
            exc = task.exception()
            if exc is None:
                results[r] = task.result()
            else:
                assert isinstance(exc, ParamServerError)
                failures[r] = exc
        return results, failures

    async def _guard(self, rank: int, call: Callable[[RankClient], Awaitable[T]]) -> T:
        client = self._clients[rank]
        try:
            return await call(client)
        except ParamServerError as exc:
            if f"rank {rank}" in exc.message:
                raise
            raise rank_error(rank, client.address, exc) from exc
        except grpc.aio.AioRpcError as exc:
            raise rank_error(rank, client.address, exc) from exc

    def _refuse_if_any(self, operation: str, verdicts: Mapping[int, Verdict]) -> None:
        refused = {r: v for r, v in verdicts.items() if not v.ok}
        if not refused:
            return
        first = next(iter(refused.values()))
        text = "; ".join(f"rank {r}: {v.reason}" for r, v in sorted(refused.items()))
        raise first.error(f"{operation} refused before any rank started: {text}")

    def _dispatch(
        self,
        operation: str,
        method: str,
        requests: Mapping[int, Message],
        timeout_s: float,
    ) -> TransferCompleteNotification:
        async def one(rank: int, request: Message) -> RankTransferResult:
            client = self._clients[rank]
            response = await client.unary(method, request, timeout_s)
            return _rank_result(rank, response)

        tasks = {r: asyncio.create_task(one(r, req)) for r, req in requests.items()}
        return TransferCompleteNotification(operation, tasks, self.worker_count())

    def _options(self, rank: int, timeout_s: float, command_id: str) -> spmd_pb2.CommandOptions:
        return spmd_pb2.CommandOptions(
            timeout_ms=max(1, int(timeout_s * 1000)),
            incarnation_id=self._metadata[rank].incarnation_id,
            command_id=command_id,
        )
