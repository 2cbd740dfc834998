"""A shard's embedding tables with their per-table consistency (pure, synchronous).

Each table declares ``asp``, ``ssp(s)`` or ``bsp`` at init, independent of the server's dense
keys (PERSIA's hybrid, Lian et al. 2022: sparse asynchronous within a bound, dense synchronous).
Clocks and membership are the shard's (:class:`~paramserver.core.consistency.ClusterState`);
a table only brings its own bound:

* **asp**: pulls never wait; a push is applied on arrival.
* **ssp(s)**: a pull by worker p waits until ``min_q c_q >= c_p - s``; pushes apply on arrival.
* **bsp**: a pull waits until ``min_q c_q >= c_p``; the row pushes of clock t are queued, summed
  per id over the step and divided by the number of live workers (a mean over workers, as the
  dense BSP ``mean``; the live count, not the count of workers that pushed rows to this shard,
  so the result does not depend on how ids spread over shards), then applied once when every
  live worker has clocked past t (:meth:`TableSet.close_steps`, called whenever the minimum
  clock may have advanced).

A push is decided in two steps so that the caller can log it in between: :meth:`TableSet.prepare`
validates everything and changes nothing; :meth:`TableSet.commit` applies (or queues) it and
cannot fail. Retried pushes (same registration and request id) are answered as duplicates.
A push of no ids is validated like any other and then acknowledged without effect: nothing
applied, queued or remembered, every count 0.

A float16/bfloat16 table refuses a push whose result would overflow its dtype, as dense keys
do: asp/ssp pushes in :meth:`TableSet.prepare` (ValueOutOfRange, before the push is logged;
nothing applied); a closing bsp step whose mean would overflow is not applied to that table
(its rows and state keep their values for the step; counted in
:attr:`TableStats.out_of_range_steps` and logged), since its pushes were acknowledged when
queued and there is no caller left to refuse.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, NotRequired, TypedDict

import numpy as np
import numpy.typing as npt

from paramserver.core.consistency import Admission, ClusterState
from paramserver.core.dedup import DedupKind, DedupWindows
from paramserver.core.optimizers import HALF_DTYPES
from paramserver.core.tables import (
    EmbeddingTable,
    PushRowsResult,
    TableLimits,
    TableSpec,
    coalesce,
)
from paramserver.errors import (
    CapacityExceeded,
    InvalidArgument,
    StaleUpdate,
    TableConflict,
    TableNotFound,
    ValueOutOfRange,
)
from paramserver.protocol.limits import shown
from paramserver.protocol.table_spec import TableSpecDict

logger = logging.getLogger(__name__)

__all__ = [
    "PreparedRowPush",
    "RowPushOutcome",
    "TableManifestEntry",
    "TableSet",
    "TableStats",
    "TablesManifest",
]

#: The dedup kind of row pushes (:class:`~paramserver.core.dedup.DedupWindows`).
ROW_PUSH: Final[DedupKind[RowPushOutcome]] = DedupKind("push_rows")


class TableManifestEntry(TypedDict):
    """One table in a :meth:`TableSet.state` manifest (JSON)."""

    #: :meth:`TableSpec.to_dict`.
    spec: TableSpecDict
    #: The table's counters by name (``pushes``, ``rows_pushed``, ...); none in an export's.
    counters: NotRequired[dict[str, int]]
    newest_clock: int
    #: Each queued bsp push: ``[step, worker name, i, j, unix seconds]``; its ids and grads
    #: are the arrays ``table/<name>/queued/<i>/<j>/ids`` and ``.../grads``.
    queued: list[list[int | str | float]]


class TablesManifest(TypedDict):
    """The JSON half of :meth:`TableSet.state`: every table, and the row-push deduplication
    window (per registration, ``[request id, queued]`` pairs)."""

    tables: dict[str, TableManifestEntry]
    dedup: dict[str, list[list[int]]]


@dataclass(frozen=True)
class RowPushOutcome:
    """What a row push did (the reply).

    Attributes:
        duplicate: The request id was seen before; nothing was applied again.
        queued: bsp: the push waits for its step to close.
        result: Counts of the applied push (zeros when duplicate or queued).
        staleness: Clocks between the newest clock applied to the table and the push's clock.
    """

    duplicate: bool
    queued: bool = False
    result: PushRowsResult = field(default_factory=lambda: PushRowsResult(0, 0, 0, 0))
    staleness: int = 0


@dataclass
class PreparedRowPush:
    """A validated row push, not yet applied (see :meth:`TableSet.prepare`)."""

    table: EmbeddingTable
    worker_name: str  # the registration's worker id (request ids are scoped to it)
    request_id: int
    clock: int
    ids: npt.NDArray[np.int64]
    grads: np.ndarray
    duplicate: RowPushOutcome | None = None
    #: The distinct ids and their summed float32 gradients, when :meth:`TableSet.prepare`
    #: already coalesced them (its range check of a half-precision table), for the apply.
    coalesced: tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]] | None = None


@dataclass
class TableStats:
    """Per-table staleness and BSP counters (metrics, status)."""

    newest_clock: int = -1
    staleness_max: int = 0
    staleness_sum: int = 0
    applied_pushes: int = 0
    duplicate_pushes: int = 0
    #: bsp steps not applied because their result would overflow the table's dtype.
    out_of_range_steps: int = 0
    #: bsp: clock -> queued pushes (worker id, ids, float32 grads, server seconds).
    queued: dict[int, list[tuple[str, npt.NDArray[np.int64], np.ndarray, float]]] = field(
        default_factory=dict
    )

    def queued_pushes(self) -> int:
        return sum(len(v) for v in self.queued.values())


class TableSet:
    """The embedding tables of one shard.

    Args:
        limits: Per-request bounds applied to every table.
        dedup: The shard's request-id windows (kind ``"push_rows"``), shared with its dense
            pushes so a resumed or replacing registration carries both over (default: own).
    """

    def __init__(
        self, limits: TableLimits | None = None, dedup: DedupWindows | None = None
    ) -> None:
        self.limits = limits or TableLimits()
        self.tables: dict[str, EmbeddingTable] = {}
        self.stats: dict[str, TableStats] = {}
        self.dedup = dedup if dedup is not None else DedupWindows((ROW_PUSH,))

    # ------------------------------------------------------------------ declaration
    def init(
        self, spec: TableSpec, *, log: Callable[[], None] | None = None
    ) -> tuple[bool, TableSpec]:
        """Declare a table; first writer wins.

        The table is built (its first storage allocated) and checked against the limits
        before ``log`` is called, so a logged declaration always replays; ``log`` is not
        called for a no-op.

        Returns:
            (created, the stored spec). A later declaration of the same name with the same
            spec is a no-op.

        Raises:
            TableConflict: the name is declared with a different spec; names both
                (ALREADY_EXISTS).
            CapacityExceeded: the shard holds ``limits.max_tables`` tables already, or the
                table's first storage would pass ``limits.memory_bytes`` or cannot be
                allocated (RESOURCE_EXHAUSTED).
        """
        have = self.tables.get(spec.name)
        if have is not None:
            if have.spec != spec:
                raise TableConflict(
                    f"table {shown(spec.name)!r} exists with a different declaration "
                    f"({have.spec.to_dict()}); got {spec.to_dict()}"
                )
            return False, have.spec
        if len(self.tables) >= self.limits.max_tables:
            raise CapacityExceeded(
                f"table {shown(spec.name)!r}: this shard holds {len(self.tables)} tables, its "
                f"limit (--table-max-tables {self.limits.max_tables})"
            )
        try:
            table = EmbeddingTable(spec, self.limits)
        except MemoryError:
            raise CapacityExceeded(
                f"table {shown(spec.name)!r}: the shard could not allocate its first rows "
                f"(dim {spec.dim}, {spec.dtype}, rule {spec.rule.kind})"
            ) from None
        if log is not None:
            log()
        self.tables[spec.name] = table
        self.stats[spec.name] = TableStats()
        return True, spec

    def memory_used(self) -> int:
        """Bytes of every table's stored rows and state (what ``limits.memory_bytes`` bounds)."""
        return sum(t.n * t.row_bytes for t in self.tables.values())

    def _check_push_budget(self, table: EmbeddingTable, ids: npt.NDArray[np.int64]) -> None:
        """Refuse a push whose new rows would pass ``limits.memory_bytes`` (changes nothing;
        counts the new ids only when the push could pass it at all)."""
        budget = self.limits.memory_bytes
        if budget <= 0:
            return
        used = self.memory_used()
        row_bytes = table.row_bytes
        if used + ids.shape[0] * row_bytes <= budget:
            return
        distinct = np.unique(ids)
        more_bytes = int((table.index.lookup(distinct) < 0).sum()) * row_bytes
        if used + more_bytes > budget:
            name = table.spec.name
            raise CapacityExceeded(
                f"table {shown(name)!r}: {more_bytes} bytes of new rows and state would pass "
                f"the shard's table memory budget ({used} of {budget} bytes used; "
                "--table-memory-bytes)"
            )

    def get(self, name: str) -> EmbeddingTable:
        """The table ``name``.

        Raises:
            TableNotFound: no such table on this shard (NOT_FOUND).
        """
        table = self.tables.get(name)
        if table is None:
            raise TableNotFound(f"table {name!r} is not declared on this shard (InitTable first)")
        return table

    # ------------------------------------------------------------------ pulls
    def check_pull(self, cluster: ClusterState, worker_id: str, name: str) -> Admission:
        """Whether a row pull by ``worker_id`` may read ``name`` now (its own bound).

        Raises:
            TableNotFound (NOT_FOUND), WorkerNotFound (FAILED_PRECONDITION).
        """
        spec = self.get(name).spec
        return cluster.admit_read(
            worker_id,
            asynchronous=spec.consistency == "asp",
            staleness=spec.staleness,
            describe=lambda rec, need: (
                f"row pull of table {name!r} by {rec.name!r} at clock {rec.clock} "
                f"({spec.consistency}, staleness {spec.staleness}) waits for clock >= {need}"
            ),
        )

    # ------------------------------------------------------------------ pushes
    def prepare(
        self,
        cluster: ClusterState,
        worker_id: str,
        request_id: int,
        clock: int,
        name: str,
        ids: np.ndarray,
        grads: np.ndarray,
    ) -> PreparedRowPush:
        """Validate a row push completely; changes nothing.

        Raises:
            TableNotFound: unknown table (NOT_FOUND).
            WorkerNotFound: unknown or evicted worker (FAILED_PRECONDITION).
            InvalidArgument: bad ids or gradient rows, naming the table (INVALID_ARGUMENT).
            ValueOutOfRange: asp/ssp float16/bfloat16 table: the push's result would overflow
                the table's dtype, naming the table, the id and the column (INVALID_ARGUMENT,
                :meth:`EmbeddingTable.check_range`).
            StaleUpdate: bsp push for a step that already closed, or a clock ahead of the
                worker's (FAILED_PRECONDITION).
        """
        table = self.get(name)
        rec = cluster.require_live(worker_id)
        prior = self.dedup.get(ROW_PUSH, rec.worker_id, request_id)  # scoped to a registration
        if prior is not None:
            return PreparedRowPush(
                table, rec.worker_id, request_id, clock, ids, grads, duplicate=prior
            )
        checked = table.check_push(ids, grads)
        self._check_push_budget(table, checked)
        if clock > rec.clock:
            raise StaleUpdate(
                f"row push to table {name!r} for clock {clock}, but worker {rec.name!r} is at "
                f"clock {rec.clock}"
            )
        if table.spec.consistency == "bsp" and clock < cluster.min_clock():
            raise StaleUpdate(
                f"row push to bsp table {name!r} for clock {clock}: that step closed "
                f"(min clock {cluster.min_clock()})"
            )
        coalesced = None
        if table.spec.consistency != "bsp" and table.spec.np_dtype in HALF_DTYPES:
            coalesced = coalesce(checked, grads)
            table.check_range(*coalesced)
        if table.spec.consistency != "bsp":
            try:  # room for every row the push may create, before it is logged
                table.reserve(int(checked.shape[0]))
            except MemoryError:
                raise CapacityExceeded(
                    f"table {shown(name)!r}: the shard could not allocate room for "
                    f"{checked.shape[0]} new rows"
                ) from None
        return PreparedRowPush(
            table, rec.worker_id, request_id, clock, checked, grads, coalesced=coalesced
        )

    def commit(self, push: PreparedRowPush, *, now_s: float) -> RowPushOutcome:
        """Apply (asp/ssp) or queue (bsp) a prepared push; never fails.

        A queued bsp push answers its count of distinct ids (``applied`` and ``filtered`` stay
        0: they are known when the step closes). A push of no ids changes nothing.
        """
        name = push.table.spec.name
        stats = self.stats[name]
        if push.duplicate is not None:
            stats.duplicate_pushes += 1
            return RowPushOutcome(True, push.duplicate.queued, push.duplicate.result)
        if push.ids.shape[0] == 0:
            return RowPushOutcome(False)
        if push.table.spec.consistency == "bsp":
            grads = np.array(push.grads, dtype=np.float32)  # own copy: buffers are not kept
            stats.queued.setdefault(push.clock, []).append(
                (push.worker_name, push.ids.copy(), grads, now_s)
            )
            distinct = int(np.unique(push.ids).shape[0])
            outcome = RowPushOutcome(False, queued=True, result=PushRowsResult(distinct, 0, 0, 0))
        else:
            if push.coalesced is None:
                result = push.table.push(push.ids, push.grads, now_s=now_s, clock=push.clock)
            else:
                result = push.table.apply_coalesced(*push.coalesced, now_s=now_s, clock=push.clock)
            outcome = RowPushOutcome(
                False, result=result, staleness=self._staleness(name, push.clock)
            )
        self.dedup.remember(ROW_PUSH, push.worker_name, push.request_id, outcome)
        return outcome

    def _staleness(self, name: str, clock: int) -> int:
        stats = self.stats[name]
        stats.newest_clock = max(stats.newest_clock, clock)
        stale = stats.newest_clock - clock
        stats.staleness_max = max(stats.staleness_max, stale)
        stats.staleness_sum += stale
        stats.applied_pushes += 1
        return stale

    def reassign_unclocked(self, worker_id: str, clock: int, to: str | None) -> int:
        """The bsp row pushes ``worker_id`` queued at steps >= ``clock`` (pushed, never
        clocked): taken over by registration ``to`` (a successor that continues the worker's
        clock and request ids, whose re-push is a duplicate), or dropped with ``to=None`` (the
        worker left the live set mid-step: its unfinished contribution leaves the step, as a
        dense gradient's does). Returns the pushes moved or dropped."""
        changed = 0
        for stats in self.stats.values():
            for step in [t for t in stats.queued if t >= clock]:
                pushes = stats.queued[step]
                mine = [p for p in pushes if p[0] == worker_id]
                if not mine:
                    continue
                changed += len(mine)
                if to is None:
                    kept = [p for p in pushes if p[0] != worker_id]
                else:
                    kept = [(to, *p[1:]) if p[0] == worker_id else p for p in pushes]
                if kept:
                    stats.queued[step] = kept
                else:
                    del stats.queued[step]
        return changed

    def close_steps(self, min_clock: int, live_workers: int) -> int:
        """Apply every queued bsp step t < ``min_clock``, in step order; returns steps closed.

        A step's pushes are summed per id and divided by ``live_workers`` (at least the number
        of distinct workers that pushed in the step), then applied as one push, stamped with
        the latest server time of its pushes (expiry). The shard's core calls this whenever
        its minimum clock may have advanced (clock, leave, eviction), so the divisor is the
        live count at that moment, on replay too. A step whose result would overflow a
        float16/bfloat16 table's dtype is not applied to that table (counted in
        :attr:`TableStats.out_of_range_steps`, logged); the others go on.
        """
        closed = 0
        for name, stats in self.stats.items():
            if not stats.queued:
                continue
            table = self.tables[name]
            for step in sorted(t for t in stats.queued if t < min_clock):
                pushes = stats.queued.pop(step)
                workers = max(live_workers, len({p[0] for p in pushes}), 1)
                now_s = max(p[3] for p in pushes)
                ids = np.concatenate([p[1] for p in pushes])
                grads = np.concatenate([p[2] for p in pushes])
                uniq, summed = coalesce(ids, grads)
                summed /= np.float32(workers)
                closed += 1
                try:
                    table.check_range(uniq, summed)
                except ValueOutOfRange as refusal:
                    stats.out_of_range_steps += 1
                    logger.warning("bsp step %d not applied: %s", step, refusal.message)
                    continue
                table.apply_coalesced(uniq, summed, now_s=now_s, clock=step)
                for _ in pushes:
                    self._staleness(name, step)
        return closed

    # ------------------------------------------------------------------ memory policy
    def expire(self, *, now_s: float, clock: int) -> int:
        """Run every table's expiry sweep; returns rows dropped."""
        return sum(t.expire(now_s=now_s, clock=clock) for t in self.tables.values())

    # ------------------------------------------------------------------ durability
    def state(self) -> tuple[dict[str, np.ndarray], TablesManifest]:
        """Arrays (``table/<name>/<field>``) and a JSON-able manifest of every table, its
        queued bsp pushes and the row-push deduplication window."""
        arrays: dict[str, np.ndarray] = {}
        manifest: TablesManifest = {"tables": {}, "dedup": {}}
        for name, table in self.tables.items():
            for f, arr in table.state_arrays().items():
                arrays[f"table/{name}/{f}"] = arr
            stats = self.stats[name]
            queued: list[list[int | str | float]] = []
            for i, (step, pushes) in enumerate(sorted(stats.queued.items())):
                for j, (worker, ids, grads, now_s) in enumerate(pushes):
                    arrays[f"table/{name}/queued/{i}/{j}/ids"] = ids
                    arrays[f"table/{name}/queued/{i}/{j}/grads"] = grads
                    queued.append([step, worker, i, j, now_s])
            manifest["tables"][name] = {
                "spec": table.spec.to_dict(),
                "counters": {
                    k: getattr(table, k)
                    for k in (
                        "pushes",
                        "rows_pushed",
                        "pulls",
                        "rows_pulled",
                        "filtered",
                        "expired",
                    )
                },
                "newest_clock": stats.newest_clock,
                "queued": queued,
            }
        manifest["dedup"] = {
            w: [[rid, o.queued] for rid, o in seen.items()]
            for w, seen in self.dedup.of(ROW_PUSH).items()
        }
        return arrays, manifest

    def restore(self, arrays: dict[str, np.ndarray], manifest: TablesManifest) -> None:
        """Replace every table by :meth:`state` output (bit-exact rows and state)."""
        self.tables.clear()
        self.stats.clear()
        for name, entry in manifest.get("tables", {}).items():
            spec = TableSpec.from_dict(entry["spec"])
            self.init(spec)
            prefix = f"table/{name}/"
            fields = {
                k[len(prefix) :]: v
                for k, v in arrays.items()
                if k.startswith(prefix) and "/" not in k[len(prefix) :]
            }
            table = self.tables[name]
            table.load_state_arrays(fields)
            for k, v in entry.get("counters", {}).items():
                setattr(table, k, int(v))
            stats = self.stats[name]
            stats.newest_clock = int(entry.get("newest_clock", -1))
            for step, worker, i, j, now_s in entry.get("queued", []):
                stats.queued.setdefault(int(step), []).append(
                    (
                        str(worker),
                        arrays[f"{prefix}queued/{i}/{j}/ids"],
                        arrays[f"{prefix}queued/{i}/{j}/grads"],
                        float(now_s),
                    )
                )
        self.dedup.restore(
            ROW_PUSH,
            {
                w: OrderedDict((int(rid), RowPushOutcome(True, queued=bool(q))) for rid, q in seen)
                for w, seen in manifest.get("dedup", {}).items()
            },
        )


# ------------------------------------------------------------------------------ reshard
def merge_table_states(
    parts: list[tuple[dict[str, np.ndarray], TablesManifest]],
) -> tuple[dict[str, np.ndarray], TablesManifest]:
    """Merge the :meth:`TableSet.state` of every shard of a cluster into one (resharding).

    Every id lives on exactly one shard, so the rows (and the frequency filter's counts) are a
    disjoint union, sorted by id. Counters are summed; queued bsp steps and deduplication
    windows are not carried (workers of the new cluster register afresh and redo the open
    step, as for dense keys).

    Raises:
        InvalidArgument: the shards disagree on a table's declaration.
    """
    specs: dict[str, TableSpecDict] = {}
    counters: dict[str, dict[str, int]] = {}
    fields: dict[str, dict[str, list[np.ndarray]]] = {}
    for arrays, manifest in parts:
        for name, entry in manifest.get("tables", {}).items():
            if name in specs and specs[name] != entry["spec"]:
                raise InvalidArgument(f"table {name!r}: shards disagree on its declaration")
            specs[name] = entry["spec"]
            total = counters.setdefault(name, {})
            for k, v in entry.get("counters", {}).items():
                total[k] = total.get(k, 0) + int(v)
            prefix = f"table/{name}/"
            per = fields.setdefault(name, {})
            for key, arr in arrays.items():
                rest = key[len(prefix) :]
                if key.startswith(prefix) and "/" not in rest:
                    per.setdefault(rest, []).append(arr)
    out_arrays: dict[str, np.ndarray] = {}
    out_manifest: TablesManifest = {"tables": {}, "dedup": {}}
    for name, per in fields.items():
        merged = {k: np.concatenate(v) for k, v in per.items()}
        order = np.argsort(merged["ids"], kind="stable")
        p_order = np.argsort(merged["pending_ids"], kind="stable")
        for k, column in merged.items():
            out_arrays[f"table/{name}/{k}"] = column[p_order if k.startswith("pending_") else order]
        out_manifest["tables"][name] = {
            "spec": specs[name],
            "counters": counters[name],
            "newest_clock": -1,
            "queued": [],
        }
    return out_arrays, out_manifest


def split_table_states(
    arrays: dict[str, np.ndarray], manifest: TablesManifest, num_shards: int
) -> list[tuple[dict[str, np.ndarray], TablesManifest]]:
    """Place merged table state on ``num_shards`` shards by ``hash64(table, id) mod S``."""
    from paramserver.core.tables import shard_of_ids

    out: list[tuple[dict[str, np.ndarray], TablesManifest]] = [
        ({}, {"tables": {}, "dedup": {}}) for _ in range(num_shards)
    ]
    for name, entry in manifest.get("tables", {}).items():
        prefix = f"table/{name}/"
        rows_shard = shard_of_ids(name, arrays[prefix + "ids"], num_shards)
        pend_shard = shard_of_ids(name, arrays[prefix + "pending_ids"], num_shards)
        for s in range(num_shards):
            a, m = out[s]
            for key, arr in arrays.items():
                if key.startswith(prefix) and "/" not in key[len(prefix) :]:
                    sel = pend_shard if key[len(prefix) :].startswith("pending_") else rows_shard
                    a[key] = arr[sel == s]
            m["tables"][name] = {**entry, "queued": []}
    return out
