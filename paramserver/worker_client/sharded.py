"""A worker session over a cluster of S > 1 shards: :class:`ShardedWorkerClient`.

:class:`~paramserver.worker_client.cluster.ClusterWorkerClient` uses one when the shard map it
fetches on open has more than one shard. It holds one
:class:`~paramserver.worker_client.client.WorkerClient` per shard (same worker name on every
shard, each with its own heartbeats, retries and request ids) and routes every call by
:mod:`paramserver.core.sharding`:

* ``init``: keys stored whole go to their home shard; a large tensor's layout tensor is declared
  first on its home shard (first writer wins, as for one key), then its slices on their shards.
* ``push``: the gradients are split like the parameters and pushed to every shard concurrently;
  each shard applies its part at most once per request id, so retries stay idempotent per shard.
* ``pull``: the parts are pulled from every shard holding one, concurrently, and reassembled
  (bit-exact). Each shard waits as its consistency model requires, so a pull waits on every
  shard it reads.
* ``clock``: every shard, concurrently. Every worker registers and clocks on every shard, so each
  shard sees the whole cluster's clocks: BSP steps close and SSP bounds hold per cluster, not per
  shard. A shard that hands out a lower starting clock (it joined later) is clocked forward to
  the others' clock, so the worker's clock is one number cluster-wide.

Calls fan out with one task per shard; when some shards fail, every shard's outcome is collected
first and the error names each failing shard (its class is the first failure's, so callers can
still catch e.g. :class:`~paramserver.errors.KeyNotFound`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import TypeVar, Unpack

import numpy as np
import numpy.typing as npt
from google.protobuf.descriptor import FieldDescriptor
from numpy.typing import ArrayLike

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import tables_pb2 as tpb
from paramserver.api.v1 import tensor_pb2 as tensor_pb
from paramserver.core.optimizers import UpdateRule
from paramserver.core.sharding import (
    ShardMap,
    TensorLayout,
    assemble,
    check_user_key,
    decode_layout,
    encode_layout,
    home_shard,
    layout_key,
    parse_name,
)
from paramserver.core.store import count_non_finite
from paramserver.core.tables import TableSpec
from paramserver.errors import (
    InvalidArgument,
    KeyNotFound,
    NonFiniteGradient,
    ParamServerError,
    WorkerNotFound,
)
from paramserver.protocol import tensor
from paramserver.worker_client.client import (
    PushAck,
    WorkerClient,
    WorkerProgress,
    await_workers,
    cast_gradients,
    progress_of,
)
from paramserver.worker_client.embedding import RowPushAck, ValidatedRows
from paramserver.worker_client.keyed import KeyedIds, TableIds
from paramserver.worker_client.options import (
    PullOptions,
    PullRowsManyOptions,
    PushOptions,
    PushPullOptions,
    ValidatedPullOptions,
)
from paramserver.worker_client.request_ids import RequestIds
from paramserver.worker_client.sharded_tables import ShardedTables

__all__ = ["ShardedWorkerClient", "merge_views"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def merge_views(views: Iterable[pb.ClusterView]) -> pb.ClusterView:
    """One view of the cluster: the fewest live workers and the lowest minimum clock."""
    vs = list(views)
    out = pb.ClusterView()
    out.CopyFrom(vs[0])
    out.live_workers = min(v.live_workers for v in vs)
    out.min_clock = min(v.min_clock for v in vs)
    out.membership_epoch = max(v.membership_epoch for v in vs)
    return out


class ShardedWorkerClient:
    """One worker's calls over a cluster of S > 1 shards (see the module docstring).

    Args:
        shard_map: The cluster's map.
        shards: One unopened client per shard, in shard-map order.

    Attributes:
        worker_id, clock_value, lease_ms, evicted, last_version, reregistrations, view: The
            worker's state over the shards (the first shard's id, the one cluster-wide clock,
            the shortest lease, the merged view, ...), as of the last call.
    """

    def __init__(self, shard_map: ShardMap, shards: list[WorkerClient]) -> None:
        self.shard_map = shard_map
        self.shards = shards
        first = shards[0]
        self.worker_name = first.worker_name
        self.rpc_timeout_s = first.rpc_timeout_s
        self.cast_gradients = first.cast_gradients
        self.worker_id = ""
        self.clock_value = 0
        self.lease_ms = 0
        self.evicted = False
        self.last_version = 0
        self.reregistrations = 0
        self.view: pb.ClusterView | None = None
        #: Row push request ids: one id on every shard; from the name, clock and count
        #: at the clock with ``resume`` (see :class:`RequestIds`).
        self._row_push_ids = RequestIds(first.worker_name, first.resume)
        self._layouts: dict[str, TensorLayout] = {}
        self._allow_non_finite = False  # the shards' policy, learned from their Status

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> None:
        """Open one session per shard, then align their clocks.

        Raises:
            ParamServerError: naming every shard that could not be opened (those that were
                are closed again).
        """
        clients = self.shards
        results = await asyncio.gather(*(c.open() for c in clients), return_exceptions=True)
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(
                *(c.close() for c, r in zip(clients, results, strict=True) if r is None),
                return_exceptions=True,
            )
            raise self._combine(dict(failed))
        await self._align_clocks()
        logger.debug(
            "worker %s joined a cluster of %d shards (epoch %d) at clock %d",
            self.worker_name,
            self.shard_map.num_shards,
            self.shard_map.epoch,
            self.clock_value,
        )

    async def close(self) -> None:
        """Leave every shard and close every channel."""
        await asyncio.gather(*(c.close() for c in self.shards), return_exceptions=True)

    # ------------------------------------------------------------------ fan-out
    def _combine(self, errors: Mapping[int, BaseException]) -> BaseException:
        for exc in errors.values():
            if not isinstance(exc, Exception):
                return exc  # cancellation and friends pass through untouched
        addresses = self.shard_map.addresses
        first = next(iter(errors.values()))
        if len(errors) == 1 and isinstance(first, ParamServerError):
            (index,) = errors
            where = addresses[index] if index < len(addresses) else "?"
            combined: ParamServerError = type(first)(f"shard {index} ({where}): {first.message}")
            combined.__cause__ = first
            combined.hint = first.hint
            return combined
        parts = []
        for index, exc in sorted(errors.items()):
            where = addresses[index] if index < len(addresses) else "?"
            msg = exc.message if isinstance(exc, ParamServerError) else repr(exc)
            parts.append(f"shard {index} ({where}): {type(exc).__name__}: {msg}")
        cls = type(first) if isinstance(first, ParamServerError) else ParamServerError
        combined = cls(f"{len(errors)} shards failed: " + "; ".join(parts))
        combined.__cause__ = first
        combined.hint = next(
            (e.hint for e in errors.values() if isinstance(e, ParamServerError) and e.hint), None
        )
        return combined

    async def _fan_out(self, calls: Mapping[int, Awaitable[T]]) -> dict[int, T]:
        """Run one call per shard concurrently; raise naming every failing shard."""
        indexes = list(calls)
        results = await asyncio.gather(*calls.values(), return_exceptions=True)
        errors = {
            i: r for i, r in zip(indexes, results, strict=True) if isinstance(r, BaseException)
        }
        if errors:
            raise self._combine(errors)
        return {i: r for i, r in zip(indexes, results, strict=True)}  # type: ignore[misc]

    def _sync_state(self) -> None:
        first = self.shards[0]
        self.worker_id = first.worker_id
        self.lease_ms = min(c.lease_ms for c in self.shards)
        self.evicted = any(c.evicted for c in self.shards)
        self.last_version = sum(c.last_version for c in self.shards)
        self.reregistrations = sum(c.reregistrations for c in self.shards)
        views = [c.view for c in self.shards if c.view is not None]
        if views:
            self.view = merge_views(views)

    async def _align_clocks(self) -> None:
        """Clock lagging shards forward so the worker has one clock cluster-wide."""
        target = max(c.clock_value for c in self.shards)
        lagging = [c for c in self.shards if c.clock_value < target]
        if lagging:
            logger.debug(
                "worker %s: clocking %d shard(s) forward to clock %d",
                self.worker_name,
                len(lagging),
                target,
            )

        async def forward(c: WorkerClient) -> None:
            while c.clock_value < target:
                before = c.clock_value
                await c.clock()
                if c.clock_value <= before:  # pragma: no cover - a server that will not move
                    raise ParamServerError(f"shard {c.address} would not advance the clock")

        await self._fan_out({i: forward(c) for i, c in enumerate(self.shards) if c in lagging})
        self.clock_value = target
        self._sync_state()

    # ------------------------------------------------------------------ membership
    async def register(self, *, replace: bool | None = None, resume_worker_id: str = "") -> int:
        """Register on every shard (see :meth:`WorkerClient.register`); the cluster's clock."""
        # Each shard continues its own registration (ids differ per shard).
        await self._fan_out(
            {
                i: c.register(
                    replace=replace, resume_worker_id=c.worker_id if resume_worker_id else ""
                )
                for i, c in enumerate(self.shards)
            }
        )
        await self._align_clocks()
        return self.clock_value

    async def heartbeat(self) -> pb.HeartbeatResponse:
        """Renew the lease on every shard: the shortest lease and the merged view."""
        resps = await self._fan_out({i: c.heartbeat() for i, c in enumerate(self.shards)})
        self._sync_state()
        return pb.HeartbeatResponse(
            lease_ms=min(r.lease_ms for r in resps.values()),
            view=merge_views(r.view for r in resps.values()),
        )

    async def leave(self) -> None:
        """Leave every shard."""
        await self._fan_out({i: c.leave() for i, c in enumerate(self.shards)})

    def require_member(self) -> None:
        """Raise WorkerNotFound (FAILED_PRECONDITION) if some shard evicted the worker."""
        for i, c in enumerate(self.shards):
            if c.evicted:
                raise WorkerNotFound(f"worker {c.worker_id!r} was evicted by shard {i}")

    # ------------------------------------------------------------------ layouts
    async def _resolve(
        self, keys: Sequence[str], *, missing_ok: bool = False
    ) -> dict[str, TensorLayout]:
        """Layouts of existing keys (cached; asks their home shards once).

        Raises:
            KeyNotFound: a key that no shard holds (NOT_FOUND), unless ``missing_ok``.
        """
        unknown = [k for k in dict.fromkeys(keys) if k not in self._layouts]
        if unknown:
            by_home: dict[int, list[str]] = {}
            for k in unknown:
                by_home.setdefault(home_shard(k, self.shard_map.num_shards), []).append(k)
            statuses = await self._fan_out({h: self.shards[h].status() for h in by_home})
            await self._learn(statuses, by_home)
        missing = [k for k in keys if k not in self._layouts]
        if missing and not missing_ok:
            raise KeyNotFound(f"unknown keys {missing}: declare them with init first")
        return {k: self._layouts[k] for k in dict.fromkeys(keys) if k in self._layouts}

    async def _learn(
        self,
        statuses: Mapping[int, pb.StatusResponse],
        wanted: Mapping[int, list[str]] | None = None,
    ) -> None:
        """Record the layouts of the keys the given shards hold whole or as layout tensors."""
        need: dict[int, list[str]] = {}
        for shard, st in statuses.items():
            self._allow_non_finite = self._allow_non_finite or st.allow_non_finite
            infos = {ki.key: ki for ki in st.keys}
            keys = (
                wanted[shard]
                if wanted is not None
                else [parse_name(n)[1] for n in infos if parse_name(n)[0] != "slice"]
            )
            for k in keys:
                if k in self._layouts:
                    continue
                info = infos.get(k)
                if info is not None:
                    dtype = tensor.dtype_from_wire(info.dtype, k)
                    self._layouts[k] = TensorLayout(k, dtype, tuple(int(n) for n in info.shape))
                elif layout_key(k) in infos:
                    need.setdefault(shard, []).append(k)
        if need:
            pulled = await self._fan_out(
                {
                    s: self.shards[s].pull([layout_key(k) for k in ks], observer=True)
                    for s, ks in need.items()
                }
            )
            for s, ks in need.items():
                for k in ks:
                    self._layouts[k] = decode_layout(k, pulled[s][layout_key(k)])

    async def _resolve_all(self) -> dict[str, TensorLayout]:
        """Layouts of every key of the cluster (for ``pull()`` of all keys)."""
        statuses = await self._fan_out({i: c.status() for i, c in enumerate(self.shards)})
        await self._learn(statuses)
        keys: list[str] = []
        for st in statuses.values():
            keys.extend(parse_name(ki.key)[1] for ki in st.keys if parse_name(ki.key)[0] != "slice")
        return {k: self._layouts[k] for k in dict.fromkeys(keys) if k in self._layouts}

    async def _key_dtypes_of(self, keys: Sequence[str]) -> dict[str, np.dtype[np.generic]]:
        layouts = await self._resolve(keys, missing_ok=True)
        return {k: np.dtype(lay.dtype) for k, lay in layouts.items()}

    # ------------------------------------------------------------------ data plane
    async def init(
        self, tensors: Mapping[str, np.ndarray], rule: UpdateRule | None = None
    ) -> dict[str, np.ndarray]:
        """Declare keys over the shards; first writer wins per key (see the module docstring).

        Returns:
            key -> the stored value (yours if you created the key, else the first writer's).
        """
        rule = rule or UpdateRule()
        arrays = {k: tensor.normalize(v, k) for k, v in tensors.items()}
        for k in arrays:
            check_user_key(k)
        known = await self._resolve(list(arrays), missing_ok=True)
        num = self.shard_map.num_shards
        new = {
            k: self.shard_map.layout(k, a.dtype, a.shape)
            for k, a in arrays.items()
            if k not in known
        }
        whole: list[dict[str, np.ndarray]] = [{} for _ in range(num)]
        layouts: list[dict[str, np.ndarray]] = [{} for _ in range(num)]
        for k, lay in new.items():
            home = home_shard(k, num)
            if lay.sliced:
                layouts[home][layout_key(k)] = encode_layout(lay)
            else:
                whole[home][k] = arrays[k]

        async def declare(shard: int) -> dict[str, bool]:
            created: dict[str, bool] = {}
            if whole[shard]:
                created.update(await self.shards[shard].declare(whole[shard], rule))
            if layouts[shard]:
                assign = UpdateRule("assign")
                created.update(await self.shards[shard].declare(layouts[shard], assign))
            return created

        shards = {i for i in range(num) if whole[i] or layouts[i]}
        created = {
            name: c
            for r in (await self._fan_out({i: declare(i) for i in shards})).values()
            for name, c in r.items()
        }
        # The writer that created a layout tensor declares the slices; others read its layout.
        mine = {k: lay for k, lay in new.items() if lay.sliced and created.get(layout_key(k))}
        for k, lay in new.items():
            if not lay.sliced and created.get(k):
                self._layouts[k] = lay
        if mine:
            parts = self.shard_map.route(mine, {k: arrays[k] for k in mine})
            await self._fan_out(
                {i: self.shards[i].declare(part, rule) for i, part in enumerate(parts) if part}
            )
            self._layouts.update(mine)
        return await self._read_back(list(arrays))

    async def _read_back(self, keys: list[str]) -> dict[str, np.ndarray]:
        """Observer pull after init; waits (bounded) for slices another writer is declaring."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.rpc_timeout_s
        delay = 0.01
        while True:
            try:
                return await self.pull(keys, observer=True)
            except KeyNotFound:
                if loop.time() >= deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    async def push(
        self, grads: Mapping[str, np.ndarray], **options: Unpack[PushOptions]
    ) -> PushAck:
        """Split the gradients like their keys and push to every shard holding a part
        (the keyword arguments of :meth:`WorkerClient.push`).

        With ``base_version`` None each shard uses its own version of the last pull (ASP
        ``max_staleness`` is judged per shard). ``cast`` as in :meth:`WorkerClient.push`
        (gradients are cast to their keys' dtypes before they are split).
        """
        grads = await cast_gradients(self, grads, options.get("cast"))
        arrays = {k: tensor.normalize(v, k) for k, v in grads.items()}
        layouts = await self._resolve(list(arrays))
        if not self._allow_non_finite:
            # The shards apply their parts independently, so every refusal a shard could make
            # is made here first, before any part is sent (shape, dtype and keys in route()).
            for key, array in arrays.items():
                bad = count_non_finite(array)
                if bad:
                    raise NonFiniteGradient(
                        f"gradient for key {key!r} has {bad} non-finite value(s) (NaN or Inf) "
                        f"out of {array.size}; nothing was pushed to any shard"
                    )
        parts = self.shard_map.route(layouts, arrays)
        per_shard: PushOptions = {**options, "cast": False}  # (cast above)
        calls = {i: self.shards[i].push(part, **per_shard) for i, part in enumerate(parts) if part}
        if not calls:
            raise InvalidArgument("a push needs at least one gradient; got none")
        acks = await self._fan_out(calls)
        self._sync_state()
        first = acks[min(acks)]
        return PushAck(
            request_id=first.request_id,
            duplicate=all(a.duplicate for a in acks.values()),
            applied_updates=sum(a.applied_updates for a in acks.values()),
            dropped_stale=any(a.dropped_stale for a in acks.values()),
            live_workers=min(a.live_workers for a in acks.values()),
        )

    async def pull(
        self, keys: Iterable[str] | None = None, **options: Unpack[PullOptions]
    ) -> dict[str, np.ndarray]:
        """Pull from every shard holding a part of ``keys`` (all keys when empty), concurrently,
        and reassemble; each shard waits as its consistency model requires. The keyword
        arguments of :meth:`WorkerClient.pull` (sliced keys are always reassembled into fresh
        arrays)."""
        key_list = list(keys or [])
        layouts = await self._resolve(key_list) if key_list else await self._resolve_all()
        names: list[list[str]] = [[] for _ in self.shards]
        for lay in layouts.values():
            for name, shard in lay.placement(self.shard_map.num_shards).items():
                if not lay.sliced or name != layout_key(lay.key):
                    names[shard].append(name)
        pulled = await self._fan_out(
            {i: self.shards[i].pull(ns, **options) for i, ns in enumerate(names) if ns}
        )
        parts: dict[str, np.ndarray] = {}
        for got in pulled.values():
            parts.update(got)
        self._sync_state()
        return {k: assemble(lay, parts) for k, lay in layouts.items()}

    async def push_pull(
        self,
        grads: Mapping[str, np.ndarray],
        keys: Iterable[str] | None = None,
        **options: Unpack[PushPullOptions],
    ) -> dict[str, np.ndarray]:
        """:meth:`WorkerClient.push_pull`; over several shards a push to every shard holding a
        part, then a pull from them (two fan-outs; ``timeout_s`` is the pull's)."""
        key_list = list(grads) if keys is None else list(keys)
        await self._resolve(key_list)  # an unknown pull key is refused before the push
        await self.push(
            grads,
            num_samples=options.get("num_samples", 1),
            base_version=options.get("base_version"),
            cast=options.get("cast"),
        )
        return await self.pull(
            key_list, timeout_s=options.get("timeout_s"), copy=options.get("copy", True)
        )

    async def clock(self) -> int:
        """End the current iteration on every shard; returns the new (cluster-wide) clock."""
        await self._fan_out({i: c.clock() for i, c in enumerate(self.shards)})
        await self._align_clocks()
        return self.clock_value

    async def status(self) -> pb.StatusResponse:
        """The cluster's status: counters summed over shards, sliced keys shown whole, each
        embedding table once (rows and counters summed, staleness the worst shard's)."""
        statuses = await self.shard_statuses()
        out = pb.StatusResponse()
        out.CopyFrom(statuses[0])
        for field in pb.StatusResponse.DESCRIPTOR.fields:
            if field.is_repeated or field.type not in (
                FieldDescriptor.TYPE_UINT64,
                FieldDescriptor.TYPE_UINT32,
                FieldDescriptor.TYPE_INT64,
            ):
                continue
            values = [getattr(st, field.name) for st in statuses]
            setattr(out, field.name, min(values) if field.name == "bsp_step" else sum(values))
        out.view.CopyFrom(merge_views(st.view for st in statuses))
        layouts = await self._resolve_all()
        updates: dict[str, int] = {}
        dtypes: dict[str, tensor_pb.DType.ValueType] = {}
        rules: dict[str, pb.RuleKind.ValueType] = {}
        for st in statuses:
            for ki in st.keys:
                kind, key, _, _ = parse_name(ki.key)
                if kind == "layout":
                    continue
                updates[key] = min(updates.get(key, ki.updates), ki.updates)
                dtypes[key] = ki.dtype
                rules[key] = ki.rule
        _merge_tables(out, statuses)
        del out.keys[:]
        for key, lay in layouts.items():
            out.keys.append(
                pb.KeyInfo(
                    key=key,
                    dtype=dtypes.get(key, tensor_pb.DTYPE_UNSPECIFIED),
                    shape=list(lay.shape),
                    rule=rules.get(key, pb.RULE_KIND_UNSPECIFIED),
                    updates=updates.get(key, 0),
                )
            )
        return out

    # ------------------------------------------------------------------ embedding tables
    async def init_table(self, spec: TableSpec) -> tuple[bool, TableSpec]:
        """Declare the table on every shard (see :meth:`WorkerClient.init_table`)."""
        return await ShardedTables(self.shards, self._fan_out).init_table(spec)

    async def pull_rows(
        self, table: str, ids: ArrayLike, *, timeout_s: float | None = None, observer: bool = False
    ) -> np.ndarray:
        """Rows of ``ids`` in the caller's order, from their shards concurrently (see
        :meth:`WorkerClient.pull_rows`)."""
        return await ShardedTables(self.shards, self._fan_out).pull_rows(
            table, ids, timeout_s=timeout_s, observer=observer
        )

    async def push_rows(
        self, table: str, ids: ArrayLike, grads: ArrayLike, *, timeout_s: float | None = None
    ) -> RowPushAck:
        """Gradient rows split by shard and pushed concurrently, one request id for all
        shards (see :meth:`WorkerClient.push_rows`)."""
        request_id = self._row_push_ids.take(self.clock_value)
        return await ShardedTables(self.shards, self._fan_out).push_rows(
            table, ids, grads, request_id
        )

    async def push_pull_rows(
        self,
        table: str,
        push_ids: ArrayLike,
        grads: ArrayLike,
        pull_ids: ArrayLike,
        *,
        timeout_s: float | None = None,
    ) -> np.ndarray:
        """Gradient rows pushed, then rows pulled, one call per shard, all shards
        concurrently, one request id for all shards; rows in ``pull_ids``' order (see
        :meth:`WorkerClient.push_pull_rows`)."""
        request_id = self._row_push_ids.take(self.clock_value)
        return await ShardedTables(self.shards, self._fan_out).push_pull_rows(
            table, push_ids, grads, pull_ids, request_id, timeout_s
        )

    async def pull_rows_many(
        self, ids: TableIds, **options: Unpack[PullRowsManyOptions]
    ) -> dict[str, np.ndarray]:
        """Rows of several tables, one request per shard, all shards concurrently (see
        :meth:`WorkerClient.pull_rows_many`; ``cache_counts`` go to one shard)."""
        return await ShardedTables(self.shards, self._fan_out).pull_rows_many(ids, **options)

    async def pull_rows_validated(
        self,
        ids: Mapping[str, npt.NDArray[np.int64]],
        held: Mapping[str, npt.NDArray[np.int64]],
        **options: Unpack[ValidatedPullOptions],
    ) -> dict[str, ValidatedRows]:
        """Version-validated rows of several tables, one request per shard, all shards
        concurrently (see :meth:`WorkerClient.pull_rows_validated`; ``cache_counts`` go to
        one shard)."""
        return await ShardedTables(self.shards, self._fan_out).pull_rows_validated(
            ids, held, **options
        )

    async def push_rows_many(
        self, ids: TableIds, grads: Mapping[str, ArrayLike], *, timeout_s: float | None = None
    ) -> dict[str, RowPushAck]:
        """Gradient rows of several tables, one request per shard (each all or nothing on
        its shard), the same request ids on every shard (see
        :meth:`WorkerClient.push_rows_many`)."""
        tables = len(ids.keys) if isinstance(ids, KeyedIds) else len(ids)
        request_id = self._row_push_ids.take(self.clock_value, max(1, tables))
        return await ShardedTables(self.shards, self._fan_out).push_rows_many(
            ids, grads, request_id
        )

    async def shard_statuses(self) -> list[pb.StatusResponse]:
        """Every shard's own status, in shard order."""
        got = await self._fan_out({i: c.status() for i, c in enumerate(self.shards)})
        return [got[i] for i in range(len(self.shards))]

    async def progress(self, worker_name: str | None = None) -> WorkerProgress:
        """:meth:`WorkerClient.progress` over the shards: the fewest iterations any shard
        counted (an iteration every shard saw end)."""
        return progress_of(await self.shard_statuses(), worker_name or self.worker_name)

    async def wait_for_workers(self, n: int, *, timeout_s: float = 60.0) -> int:
        """The start barrier over the cluster (see :meth:`WorkerClient.wait_for_workers`)."""
        others = len(self.shards) - 1
        where = f"{self.shards[0].address} and {others} other shard{'s' if others > 1 else ''}"
        return await await_workers(self, n, timeout_s, where=where)


def _merge_tables(out: pb.StatusResponse, statuses: Sequence[pb.StatusResponse]) -> None:
    """One ``TableInfo`` per table in ``out``: counters summed over the shards, staleness the
    largest (max) and the push-weighted mean."""
    merged: dict[str, tpb.TableInfo] = {}
    weights: dict[str, float] = {}
    for st in statuses:
        for info in st.tables:
            name = info.spec.name
            have = merged.get(name)
            if have is None:
                have = merged[name] = type(info)()
                have.CopyFrom(info)
                weights[name] = info.staleness_mean * info.pushes
                continue
            for f in ("rows", "pushes", "rows_pushed", "pulls", "rows_pulled", "filtered",
                      "expired", "queued_pushes", "size_bytes", "state_size_bytes",
                      "rows_pulled_per_s", "rows_pushed_per_s", "cache_rows_requested",
                      "cache_rows_hit"):  # fmt: skip
                setattr(have, f, getattr(have, f) + getattr(info, f))
            have.staleness_max = max(have.staleness_max, info.staleness_max)
            weights[name] += info.staleness_mean * info.pushes
    del out.tables[:]
    for name, info in merged.items():
        info.staleness_mean = weights[name] / info.pushes if info.pushes else 0.0
        info.bytes_per_row = info.size_bytes / info.rows if info.rows else 0.0
        out.tables.append(info)
