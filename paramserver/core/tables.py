"""Sparse embedding tables: int64 id -> row of ``dim`` elements (pure, synchronous).

The workload parameter servers exist for (ps-lite, Bösen, Angel, PERSIA, Monolith, TF
ParameterServerStrategy's sharded embeddings): a table too large for any worker, of which a
batch touches a few thousand rows. See ``docs/embedding-tables.md`` for the user-facing
reference; this module is the shard's state for it, with time passed in.

* **Lazy rows.** The initial row of id ``i`` is a pure function of ``(seed, i)``
  (:func:`paramserver.core.row_store.initial_rows`), so every shard count, restart and reshard
  gives the same row. A pull of an id with no stored row returns that initial row without
  storing it (unobservable except in memory); the first admitted push stores it.
* **Rows ops, compiled.** :meth:`EmbeddingTable.pull` keeps the caller's order and allows
  duplicates; :meth:`EmbeddingTable.push` sums duplicate ids first (as torch coalesces sparse
  gradients), then applies the row-wise rule once per distinct id. Rows not in a push never
  change, bit for bit. Every per-id step (index, initial rows, gather, coalesce, rule, scatter)
  is one loop of a kernel in :mod:`paramserver.core.row_kernels` (numba, GIL released).
* **Rules** (:class:`TableRule`, one entry each of
  :data:`paramserver.core.row_rules.ROW_RULES`): ``sgd``, ``adagrad``, ``rowwise_adagrad`` and
  lazy ``adam``; the step count of adam is per row, so a row's update does not depend on how
  rows are spread over shards. Optimizer state is float32 whatever the storage dtype.
* **Memory policy** (after Monolith, Liu et al. 2022): optional expiry of stored rows not pushed
  for ``expiry_clocks`` clocks or ``expiry_s`` seconds (:meth:`EmbeddingTable.expire`), and a
  frequency filter: an id gets a stored row only at its ``min_pushes``-th push; earlier pushes
  are dropped and counted, and pulls return its initial row.

Storage (:mod:`paramserver.core.row_store`): each per-row field (the rows; the rule's state; the
row's version; the last push's clock and time, kept only by a table with expiry) is a chunked
:class:`RowArena`, and the id -> row index is an open-addressing :class:`IdIndex`.

* **Row versions** (HET's per-embedding clocks: Miao et al., "HET: Scaling out Huge Embedding
  Model Training via Cache-enabled Distributed Framework", VLDB 2022). A stored row's version
  counts the pushes applied to it since it was stored (+1 per applied push that holds its id,
  a closed bsp step counting once); an id with no stored row has version 0 (its row is its
  initial row). Versions are per-row state: checkpointed and moved by reshards with the rows,
  and rebuilt exactly by replaying the WAL's pushes. They are comparable only within one
  :attr:`EmbeddingTable.version_epoch`, a random nonzero 63-bit value drawn when the table is
  created or loaded in a process and redrawn when an expiry sweep drops rows (a dropped row
  re-created later starts again at version 0). A worker-side row cache sends the versions it
  holds and gets back only rows that changed more than its bound allows.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from paramserver.core.row_rules import ROW_RULES
from paramserver.core.row_store import (
    IdIndex,
    RowArena,
    coalesce,
    coalesce_first,
    ids64,
    initial_rows,
    kernels,
    seed_key,
    split_rows,
)
from paramserver.core.storage_range import HALF_DTYPES, overflow_mask, range_refusal
from paramserver.errors import (
    DimensionMismatch,
    DTypeMismatch,
    InvalidArgument,
    NonFiniteGradient,
)
from paramserver.protocol.table_spec import (
    CONSISTENCIES,
    F32,
    INITIALIZERS,
    TABLE_DTYPES,
    TABLE_RULE_KINDS,
    Initializer,
    TableRule,
    TableSpec,
    shard_of_ids,
    splitmix64,
    table_hash,
)

__all__ = [
    "CONSISTENCIES",
    "INITIALIZERS",
    "TABLE_DTYPES",
    "TABLE_RULE_KINDS",
    "EmbeddingTable",
    "IdIndex",
    "Initializer",
    "PushRowsResult",
    "RowArena",
    "TableLimits",
    "TableRule",
    "TableSpec",
    "coalesce",
    "initial_rows",
    "shard_of_ids",
    "splitmix64",
    "table_hash",
]


@dataclass(frozen=True)
class TableLimits:
    """Per-request bounds of row operations (the server's; refusals are INVALID_ARGUMENT).

    Attributes:
        max_ids: Most ids one pull or push may carry (default 1,048,576).
        max_bytes: Most bytes of rows one pull reply or push request may carry (default 256 MiB).
        max_tables: Most tables one shard holds (default 1,024; over it: CapacityExceeded).
        memory_bytes: Budget of the shard's stored rows and optimizer state over all tables
            (:meth:`EmbeddingTable.stored_bytes`); a declaration or push that would pass it is
            refused with CapacityExceeded (RESOURCE_EXHAUSTED). 0: no budget.
    """

    max_ids: int = 1 << 20
    max_bytes: int = 256 << 20
    max_tables: int = 1024
    memory_bytes: int = 0


@dataclass(frozen=True)
class PushRowsResult:
    """What one push of rows did.

    Attributes:
        distinct: Distinct ids in the push.
        applied: Rows the rule was applied to.
        filtered: Distinct ids whose push the frequency filter dropped.
        created: Rows stored for the first time by this push.
    """

    distinct: int
    applied: int
    filtered: int
    created: int


#: Bytes of rows one chunk of a table's row arena aims at (the rows per chunk are a power of
#: two between 2**10 and 2**16).
CHUNK_TARGET_BYTES: Final = 8 << 20

_BOOKKEEPING: Final = ("last_clock", "last_s")
#: The per-row field of the row versions (kept by every table; not optimizer state).
_VERSION: Final = "version"


def new_version_epoch() -> int:
    """A random nonzero 63-bit version epoch (0 means "none" on the wire)."""
    return secrets.randbits(63) + 1


class EmbeddingTable:
    """One table's stored rows, optimizer state and memory-policy bookkeeping.

    Not thread-safe: one owner (the shard's event loop). ``pull``/``push`` expect ids and
    gradients already validated by :meth:`check_ids` / :meth:`check_push` and, for a push,
    :meth:`check_range` (which change nothing).

    Args:
        spec: The table's declaration.
        limits: Per-request bounds.
    """

    def __init__(self, spec: TableSpec, limits: TableLimits | None = None) -> None:
        self.spec = spec
        self.limits = limits or TableLimits()
        self.index = IdIndex()
        self.n = 0  # stored rows: rows [0, n) of every field are in use
        row_bytes = max(1, spec.dim * spec.np_dtype.itemsize)
        self._shift = min(16, max(10, (CHUNK_TARGET_BYTES // row_bytes).bit_length() - 1))
        self._store: dict[str, RowArena] = {}
        self._new_store()
        self._seed_key = seed_key(spec.seed)
        init = spec.initializer
        k = kernels()
        if init.kind == "zeros" or init.scale == 0.0:
            self._init_code = k.INIT_ZEROS
        elif init.kind == "uniform":
            self._init_code = k.INIT_UNIFORM
        else:
            self._init_code = k.INIT_OTHER
        # Frequency filter: pushes seen per id that has no stored row yet (0 once admitted).
        self._pending = IdIndex()
        self._pending_counts = np.zeros(0, np.int64)
        self._pending_n = 0
        #: Counters (metrics, status).
        self.pushes = 0
        self.rows_pushed = 0
        self.pulls = 0
        self.rows_pulled = 0
        self.filtered = 0
        self.expired = 0
        #: The epoch the row versions belong to (see the module docstring).
        self.version_epoch = new_version_epoch()

    # ------------------------------------------------------------------ storage
    def _fields(self) -> dict[str, tuple[tuple[int, ...], np.dtype[np.generic], float]]:
        """Every per-row field a checkpoint holds: (shape, dtype, new-row value)."""
        s, d = self.spec, self.spec.dim
        out: dict[str, tuple[tuple[int, ...], np.dtype[np.generic], float]] = {
            "rows": ((d,), s.np_dtype, 0.0),
            _VERSION: ((), np.dtype(np.int64), 0.0),
            "last_clock": ((), np.dtype(np.int64), 0.0),
            "last_s": ((), np.dtype(np.float64), 0.0),
        }
        out.update(ROW_RULES[s.rule.kind].state(s.rule, d))
        return out

    @property
    def tracks_pushes(self) -> bool:
        """Whether rows keep their last push's clock and time (only a table with expiry)."""
        return bool(self.spec.expiry_clocks or self.spec.expiry_s)

    def _stored_fields(self) -> dict[str, tuple[tuple[int, ...], np.dtype[np.generic], float]]:
        fields = self._fields()
        if not self.tracks_pushes:
            for name in _BOOKKEEPING:
                del fields[name]
        return fields

    def _new_store(self) -> None:
        self._store = {
            name: RowArena(shape, dtype, self._shift, fill)
            for name, (shape, dtype, fill) in self._stored_fields().items()
        }

    def _reserve_rows(self, n: int) -> None:
        for arena in self._store.values():
            arena.reserve(n)

    def reserve(self, extra: int) -> None:
        """Allocate room for ``extra`` more rows now (index slots and row chunks), so a push
        validated after this cannot fail for memory while it applies.

        Raises:
            MemoryError: the process could not allocate it (nothing of the table changed).
        """
        self.index.reserve(extra)
        self._reserve_rows(self.n + extra)

    @property
    def row_bytes(self) -> int:
        """Bytes one stored row takes with its optimizer state and bookkeeping."""
        return sum(a.row_bytes for a in self._store.values())

    def state_bytes(self) -> int:
        """Bytes of the stored rows' optimizer state (adagrad's accumulators, adam's moments
        and step counts; 0 for sgd)."""
        return self.n * sum(
            a.row_bytes
            for name, a in self._store.items()
            if name not in ("rows", _VERSION, *_BOOKKEEPING)
        )

    def stored_bytes(self) -> int:
        """Bytes the table holds: its stored rows, their optimizer state and bookkeeping, and
        the id index (and the frequency filter's counts)."""
        pending = self._pending.nbytes + int(self._pending_counts.nbytes) if self._pending_n else 0
        return self.n * self.row_bytes + self.index.nbytes + pending

    @property
    def rows(self) -> np.ndarray:
        """A copy of the stored rows, (n, dim) of the storage dtype, in row order."""
        return self._store["rows"].gather(np.arange(self.n, dtype=np.int64))

    # ------------------------------------------------------------------ validation
    def _where(self) -> str:
        return f"table {self.spec.name!r}"

    def check_ids(self, ids: np.ndarray) -> npt.NDArray[np.int64]:
        """Validate ids (changes nothing).

        Args:
            ids: (n,) integer array.

        Returns:
            The ids as native int64 (n,).

        Raises:
            InvalidArgument: not 1-D integers, a negative or out-of-range id, or more ids than
                :attr:`TableLimits.max_ids` (INVALID_ARGUMENT, naming the table).
        """
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise InvalidArgument(
                f"{self._where()}: ids must be a 1-D integer array, got {ids.dtype} "
                f"shape {tuple(ids.shape)}"
            )
        n = ids.shape[0]
        if n > self.limits.max_ids:
            raise InvalidArgument(
                f"{self._where()}: {n} ids in one request exceed the server's limit of "
                f"{self.limits.max_ids}"
            )
        nbytes = n * self.spec.dim * self.spec.np_dtype.itemsize
        if nbytes > self.limits.max_bytes:
            raise InvalidArgument(
                f"{self._where()}: {n} rows ({nbytes} bytes) exceed the server's limit of "
                f"{self.limits.max_bytes} bytes per request"
            )
        if ids.dtype.kind == "u" and n and int(ids.max()) > np.iinfo(np.int64).max:
            raise InvalidArgument(f"{self._where()}: id {int(ids.max())} exceeds int64")
        out = ids.astype(np.int64, copy=False)
        if not out.dtype.isnative:
            out = out.astype(np.int64)
        if n:
            lo = int(out.min())
            if lo < 0:
                raise InvalidArgument(f"{self._where()}: negative id {lo}; ids must be >= 0")
            bound = self.spec.num_embeddings
            if bound is not None:
                hi = int(out.max())
                if hi >= bound:
                    raise InvalidArgument(
                        f"{self._where()}: id {hi} out of range [0, {bound}) (num_embeddings)"
                    )
        return out

    def check_grad_dtype(self, dtype: np.dtype[np.generic]) -> None:
        """Refuse gradient rows of a dtype other than float32 or the storage dtype.

        Raises:
            DTypeMismatch: names the table, the dtype given and the dtypes taken
                (INVALID_ARGUMENT).
        """
        if dtype in (F32, self.spec.np_dtype):
            return
        taken = "float32" if self.spec.dtype == "float32" else f"float32 or {self.spec.dtype}"
        raise DTypeMismatch(
            f"{self._where()}: gradient rows are {dtype}; this table (storage dtype "
            f"{self.spec.dtype}) takes {taken}"
        )

    def check_push(self, ids: np.ndarray, grads: np.ndarray) -> npt.NDArray[np.int64]:
        """Validate a push (changes nothing).

        Args:
            ids: (n,) integer ids.
            grads: (n, dim) gradient rows, float32 or the table's storage dtype.

        Returns:
            The ids as native int64.

        Raises:
            InvalidArgument / DTypeMismatch / DimensionMismatch / NonFiniteGradient: bad ids,
                another dtype, wrong shape, NaN/Inf in a row (INVALID_ARGUMENT, naming the
                table; a dtype refusal names both dtypes).
        """
        out = self.check_ids(ids)
        self.check_grad_dtype(grads.dtype)
        if grads.shape != (out.shape[0], self.spec.dim):
            raise DimensionMismatch(
                f"{self._where()}: gradient rows must have shape ({out.shape[0]}, "
                f"{self.spec.dim}) (len(ids), dim), got {tuple(grads.shape)}"
            )
        if grads.size:
            finite = np.isfinite(grads.astype(F32, copy=False))
            bad = grads.size - int(np.count_nonzero(finite))
            if bad:
                row = int(np.flatnonzero(~finite.all(axis=1))[0])
                raise NonFiniteGradient(
                    f"{self._where()}: {bad} NaN/Inf gradient element(s), first in the row "
                    f"of id {int(out[row])}; nothing applied"
                )
        return out

    def check_range(self, uniq: npt.NDArray[np.int64], g: npt.NDArray[np.float32]) -> None:
        """Refuse a push whose result would overflow the storage dtype (changes nothing).

        A float16 or bfloat16 row is updated in float32 and rounded back once; a finite result
        beyond the dtype's largest value (65504 for float16) would be stored as Inf. This
        computes the rule on copies of the rows the push would change (stored rows, and the
        initial rows of ids the frequency filter would admit now) and refuses the whole push
        if any element would overflow (:func:`~paramserver.core.storage_range.overflow_mask`, the
        dense keys' definition: an element already non-finite is not blamed). float32 tables
        are not checked, as float32 dense keys are not.

        Args:
            uniq: Distinct ids, ascending (int64 (m,)), as from :func:`coalesce`.
            g: Their summed gradients, float32 (m, dim).

        Raises:
            ValueOutOfRange: naming the table, the rule, the count, the range and the id and
                column of the first such element (INVALID_ARGUMENT); nothing applied.
        """
        s = self.spec
        if s.np_dtype not in HALF_DTYPES or uniq.shape[0] == 0 or s.dim == 0:
            return
        where = self.index.lookup(uniq)
        new = where < 0
        if new.any():
            keep = ~new
            keep[new] = self._would_admit(uniq[new])
            uniq, g, where, new = uniq[keep], g[keep], where[keep], new[keep]
        before = np.empty((uniq.shape[0], s.dim), s.np_dtype)
        before[~new] = self._store["rows"].gather(where[~new])
        before[new] = initial_rows(s.seed, uniq[new], s.dim, s.initializer).astype(s.np_dtype)
        fields = self._fields()
        state = {}
        for name in self._state_names():
            shape, dtype, fill = fields[name]
            arr = np.full((uniq.shape[0], *shape), fill, dtype)
            arr[~new] = self._store[name].gather(where[~new])
            state[name] = arr
        w = before.astype(F32)
        with np.errstate(over="ignore", invalid="ignore"):  # what this check looks for
            self._rule_step(w, g, state)
        bad = overflow_mask(w, s.np_dtype, np.isfinite(before))
        count = int(np.count_nonzero(bad))
        if count:
            row, col = (int(x) for x in np.argwhere(bad)[0])
            raise range_refusal(
                f"{self._where()}: row push",
                s.rule.kind,
                count,
                s.np_dtype,
                f", first at id {int(uniq[row])} column {col}",
            )

    # ------------------------------------------------------------------ row ops
    def pull(self, ids: npt.NDArray[np.int64]) -> np.ndarray:
        """Rows of validated ``ids`` in the caller's order (duplicates allowed).

        Returns:
            A new (len(ids), dim) array of the storage dtype: stored rows, and the initial row
            of every id with no stored row (not stored by the pull).
        """
        s = self.spec
        ids = ids64(ids)
        n = ids.shape[0]
        out = np.empty((n, s.dim), s.np_dtype)
        if s.np_dtype == F32:
            k = kernels()
            missing = np.empty(n, np.int64)
            slots, addrs, scale = self.index._slots, self._store["rows"].addrs, s.initializer.scale

            def gather(a: int, b: int) -> int:
                return int(
                    k.pull_f32(
                        slots,
                        addrs,
                        self._shift,
                        ids[a:b],
                        self._seed_key,
                        float(scale),
                        self._init_code,
                        out[a:b],
                        missing[a:b],
                    )
                )

            parts = split_rows(n, s.dim, gather)
            if any(m for _, m in parts):  # positions within each part: made absolute here
                lost = np.concatenate([missing[a : a + m] + a for a, m in parts])
                out[lost] = initial_rows(s.seed, ids[lost], s.dim, s.initializer)
        else:
            where = self.index.lookup(ids)
            have = where >= 0
            out[have] = self._store["rows"].gather(where[have])
            absent = ~have
            if absent.any():
                out[absent] = initial_rows(s.seed, ids[absent], s.dim, s.initializer).astype(
                    s.np_dtype
                )
        self.pulls += 1
        self.rows_pulled += n
        return out

    def versions(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The versions of validated ``ids`` (int64 (n,), caller's order): a stored row's
        count of applied pushes, 0 for an id with no stored row (changes nothing)."""
        ids = ids64(ids)
        where = self.index.lookup(ids)
        have = where >= 0
        out = np.zeros(ids.shape[0], np.int64)
        out[have] = self._store[_VERSION].gather(where[have])
        return out

    def push(
        self, ids: npt.NDArray[np.int64], grads: np.ndarray, *, now_s: float, clock: int
    ) -> PushRowsResult:
        """Apply one validated push: duplicates summed, the rule applied once per distinct id.

        Args:
            ids: Validated int64 ids (n,).
            grads: Validated (n, dim) gradient rows.
            now_s: Seconds (for ``expiry_s``; any clock, as long as :meth:`expire` uses it).
            clock: The pushing worker's clock (for ``expiry_clocks``).
        """
        uniq, g = coalesce_first(ids, grads)
        return self.apply_coalesced(uniq, g, now_s=now_s, clock=clock)

    def apply_coalesced(
        self,
        uniq: npt.NDArray[np.int64],
        g: npt.NDArray[np.float32],
        *,
        now_s: float,
        clock: int,
    ) -> PushRowsResult:
        """Apply distinct ids (any order) with their summed float32 gradients (m, dim)."""
        self.pushes += 1
        uniq = ids64(uniq)
        g = np.ascontiguousarray(g, np.float32)
        created = 0
        filtered = 0
        if self.spec.min_pushes <= 1:
            where, new, created = self.index.find_or_add(uniq, self.n)
            if created:
                self._init_rows(self.n, uniq[new])
        else:
            where = self.index.lookup(uniq)
            new = where < 0
            if new.any():
                new_ids = uniq[new]
                admit = self._filter(new_ids)
                filtered = int(new_ids.shape[0] - np.count_nonzero(admit))
                if filtered:
                    keep = np.ones(uniq.shape[0], bool)
                    keep[np.flatnonzero(new)[~admit]] = False
                    uniq, g, where, new = uniq[keep], g[keep], where[keep], new[keep]
                created_ids = uniq[new]
                created = int(created_ids.shape[0])
                if created:
                    where[new] = self._store_new(created_ids)
        self.filtered += filtered
        if uniq.shape[0]:
            self._apply_rule(where, g)
            versions = self._store[_VERSION]
            versions.scatter(where, versions.gather(where) + 1)
            if self.tracks_pushes:
                kernels().stamp(
                    self._store["last_clock"].addrs,
                    self._store["last_s"].addrs,
                    self._shift,
                    where,
                    clock,
                    now_s,
                )
        self.rows_pushed += int(uniq.shape[0])
        return PushRowsResult(
            distinct=int(uniq.shape[0]) + filtered,
            applied=int(uniq.shape[0]),
            filtered=filtered,
            created=created,
        )

    def _would_admit(self, new_ids: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        """Where :meth:`_filter` would admit ``new_ids`` (distinct, no stored row) now; pure."""
        k = self.spec.min_pushes
        if k <= 1:
            return np.ones(new_ids.shape[0], bool)
        slot = self._pending.lookup(new_ids)
        seen = np.zeros(new_ids.shape[0], np.int64)
        known = slot >= 0
        seen[known] = self._pending_counts[slot[known]]
        return seen + 1 >= k

    def _filter(self, new_ids: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        """Count one push of each id without a stored row; True where it is admitted now."""
        k = self.spec.min_pushes
        if k <= 1:
            return np.ones(new_ids.shape[0], bool)
        slot = self._pending.lookup(new_ids)
        fresh = slot < 0
        if fresh.any():
            add = new_ids[fresh]
            start = self._pending_n
            need = start + add.shape[0]
            if need > self._pending_counts.shape[0]:
                grown = np.zeros(max(need, 2 * self._pending_counts.shape[0], 64), np.int64)
                grown[:start] = self._pending_counts[:start]
                self._pending_counts = grown
            vals = np.arange(start, need, dtype=np.int64)
            self._pending.insert(add, vals)
            self._pending_n = need
            slot[fresh] = vals
        self._pending_counts[slot] += 1
        admit = self._pending_counts[slot] >= k
        self._pending_counts[slot[admit]] = 0  # admitted: a later expiry starts it afresh
        return admit

    def _store_new(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Store the initial rows of distinct absent ``ids``; returns their rows."""
        start = self.n
        rows = np.arange(start, start + ids.shape[0], dtype=np.int64)
        self.index.insert(ids, rows)
        self._init_rows(start, ids)
        return rows

    def _init_rows(self, start: int, ids: npt.NDArray[np.int64]) -> None:
        """Write rows ``[start, start + len(ids))``: the initial rows of ``ids`` and every
        state field's new-row value; the table then holds ``start + len(ids)`` rows."""
        s = self.spec
        stop = start + ids.shape[0]
        self._reserve_rows(stop)
        rows_arena = self._store["rows"]
        if s.np_dtype == F32 and self._init_code != kernels().INIT_OTHER:
            k, rows = kernels(), np.arange(start, stop, dtype=np.int64)
            split_rows(
                rows.shape[0],
                s.dim,
                lambda a, b: k.create_rows_f32(
                    rows_arena.addrs,
                    self._shift,
                    s.dim,
                    rows[a:b],
                    ids[a:b],
                    self._seed_key,
                    float(s.initializer.scale),
                    self._init_code,
                ),
            )
        else:
            init = initial_rows(s.seed, ids, s.dim, s.initializer).astype(s.np_dtype)
            rows_arena.scatter(np.arange(start, stop, dtype=np.int64), init)
        for name, arena in self._store.items():
            if name != "rows":
                arena.fill(start, stop)
        self.n = stop

    def _state_names(self) -> list[str]:
        """The rule's per-row optimizer state arrays (``acc``; ``m``, ``v``, ``steps``)."""
        return [n for n in self._fields() if n not in ("rows", _VERSION, *_BOOKKEEPING)]

    def _apply_rule(self, where: npt.NDArray[np.int64], g: npt.NDArray[np.float32]) -> None:
        s = self.spec
        r = s.rule
        if s.np_dtype != F32:  # half precision: the rule in float32 on gathered rows
            a = self._store
            w = a["rows"].gather(where).astype(F32)
            state = {name: a[name].gather(where) for name in self._state_names()}
            self._rule_step(w, g, state)
            for name, arr in state.items():
                a[name].scatter(where, arr)
            a["rows"].scatter(where, w.astype(s.np_dtype))
            return
        # ``where`` holds distinct rows (a coalesced push): parts never share a row.
        k, kernel, store = kernels(), ROW_RULES[r.kind].kernel, self._store
        split_rows(
            where.shape[0],
            s.dim,
            lambda a, b: kernel(k, store, self._shift, where[a:b], g[a:b], r),
        )

    def _rule_step(
        self, w: npt.NDArray[np.float32], g: npt.NDArray[np.float32], state: dict[str, np.ndarray]
    ) -> None:
        """One step of the rule on gathered rows, in numpy: ``w`` (m, dim) float32 and
        ``state`` (the rows' :meth:`_state_names` arrays) are updated in place; nothing of the
        table changes. The arithmetic of the float32 kernels (``row_kernels.apply_*``), for
        half-precision tables and :meth:`check_range`.
        """
        r = self.spec.rule
        ROW_RULES[r.kind].step(w, g, state, r)

    # ------------------------------------------------------------------ memory policy
    def _expiry_mask(self, now_s: float, clock: int) -> npt.NDArray[np.bool_]:
        s = self.spec
        drop = np.zeros(self.n, bool)
        if self.n == 0 or not self.tracks_pushes:
            return drop
        every = np.arange(self.n, dtype=np.int64)
        if s.expiry_clocks:
            drop |= clock - self._store["last_clock"].gather(every) >= s.expiry_clocks
        if s.expiry_s:
            drop |= now_s - self._store["last_s"].gather(every) >= s.expiry_s
        return drop

    def would_expire(self, *, now_s: float, clock: int) -> bool:
        """Whether :meth:`expire` with these arguments would drop a row (changes nothing)."""
        return bool(self._expiry_mask(now_s, clock).any())

    def expire(self, *, now_s: float, clock: int) -> int:
        """Drop stored rows not pushed for ``expiry_clocks`` clocks or ``expiry_s`` seconds.

        A row last pushed at clock c (time t) expires once ``clock - c >= expiry_clocks`` (or
        ``now_s - t >= expiry_s``); its optimizer state goes with it and a later pull returns
        its initial row again, and the table draws a new :attr:`version_epoch` (a re-created
        row starts again at version 0). Returns the number of rows dropped (also added to
        :attr:`expired`).
        """
        drop = self._expiry_mask(now_s, clock)
        count = int(np.count_nonzero(drop))
        if count:
            ids = self.ids_by_row()
            keep = np.flatnonzero(~drop)
            kept = {name: arena.gather(keep) for name, arena in self._store.items()}
            self._new_store()
            self._reserve_rows(keep.shape[0])
            rows = np.arange(keep.shape[0], dtype=np.int64)
            for name, arena in self._store.items():
                arena.scatter(rows, kept[name])
            self.n = int(keep.shape[0])
            self.index.rebuild(ids[keep], rows)
            self.expired += count
            self.version_epoch = new_version_epoch()
        return count

    # ------------------------------------------------------------------ durability
    def ids_by_row(self) -> npt.NDArray[np.int64]:
        """The id of each stored row, in row order (int64 (n,))."""
        ids, rows = self.index.items()
        out = np.empty(self.n, np.int64)
        out[rows] = ids
        return out

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Copies of the stored ids and per-row arrays, sorted by id (checkpoints, reshard).

        Keys: ``ids`` (int64 (n,)), ``rows`` (storage dtype (n, dim)), the rule's state
        (``acc``, ``m``, ``v``, ``steps``), ``version`` (int64 (n,)), ``last_clock``,
        ``last_s`` (zeros for a table without expiry, which does not keep them), and the
        frequency filter's ``pending_ids`` / ``pending_counts`` (ids without a row, with a
        count > 0).
        """
        ids = self.ids_by_row()
        order = np.argsort(ids, kind="stable").astype(np.int64)
        out = {"ids": ids[order]}
        for name, (shape, dtype, _) in self._fields().items():
            arena = self._store.get(name)
            out[name] = (
                arena.gather(order) if arena is not None else np.zeros((self.n, *shape), dtype)
            )
        p_ids, p_slot = self._pending.items()
        counts = self._pending_counts[p_slot]
        live = counts > 0
        p_order = np.argsort(p_ids[live], kind="stable")
        out["pending_ids"] = p_ids[live][p_order]
        out["pending_counts"] = counts[live][p_order]
        return out

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Replace every stored row and counter by :meth:`state_arrays` output, and draw a
        new :attr:`version_epoch`. Arrays saved before rows had versions (no ``version``)
        load with every version 0.

        Raises:
            InvalidArgument: an array is missing or of the wrong shape or dtype.
        """
        ids = np.asarray(arrays["ids"], np.int64)
        n = ids.shape[0]
        if _VERSION not in arrays:
            arrays = {**arrays, _VERSION: np.zeros(n, np.int64)}
        for name, (shape, dtype, _) in self._fields().items():
            got = arrays.get(name)
            if got is None or got.shape != (n, *shape) or got.dtype != dtype:
                raise InvalidArgument(
                    f"{self._where()}: restored array {name!r} missing or not {dtype} {(n, *shape)}"
                )
        self.n = 0
        self._new_store()
        self._reserve_rows(n)
        rows = np.arange(n, dtype=np.int64)
        for name, arena in self._store.items():
            arena.scatter(rows, arrays[name])
        self.n = n
        self.index.rebuild(ids, rows)
        p_ids = np.asarray(arrays.get("pending_ids", np.zeros(0, np.int64)), np.int64)
        p_counts = np.asarray(arrays.get("pending_counts", np.zeros(0, np.int64)), np.int64)
        self._pending.rebuild(p_ids, np.arange(p_ids.shape[0], dtype=np.int64))
        self._pending_counts = p_counts.copy()
        self._pending_n = int(p_ids.shape[0])
        self.version_epoch = new_version_epoch()
