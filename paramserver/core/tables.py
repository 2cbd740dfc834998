"""Sparse embedding tables: int64 id -> row of ``dim`` elements (pure, synchronous).

The workload parameter servers exist for (ps-lite, Bösen, Angel, PERSIA, Monolith, TF
ParameterServerStrategy's sharded embeddings): a table too large for any worker, of which a
batch touches a few thousand rows. See ``docs/embedding-tables.md`` for the user-facing
reference; this module is the shard's state for it, with time passed in.

* **Lazy rows.** The initial row of id ``i`` is a pure function of ``(seed, i)``
  (:func:`initial_rows`, a counter-based generator: SplitMix64 of the id and column, after
  Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011, and Steele et al.,
  "Fast splittable pseudorandom number generators", OOPSLA 2014), so every shard count, restart
  and reshard gives the same row. A pull of an id with no stored row returns that initial row
  without storing it (unobservable except in memory); the first admitted push stores it.
* **Rows ops, vectorized.** :meth:`EmbeddingTable.pull` keeps the caller's order and allows
  duplicates; :meth:`EmbeddingTable.push` sums duplicate ids first (as torch coalesces sparse
  gradients), then applies the row-wise rule once per distinct id. Rows not in a push never
  change, bit for bit. No per-id Python loop on any path.
* **Rules** (:class:`TableRule`): ``sgd``; ``adagrad`` (element-wise, ``torch.optim.Adagrad``,
  Duchi et al., JMLR 2011); ``rowwise_adagrad`` (one accumulator per row, the mean of the
  squared gradient over the row, as FBGEMM's ``EXACT_ROWWISE_ADAGRAD``); ``adam`` (lazy: only
  rows in a push advance their moments and their own step count, as ``torch.optim.SparseAdam``
  / TF LazyAdam; the step count is per row, so a row's update does not depend on how rows are
  spread over shards). Optimizer state is float32 whatever the storage dtype.
* **Memory policy** (after Monolith, Liu et al. 2022): optional expiry of stored rows not pushed
  for ``expiry_clocks`` clocks or ``expiry_s`` seconds (:meth:`EmbeddingTable.expire`), and a
  frequency filter: an id gets a stored row only at its ``min_pushes``-th push; earlier pushes
  are dropped and counted, and pulls return its initial row.

The id -> row index (:class:`IdIndex`) is an open-addressing hash table with linear probing
written in numpy: every lookup and insert is a handful of whole-array rounds (one per probe
step; the load factor is kept <= 1/2 so rounds stay few). It was chosen over a sorted array with
``np.searchsorted`` because inserting new ids into a sorted array moves every later element
(O(n) per push of new ids, 10M-id tables), and over pandas' ``Index`` (a hash table in C)
because pandas is not a dependency of the server and its ``Index`` is immutable, so each insert
rebuilds it; ``benchmarks/embedding.py`` measures the index (phase ``index``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from paramserver.core.optimizers import HALF_DTYPES, overflow_mask, range_refusal
from paramserver.errors import (
    DimensionMismatch,
    DTypeMismatch,
    InvalidArgument,
    NonFiniteGradient,
)
from paramserver.protocol.table_spec import (
    _GOLDEN,
    _U64,
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
    "TableLimits",
    "TableRule",
    "TableSpec",
    "coalesce",
    "initial_rows",
    "shard_of_ids",
    "splitmix64",
    "table_hash",
]

_EMPTY: Final = -1  # ids are >= 0, so -1 marks a free slot of the index


def _unit_uniform(bits: npt.NDArray[np.uint64]) -> npt.NDArray[np.float64]:
    """Top 53 bits of each word as a float64 in [0, 1)."""
    return (bits >> _U64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


def initial_rows(
    seed: int, ids: npt.NDArray[np.int64], dim: int, init: Initializer
) -> npt.NDArray[np.float32]:
    """The initial rows of ``ids``: a pure function of ``(seed, id, column)``.

    Word ``k`` of id ``i`` is ``splitmix64(key_i + (k + 1) * golden)`` with
    ``key_i = splitmix64(uint64(i) xor splitmix64(uint64(seed)))``: a counter-based generator
    keyed by the id (no state, any order, any subset), so a row is the same on every shard,
    after every restart and reshard. Uniform: ``(2u - 1) * scale``; normal: Box-Muller on words
    ``2j`` and ``2j + 1`` (``sqrt(-2 ln(1 - u1)) * cos(2 pi u2) * scale``).

    Args:
        seed: Table seed (any int; taken modulo 2**64).
        ids: int64 array (n,).
        dim: Row width.
        init: The initializer.

    Returns:
        float32 array (n, dim).
    """
    n = int(ids.shape[0])
    if init.kind == "zeros" or init.scale == 0.0 or n == 0 or dim == 0:
        return np.zeros((n, dim), np.float32)
    seed_key = splitmix64(np.array([seed % (1 << 64)], np.uint64))[0]
    key = splitmix64(ids.astype(np.int64, copy=False).view(np.uint64) ^ seed_key)
    words = dim if init.kind == "uniform" else 2 * dim
    with np.errstate(over="ignore"):
        counters = (np.arange(1, words + 1, dtype=np.uint64) * _GOLDEN)[None, :]
        u = _unit_uniform(splitmix64(key[:, None] + counters))
    if init.kind == "uniform":
        out = (2.0 * u - 1.0) * init.scale
    else:
        radius = np.sqrt(-2.0 * np.log1p(-u[:, 0::2]))
        out = radius * np.cos(2.0 * np.pi * u[:, 1::2]) * init.scale
    return out.astype(np.float32)


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


class IdIndex:
    """Vectorized int64 id -> int64 value map: open addressing, linear probing, numpy only.

    Keys are ids >= 0; values are row numbers. Capacity is a power of two kept at least twice
    the size. Deletion is by :meth:`rebuild` (expiry sweeps are rare and whole-table anyway).
    """

    def __init__(self, capacity: int = 1024) -> None:
        cap = 1 << max(4, (capacity - 1).bit_length())
        self._keys = np.full(cap, _EMPTY, np.int64)
        self._vals = np.zeros(cap, np.int64)
        self.size = 0

    def _slots(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        mask = _U64(self._keys.shape[0] - 1)
        return (splitmix64(ids.view(np.uint64)) & mask).astype(np.int64)

    def lookup(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Values of ``ids`` (int64 (n,), each >= 0); -1 where an id is absent."""
        out = np.full(ids.shape[0], -1, np.int64)
        if self.size == 0 or ids.shape[0] == 0:
            return out
        mask = self._keys.shape[0] - 1
        todo = np.arange(ids.shape[0])
        want = ids
        slot = self._slots(ids)
        while todo.shape[0]:
            k = self._keys[slot]
            hit = k == want
            if hit.any():
                out[todo[hit]] = self._vals[slot[hit]]
            go = ~hit & (k != _EMPTY)
            todo, want, slot = todo[go], want[go], (slot[go] + 1) & mask
        return out

    def insert(self, ids: npt.NDArray[np.int64], vals: npt.NDArray[np.int64]) -> None:
        """Insert distinct ``ids`` that are all absent, with their values (both int64 (m,))."""
        m = ids.shape[0]
        if m == 0:
            return
        if 2 * (self.size + m) > self._keys.shape[0]:
            self._grow(self.size + m)
        mask = self._keys.shape[0] - 1
        slot = self._slots(ids)
        todo = np.arange(m)
        while todo.shape[0]:
            free = np.flatnonzero(self._keys[slot] == _EMPTY)
            taken = np.zeros(todo.shape[0], bool)
            if free.shape[0]:
                cand_slots, first = np.unique(slot[free], return_index=True)
                winners = free[first]
                self._keys[cand_slots] = ids[todo[winners]]
                self._vals[cand_slots] = vals[todo[winners]]
                taken[winners] = True
            keep = ~taken
            todo, slot = todo[keep], (slot[keep] + 1) & mask
        self.size += m

    def items(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """All (ids, values), in slot order."""
        used = self._keys != _EMPTY
        return self._keys[used], self._vals[used]

    def _grow(self, need: int) -> None:
        ids, vals = self.items()
        cap = 1 << max(4, (2 * need - 1).bit_length())
        self._keys = np.full(cap, _EMPTY, np.int64)
        self._vals = np.zeros(cap, np.int64)
        self.size = 0
        self.insert(ids, vals)

    def rebuild(self, ids: npt.NDArray[np.int64], vals: npt.NDArray[np.int64]) -> None:
        """Replace the contents by distinct ``ids`` -> ``vals``."""
        cap = 1 << max(4, (2 * max(ids.shape[0], 1) - 1).bit_length())
        self._keys = np.full(cap, _EMPTY, np.int64)
        self._vals = np.zeros(cap, np.int64)
        self.size = 0
        self.insert(ids, vals)


def coalesce(
    ids: npt.NDArray[np.int64], grads: npt.NDArray[Any]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """Sum the gradient rows of duplicate ids (as ``torch.Tensor.coalesce``).

    Vectorized for skewed (Zipf) batches, where most ids occur once and a few very often: rows
    are grouped by id (one stable sort); ids seen at most :data:`_LIGHT` times are summed level
    by level (a whole-array add per level), the heavy hitters by ``np.add.reduceat`` over their
    segments (``reduceat`` alone pays a per-segment cost that dominates at thousands of
    segments). Each id's rows are added in the caller's order.

    Args:
        ids: int64 (n,).
        grads: (n, dim) float array.

    Returns:
        (distinct ids ascending (m,), float32 (m, dim) sums).
    """
    g = grads.astype(np.float32, copy=False)
    uniq, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    order = np.argsort(inverse, kind="stable")
    gs = g[order]
    if uniq.shape[0] == ids.shape[0]:
        return uniq, gs
    starts = np.zeros(uniq.shape[0], np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    out = gs[starts]
    light = np.flatnonzero((counts > 1) & (counts <= _LIGHT))
    lc, ls = counts[light], starts[light]
    for r in range(1, _LIGHT):
        more = lc > r
        if not more.any():
            break
        light, lc, ls = light[more], lc[more], ls[more]
        out[light] += gs[ls + r]
    heavy = np.flatnonzero(counts > _LIGHT)
    if heavy.shape[0]:
        hc, hs = counts[heavy], starts[heavy]
        seg = np.zeros(heavy.shape[0], np.int64)
        np.cumsum(hc[:-1], out=seg[1:])
        rows = np.repeat(hs - seg, hc) + np.arange(int(hc.sum()))
        out[heavy] = np.add.reduceat(gs[rows], seg, axis=0)
    return uniq, out


#: Ids occurring up to this many times in one push are summed level by level (see coalesce).
_LIGHT: Final = 4


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


_STATE_FIELDS: Final = ("rows", "acc", "m", "v", "steps", "last_clock", "last_s")


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
        self.n = 0  # stored rows (the first n of every state array are in use)
        self._cap = 0
        self._arrays: dict[str, np.ndarray] = {}
        self._alloc(64)
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

    # ------------------------------------------------------------------ storage
    def _fields(self) -> dict[str, tuple[tuple[int, ...], np.dtype[Any], float]]:
        s, d = self.spec, self.spec.dim
        out: dict[str, tuple[tuple[int, ...], np.dtype[Any], float]] = {
            "rows": ((d,), s.np_dtype, 0.0),
            "last_clock": ((), np.dtype(np.int64), 0.0),
            "last_s": ((), np.dtype(np.float64), 0.0),
        }
        kind = s.rule.kind
        if kind == "adagrad":
            out["acc"] = ((d,), F32, s.rule.initial_accumulator)
        elif kind == "rowwise_adagrad":
            out["acc"] = ((), F32, s.rule.initial_accumulator)
        elif kind == "adam":
            out["m"] = ((d,), F32, 0.0)
            out["v"] = ((d,), F32, 0.0)
            out["steps"] = ((), np.dtype(np.int64), 0.0)
        return out

    def _alloc(self, cap: int) -> None:
        new: dict[str, np.ndarray] = {}
        for name, (shape, dtype, fill) in self._fields().items():
            arr = np.full((cap, *shape), fill, dtype)
            if name in self._arrays:
                arr[: self.n] = self._arrays[name][: self.n]
            new[name] = arr
        self._arrays = new
        self._cap = cap

    def _ensure(self, n: int) -> None:
        if n > self._cap:
            self._alloc(max(n, 2 * self._cap))

    @property
    def row_bytes(self) -> int:
        """Bytes one stored row takes with its optimizer state and bookkeeping."""
        return sum(
            int(np.dtype(dtype).itemsize) * int(np.prod(shape, dtype=np.int64))
            for shape, dtype, _ in self._fields().values()
        )

    def stored_bytes(self) -> int:
        """Bytes of the stored rows and their optimizer state (the used part of each array)."""
        return sum(int(a[: self.n].nbytes) for a in self._arrays.values())

    @property
    def rows(self) -> np.ndarray:
        """The stored rows, (n, dim) of the storage dtype (a view: do not keep it)."""
        return self._arrays["rows"][: self.n]

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

    def check_grad_dtype(self, dtype: np.dtype[Any]) -> None:
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
        if any element would overflow (:func:`~paramserver.core.optimizers.overflow_mask`, the
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
        before[~new] = self._arrays["rows"][where[~new]]
        before[new] = initial_rows(s.seed, uniq[new], s.dim, s.initializer).astype(s.np_dtype)
        fields = self._fields()
        state = {}
        for name in self._state_names():
            shape, dtype, fill = fields[name]
            arr = np.full((uniq.shape[0], *shape), fill, dtype)
            arr[~new] = self._arrays[name][where[~new]]
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
        where = self.index.lookup(ids)
        out = np.empty((ids.shape[0], s.dim), s.np_dtype)
        have = where >= 0
        out[have] = self._arrays["rows"][where[have]]
        missing = ~have
        if missing.any():
            out[missing] = initial_rows(s.seed, ids[missing], s.dim, s.initializer).astype(
                s.np_dtype
            )
        self.pulls += 1
        self.rows_pulled += int(ids.shape[0])
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
        uniq, g = coalesce(ids, grads)
        return self.apply_coalesced(uniq, g, now_s=now_s, clock=clock)

    def apply_coalesced(
        self,
        uniq: npt.NDArray[np.int64],
        g: npt.NDArray[np.float32],
        *,
        now_s: float,
        clock: int,
    ) -> PushRowsResult:
        """Apply distinct ascending ids with their summed float32 gradients (m, dim)."""
        self.pushes += 1
        where = self.index.lookup(uniq)
        new = where < 0
        created = 0
        filtered = 0
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
            self._arrays["last_clock"][where] = clock
            self._arrays["last_s"][where] = now_s
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
        m = ids.shape[0]
        start = self.n
        self._ensure(start + m)
        rows = np.arange(start, start + m, dtype=np.int64)
        s = self.spec
        self._arrays["rows"][start : start + m] = initial_rows(
            s.seed, ids, s.dim, s.initializer
        ).astype(s.np_dtype)
        self.index.insert(ids, rows)
        self.n += m
        return rows

    def _state_names(self) -> list[str]:
        """The rule's per-row optimizer state arrays (``acc``; ``m``, ``v``, ``steps``)."""
        return [n for n in self._fields() if n not in ("rows", "last_clock", "last_s")]

    def _apply_rule(self, where: npt.NDArray[np.int64], g: npt.NDArray[np.float32]) -> None:
        a = self._arrays
        w = a["rows"][where].astype(F32)
        state = {name: a[name][where] for name in self._state_names()}
        self._rule_step(w, g, state)
        for name, arr in state.items():
            a[name][where] = arr
        a["rows"][where] = w.astype(self.spec.np_dtype)

    def _rule_step(
        self, w: npt.NDArray[np.float32], g: npt.NDArray[np.float32], state: dict[str, np.ndarray]
    ) -> None:
        """One step of the rule on gathered rows: ``w`` (m, dim) float32 and ``state`` (the
        rows' :meth:`_state_names` arrays) are updated in place; nothing of the table changes.
        The one copy of the rules' arithmetic, for :meth:`_apply_rule` and :meth:`check_range`.
        """
        r = self.spec.rule
        if r.kind == "sgd":
            w -= np.float32(r.lr) * g
        elif r.kind == "adagrad":
            acc = state["acc"]
            acc += g * g
            w -= np.float32(r.lr) * g / (np.sqrt(acc) + np.float32(r.eps))
        elif r.kind == "rowwise_adagrad":
            acc_row = state["acc"]
            acc_row += np.mean(g * g, axis=1, dtype=F32)
            w -= np.float32(r.lr) * g / (np.sqrt(acc_row) + np.float32(r.eps))[:, None]
        else:  # lazy adam (torch.optim.SparseAdam's arithmetic, step counted per row)
            steps = state["steps"]
            steps += 1
            m = state["m"]
            v = state["v"]
            m += (g - m) * np.float32(1.0 - r.beta1)
            v += (g * g - v) * np.float32(1.0 - r.beta2)
            t = steps.astype(np.float64)
            step_size = (r.lr * np.sqrt(1.0 - r.beta2**t) / (1.0 - r.beta1**t)).astype(F32)
            w -= step_size[:, None] * (m / (np.sqrt(v) + np.float32(r.eps)))

    # ------------------------------------------------------------------ memory policy
    def _expiry_mask(self, now_s: float, clock: int) -> npt.NDArray[np.bool_]:
        s = self.spec
        drop = np.zeros(self.n, bool)
        if self.n == 0:
            return drop
        a = self._arrays
        if s.expiry_clocks:
            drop |= clock - a["last_clock"][: self.n] >= s.expiry_clocks
        if s.expiry_s:
            drop |= now_s - a["last_s"][: self.n] >= s.expiry_s
        return drop

    def would_expire(self, *, now_s: float, clock: int) -> bool:
        """Whether :meth:`expire` with these arguments would drop a row (changes nothing)."""
        return bool(self._expiry_mask(now_s, clock).any())

    def expire(self, *, now_s: float, clock: int) -> int:
        """Drop stored rows not pushed for ``expiry_clocks`` clocks or ``expiry_s`` seconds.

        A row last pushed at clock c (time t) expires once ``clock - c >= expiry_clocks`` (or
        ``now_s - t >= expiry_s``); its optimizer state goes with it and a later pull returns
        its initial row again. Returns the number of rows dropped (also added to
        :attr:`expired`).
        """
        drop = self._expiry_mask(now_s, clock)
        count = int(np.count_nonzero(drop))
        a = self._arrays
        if count:
            ids = self.ids_by_row()
            keep = np.flatnonzero(~drop)
            for name in a:
                a[name][: keep.shape[0]] = a[name][keep]
                a[name][keep.shape[0] : self.n] = self._fields()[name][2]
            self.n = int(keep.shape[0])
            self.index.rebuild(ids[keep], np.arange(self.n, dtype=np.int64))
            self.expired += count
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
        (``acc``, ``m``, ``v``, ``steps``), ``last_clock``, ``last_s``, and the frequency
        filter's ``pending_ids`` / ``pending_counts`` (ids without a row, with a count > 0).
        """
        ids = self.ids_by_row()
        order = np.argsort(ids, kind="stable")
        out = {"ids": ids[order]}
        for name, arr in self._arrays.items():
            out[name] = arr[: self.n][order].copy()
        p_ids, p_slot = self._pending.items()
        counts = self._pending_counts[p_slot]
        live = counts > 0
        p_order = np.argsort(p_ids[live], kind="stable")
        out["pending_ids"] = p_ids[live][p_order]
        out["pending_counts"] = counts[live][p_order]
        return out

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Replace every stored row and counter by :meth:`state_arrays` output.

        Raises:
            InvalidArgument: an array is missing or of the wrong shape or dtype.
        """
        ids = np.asarray(arrays["ids"], np.int64)
        n = ids.shape[0]
        fields = self._fields()
        for name, (shape, dtype, _) in fields.items():
            got = arrays.get(name)
            if got is None or got.shape != (n, *shape) or got.dtype != dtype:
                raise InvalidArgument(
                    f"{self._where()}: restored array {name!r} missing or not {dtype} {(n, *shape)}"
                )
        self.n = 0
        self._arrays = {}
        self._alloc(max(64, n))
        for name in fields:
            self._arrays[name][:n] = arrays[name]
        self.n = n
        self.index.rebuild(ids, np.arange(n, dtype=np.int64))
        p_ids = np.asarray(arrays.get("pending_ids", np.zeros(0, np.int64)), np.int64)
        p_counts = np.asarray(arrays.get("pending_counts", np.zeros(0, np.int64)), np.int64)
        self._pending.rebuild(p_ids, np.arange(p_ids.shape[0], dtype=np.int64))
        self._pending_counts = p_counts.copy()
        self._pending_n = int(p_ids.shape[0])
