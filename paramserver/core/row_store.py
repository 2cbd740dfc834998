"""The storage of an embedding table: its id index, its chunked per-row fields, its initial rows.

Pure and synchronous, as :mod:`paramserver.core.tables`, whose :class:`EmbeddingTable` owns one
of each; every per-id loop runs in a compiled kernel of :mod:`paramserver.core.row_kernels`.

* **Lazy rows.** The initial row of id ``i`` is a pure function of ``(seed, i)``
  (:func:`initial_rows`, a counter-based generator: SplitMix64 of the id and column, after
  Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011, and Steele et al.,
  "Fast splittable pseudorandom number generators", OOPSLA 2014), so every shard count, restart
  and reshard gives the same row.
* **Per-row fields.** Each per-row field (the rows; a rule's state; the last push's clock and
  time) is a :class:`RowArena`: fixed chunks of ``2**shift`` rows allocated one at a time and
  never zero-filled, so growth costs O(new rows) and never copies the table.
* **Id index.** The id -> row index (:class:`IdIndex`) is an open-addressing int64 hash table
  with linear probing (load kept <= 0.7, 16 bytes a slot), chosen over a sorted array with
  ``np.searchsorted`` (inserting new ids moves every later element: O(n) per push of new ids)
  and over a Python dict (a per-id interpreter loop and ~100 bytes per entry).
* **Coalescing.** :func:`coalesce` sums the gradient rows of duplicate ids in one pass.
* **Cores.** A large call (a pull's gather, a push's new rows and its rule) is split into
  contiguous parts of its rows that run at once on half the machine's cores
  (:func:`split_rows`; from 4 cores up): the kernels release the GIL, and each part touches
  only its own rows.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType
from typing import Final, TypeVar

import numpy as np
import numpy.typing as npt

from paramserver.protocol.table_spec import Initializer, splitmix64

__all__ = [
    "IdIndex",
    "RowArena",
    "coalesce",
    "coalesce_first",
    "ids64",
    "initial_rows",
    "kernels",
    "seed_key",
    "split_rows",
]

_T = TypeVar("_T")

#: Row work (rows x row width, in elements) from which one call is split over the cores:
#: below it, handing a part to another thread costs more than it saves.
SPLIT_MIN_ELEMENTS: Final = 1 << 18

_EMPTY: Final = -1  # ids are >= 0, so -1 marks a free slot of the index


@functools.cache
def kernels() -> ModuleType:
    """:mod:`paramserver.core.row_kernels`, imported on first use (numba's import takes a
    fraction of a second that clients, which import this module for its specs, never pay)."""
    from paramserver.core import row_kernels

    return row_kernels


@functools.cache
def _row_threads() -> tuple[int, ThreadPoolExecutor | None]:
    """How many parts a large call splits into and the threads that run all but the caller's
    part (None: calls are not split).

    Half the cores this process may use, at most 4: the other half is left to the event loop
    and to workers on the same host. On 2 cores calls are not split: measured there
    (benchmarks/RESULTS.md), splitting sped one worker's rounds up to 2x but slowed two
    workers' by up to 0.7x, whose processes then compete with the parts for the same cores.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    parts = max(1, min(4, cores // 2))
    if parts == 1:
        return 1, None
    return parts, ThreadPoolExecutor(parts - 1, thread_name_prefix="paramserver-rows")


def split_rows(n: int, width: int, run: Callable[[int, int], _T]) -> list[tuple[int, _T]]:
    """``run(start, stop)`` over rows ``[0, n)``: in one call, or, when the work is large
    (``n * width >= SPLIT_MIN_ELEMENTS``) and the process may use 4 cores or more, in contiguous
    parts at once, one on this thread and the others on the row threads (``run`` must release
    the GIL to gain: the compiled kernels do; each part must touch only its own rows).

    Returns:
        ``(start, result)`` per part, in row order. Every part has finished when this returns,
        the failing ones included; the first part's error (in row order) is raised.
    """
    parts, pool = _row_threads()
    if pool is None or n * width < SPLIT_MIN_ELEMENTS or n < parts:
        return [(0, run(0, n))]
    bounds = [n * i // parts for i in range(parts + 1)]
    others: list[Future[_T]] = [pool.submit(run, bounds[i], bounds[i + 1]) for i in range(1, parts)]
    try:
        first = run(bounds[0], bounds[1])
    finally:
        rest = [f.exception() for f in others]  # waits for every part, failing or not
    for error in rest:
        if error is not None:
            raise error
    return [(0, first)] + [(bounds[i + 1], f.result()) for i, f in enumerate(others)]


#: Linux madvise advice values (asm-generic/mman-common.h).
_MADV_NOHUGEPAGE: Final = 15
_MADV_POPULATE_WRITE: Final = 23  # Linux 5.14 and later; older kernels answer EINVAL


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """The C library's ``madvise`` (None off Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _map_pages_now(chunk: np.ndarray) -> None:
    """Map the whole pages of a new row chunk now, in one call, as small pages.

    Left to first writes, a push's new rows fault their pages in one by one, and a chunk of
    4 MiB or more (which numpy asks the OS to back with transparent huge pages) can stall a
    push for milliseconds while the kernel compacts memory for a huge page: measured in-process
    at dim 128 (8,192 Zipf ids a round from an empty table), the rows' work of a round went
    from 6.0-7.1 ms to 4.0-4.3 ms with this. Best effort: off Linux, or on a kernel without
    ``MADV_POPULATE_WRITE``, pages are mapped on first write as before. Memory grows by at
    most the unused rows of each field's last chunk (every other row of a chunk is written as
    the table grows into it).
    """
    madvise = _madvise()
    if madvise is None or chunk.nbytes == 0:
        return
    page = _page_size()
    start = -(-chunk.ctypes.data // page) * page
    stop = (chunk.ctypes.data + chunk.nbytes) // page * page
    if stop <= start:
        return
    madvise(start, stop - start, _MADV_NOHUGEPAGE)
    madvise(start, stop - start, _MADV_POPULATE_WRITE)


@functools.cache
def _page_size() -> int:
    """The OS page size in bytes."""
    return os.sysconf("SC_PAGE_SIZE")


def seed_key(seed: int) -> np.uint64:
    return np.uint64(splitmix64(np.array([seed % (1 << 64)], np.uint64))[0])


def ids64(ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
    return np.ascontiguousarray(ids, dtype=np.int64)


def initial_rows(
    seed: int, ids: npt.NDArray[np.int64], dim: int, init: Initializer
) -> npt.NDArray[np.float32]:
    """The initial rows of ``ids``: a pure function of ``(seed, id, column)``.

    Word ``k`` of id ``i`` is ``splitmix64(key_i + (k + 1) * golden)`` with
    ``key_i = splitmix64(uint64(i) xor splitmix64(uint64(seed)))``: a counter-based generator
    keyed by the id (no state, any order, any subset), so a row is the same on every shard,
    after every restart and reshard. Uniform: ``(2u - 1) * scale``; normal: Box-Muller on words
    ``2j`` and ``2j + 1`` (``sqrt(-2 ln(1 - u1)) * cos(2 pi u2) * scale``); ``u`` is a word's
    top 53 bits over 2**53. The exact algorithm and test vectors: ``docs/wire-contract.md``.

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
    k = kernels()
    if init.kind == "uniform":
        out = np.empty((n, dim), np.float32)
        k.uniform_rows(seed_key(seed), ids64(ids), float(init.scale), out)
        return out
    u = np.empty((n, 2 * dim), np.float64)
    k.normal_words(seed_key(seed), ids64(ids), u)
    radius = np.sqrt(-2.0 * np.log1p(-u[:, 0::2]))
    return (radius * np.cos(2.0 * np.pi * u[:, 1::2]) * init.scale).astype(np.float32)


class IdIndex:
    """int64 id -> int64 value map: open addressing, linear probing, compiled kernels.

    Keys are ids >= 0; values are row numbers. Slots are (key, value) pairs in one (cap, 2)
    int64 array (16 bytes a slot; one cache line per probe); the capacity is a power of two
    kept at least ``size / MAX_LOAD``, doubled (one rehash, O(size)) when a batch would pass
    it. Deletion is by :meth:`rebuild` (expiry sweeps are rare and whole-table anyway).
    """

    #: Largest size / capacity before the index doubles.
    MAX_LOAD: Final = 0.7

    def __init__(self, capacity: int = 1024) -> None:
        self._slots = self._empty(self._capacity_for(capacity))
        self.size = 0

    @staticmethod
    def _empty(cap: int) -> npt.NDArray[np.int64]:
        return np.full((cap, 2), _EMPTY, np.int64)

    @classmethod
    def _capacity_for(cls, n: int) -> int:
        cap = 16
        while n > cap * cls.MAX_LOAD:
            cap *= 2
        return cap

    @property
    def nbytes(self) -> int:
        """Bytes of the slot array."""
        return int(self._slots.nbytes)

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more ids (doubling as often as needed)."""
        need = self.size + extra
        if need <= self._slots.shape[0] * self.MAX_LOAD:
            return
        new = self._empty(self._capacity_for(need))
        kernels().index_rehash(self._slots, new)
        self._slots = new

    def lookup(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Values of ``ids`` (int64 (n,), each >= 0); -1 where an id is absent."""
        out = np.empty(ids.shape[0], np.int64)
        kernels().index_lookup(self._slots, ids64(ids), out)
        return out

    def insert(self, ids: npt.NDArray[np.int64], vals: npt.NDArray[np.int64]) -> None:
        """Insert distinct ``ids`` that are all absent, with their values (both int64 (m,))."""
        m = ids.shape[0]
        if m == 0:
            return
        self.reserve(m)
        kernels().index_insert(self._slots, ids64(ids), ids64(vals))
        self.size += m

    def find_or_add(
        self, ids: npt.NDArray[np.int64], next_val: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_], int]:
        """Values of distinct ``ids``; absent ones are added with ``next_val``, ``next_val +
        1``, ... in the order given. Returns (values, added mask, count added)."""
        self.reserve(ids.shape[0])
        out = np.empty(ids.shape[0], np.int64)
        created = np.empty(ids.shape[0], np.bool_)
        added = int(kernels().index_find_or_add(self._slots, ids64(ids), next_val, out, created))
        self.size += added
        return out, created, added

    def items(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """All (ids, values), in slot order."""
        used = self._slots[:, 0] != _EMPTY
        return self._slots[used, 0], self._slots[used, 1]

    def rebuild(self, ids: npt.NDArray[np.int64], vals: npt.NDArray[np.int64]) -> None:
        """Replace the contents by distinct ``ids`` -> ``vals``."""
        self._slots = self._empty(self._capacity_for(max(int(ids.shape[0]), 1)))
        self.size = 0
        self.insert(ids, vals)


class RowArena:
    """One per-row field of a table (``shape`` elements of ``dtype`` a row), in chunks.

    Row ``r`` lies in chunk ``r >> shift``; chunks of ``2**shift`` rows are allocated with
    ``np.empty`` when the table grows into them, their pages mapped at once where the OS can
    (:func:`_map_pages_now`); nothing is zero-filled by us, no chunk is ever copied.
    :attr:`addrs` holds each chunk's address for the kernels; the chunks themselves are kept
    alive by :attr:`chunks`.

    Args:
        shape: Elements of one row (``()`` for one scalar a row).
        dtype: Element dtype.
        shift: log2 of the rows per chunk.
        fill: The value of a new row (written by :meth:`fill` for the rows a push creates).
    """

    def __init__(
        self, shape: tuple[int, ...], dtype: np.dtype[np.generic], shift: int, fill: float
    ):
        self.shape = shape
        self.dtype = np.dtype(dtype)
        self.shift = shift
        self.width = int(np.prod(shape, dtype=np.int64))
        self.row_bytes = self.width * self.dtype.itemsize
        self.chunks: list[np.ndarray] = []
        self.addrs = np.zeros(0, np.int64)
        self._fill = np.full(shape, fill, self.dtype).reshape(-1).view(np.uint8).copy()

    @property
    def capacity(self) -> int:
        return len(self.chunks) << self.shift

    def reserve(self, n: int) -> None:
        """Allocate chunks until rows ``[0, n)`` exist (MemoryError when the OS refuses)."""
        while self.capacity < n:
            chunk = np.empty((1 << self.shift, *self.shape), self.dtype)
            _map_pages_now(chunk)
            self.chunks.append(chunk)
        if self.addrs.shape[0] != len(self.chunks):
            self.addrs = np.array([c.ctypes.data for c in self.chunks], np.int64)

    def gather(self, rows: npt.NDArray[np.int64]) -> np.ndarray:
        """A new array (len(rows), *shape) of the rows ``rows``."""
        out = np.empty((rows.shape[0], *self.shape), self.dtype)
        raw = out.reshape(rows.shape[0], self.width).view(np.uint8)
        kernels().gather_bytes(self.addrs, self.shift, ids64(rows), raw)
        return out

    def scatter(self, rows: npt.NDArray[np.int64], values: np.ndarray) -> None:
        """Write ``values`` ((len(rows), *shape), cast to the dtype) at ``rows``."""
        src = np.ascontiguousarray(values, self.dtype).reshape(rows.shape[0], self.width)
        kernels().scatter_bytes(self.addrs, self.shift, ids64(rows), src.view(np.uint8))

    def fill(self, start: int, stop: int) -> None:
        """Write the new-row value into rows ``[start, stop)``."""
        kernels().fill_bytes(self.addrs, self.shift, start, stop, self._fill)


def coalesce_first(
    ids: npt.NDArray[np.int64], grads: npt.ArrayLike
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """Distinct ids in order of first occurrence and their float32 sums (caller's order)."""
    g = np.ascontiguousarray(grads, np.float32)
    n = ids.shape[0]
    uniq = np.empty(n, np.int64)
    sums = np.empty(g.shape, np.float32)
    if n == 0:
        return uniq, sums
    m = int(kernels().coalesce_first(ids64(ids), g, uniq, sums))
    return uniq[:m], sums[:m]


def coalesce(
    ids: npt.NDArray[np.int64], grads: npt.ArrayLike
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """Sum the gradient rows of duplicate ids (as ``torch.Tensor.coalesce``).

    One pass of a compiled kernel with a scratch hash table keyed by id; each id's rows are
    added in the caller's order, in float32.

    Args:
        ids: int64 (n,).
        grads: (n, dim) float array.

    Returns:
        (distinct ids ascending (m,), float32 (m, dim) sums).
    """
    uniq, sums = coalesce_first(ids, grads)
    order = np.argsort(uniq, kind="stable")
    return uniq[order], sums[order]
