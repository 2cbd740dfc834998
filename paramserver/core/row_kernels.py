"""Compiled kernels of the embedding-table row path (numba, GIL released, cached on disk).

Every per-id step of :mod:`paramserver.core.tables` runs here as one loop over the request:
the open-addressing id index (lookup, insert, find-or-add, rehash), the initial rows (the
counter-based generator of ``docs/wire-contract.md``, bit for bit), gather, duplicate
coalescing, the row-wise rules (sgd, adagrad, rowwise adagrad, lazy adam) and scatter. Stored
rows live in fixed-size chunks (:class:`paramserver.core.row_store.RowArena`), each reached through
its address: ``row r`` of a field is at ``addrs[r >> shift] + (r & mask) * row_bytes``, so a
table grows by one chunk at a time and nothing is ever copied or zero-filled on growth.

numba is chosen over a C extension by measurement (issue 30): the same kernels in one process
run 6.0M rows/s at dim 64, and numba's on-disk cache (``cache=True``, next to this file or in
``NUMBA_CACHE_DIR``) makes a process after the first load them in well under a second; the
first compile of the whole set is measured in ``benchmarks/RESULTS.md``. All kernels are
``nogil``: a caller may run them from a thread while the event loop goes on.

The integer arithmetic is uint64 with wrap-around (numba's, as numpy's); every constant is
typed explicitly, as numba widens mixed int64/uint64 arithmetic to float64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba
import numpy as np
import numpy.typing as npt
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = [
    "EMPTY",
    "apply_adagrad",
    "apply_adam",
    "apply_rowwise_adagrad",
    "apply_sgd",
    "coalesce_first",
    "create_rows_f32",
    "fill_bytes",
    "gather_bytes",
    "gather_f32",
    "index_find_or_add",
    "index_insert",
    "index_lookup",
    "index_rehash",
    "normal_words",
    "pull_f32",
    "scatter_bytes",
    "stamp",
    "uniform_rows",
]

EMPTY = np.int64(-1)  # ids are >= 0, so -1 marks a free slot of the index

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S11 = np.uint64(11)
_ONE = np.uint64(1)
_INV53 = 1.0 / 9007199254740992.0

# Initializer codes of the kernels (``zeros`` rows are written as zeros).
INIT_ZEROS = 0
INIT_UNIFORM = 1
INIT_OTHER = 2  # computed by the caller (normal): the kernel reports the missing rows

_F = TypeVar("_F", bound=Callable[..., object])

# The arrays the kernels take (numba compiles one specialization per argument type; these
# are the types the callers pass).
_I64s = npt.NDArray[np.int64]
_F32s = npt.NDArray[np.float32]
_F64s = npt.NDArray[np.float64]
_U8s = npt.NDArray[np.uint8]
_Int = int | np.int64


def _jit(**extra: object) -> Callable[[_F], _F]:
    """``numba.njit`` with the GIL released and the machine code cached on disk."""
    return cast(Callable[[_F], _F], numba.njit(nogil=True, cache=True, **extra))


def _voidptr_typer(typingctx: Any, addr: Any) -> Any:
    """An int64 address as a ``void *`` (for ``numba.carray``)."""
    sig = types.voidptr(types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return sig, codegen


_voidptr = intrinsic(_voidptr_typer)


@_jit(inline="always")
def _mix(x: np.uint64) -> np.uint64:
    """SplitMix64's finalizer of a uint64 (Steele et al. 2014)."""
    z = x + _GOLDEN
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@_jit(inline="always")
def _f32_row(addrs: _I64s, shift: int, r: _Int, width: int) -> _F32s:
    mask = (np.int64(1) << shift) - 1
    ptr = addrs[r >> shift] + (r & mask) * width * 4
    row: _F32s = numba.carray(_voidptr(ptr), (width,), np.float32)
    return row


@_jit(inline="always")
def _i64_row(addrs: _I64s, shift: int, r: _Int) -> _I64s:
    mask = (np.int64(1) << shift) - 1
    cell: _I64s = numba.carray(_voidptr(addrs[r >> shift] + (r & mask) * 8), (1,), np.int64)
    return cell


@_jit(inline="always")
def _f64_row(addrs: _I64s, shift: int, r: _Int) -> _F64s:
    mask = (np.int64(1) << shift) - 1
    cell: _F64s = numba.carray(_voidptr(addrs[r >> shift] + (r & mask) * 8), (1,), np.float64)
    return cell


@_jit(inline="always")
def _u8_row(addrs: _I64s, shift: int, r: _Int, row_bytes: int) -> _U8s:
    mask = (np.int64(1) << shift) - 1
    ptr = addrs[r >> shift] + (r & mask) * row_bytes
    row: _U8s = numba.carray(_voidptr(ptr), (row_bytes,), np.uint8)
    return row


# ------------------------------------------------------------------------------ id index
@_jit(inline="always")
def _slot(key: _Int, mask: int) -> np.int64:
    return np.int64(_mix(np.uint64(key)) & np.uint64(mask))


@_jit()
def index_lookup(slots: _I64s, ids: _I64s, out: _I64s) -> None:
    """``out[i]`` = the value of ``ids[i]`` in the index ``slots`` ((cap, 2) int64: key,
    value; cap a power of two), or -1 when absent."""
    mask = slots.shape[0] - 1
    for i in range(ids.shape[0]):
        key = ids[i]
        s = _slot(key, mask)
        while True:
            k = slots[s, 0]
            if k == key:
                out[i] = slots[s, 1]
                break
            if k == EMPTY:
                out[i] = -1
                break
            s = (s + 1) & mask


@_jit()
def index_insert(slots: _I64s, ids: _I64s, vals: _I64s) -> None:
    """Insert distinct absent ``ids`` with ``vals`` (the caller keeps the load below 1)."""
    mask = slots.shape[0] - 1
    for i in range(ids.shape[0]):
        s = _slot(ids[i], mask)
        while slots[s, 0] != EMPTY:
            s = (s + 1) & mask
        slots[s, 0] = ids[i]
        slots[s, 1] = vals[i]


@_jit()
def index_find_or_add(
    slots: _I64s, ids: _I64s, next_val: int, out: _I64s, created: npt.NDArray[np.bool_]
) -> int:
    """For distinct ``ids``: ``out[i]`` = the value of a present id; an absent one is added
    with the next value from ``next_val`` on (``created[i]`` True). Returns how many were
    added (room for all of them is the caller's)."""
    mask = slots.shape[0] - 1
    added = 0
    for i in range(ids.shape[0]):
        key = ids[i]
        s = _slot(key, mask)
        while True:
            k = slots[s, 0]
            if k == key:
                out[i] = slots[s, 1]
                created[i] = False
                break
            if k == EMPTY:
                slots[s, 0] = key
                slots[s, 1] = next_val + added
                out[i] = next_val + added
                created[i] = True
                added += 1
                break
            s = (s + 1) & mask
    return added


@_jit()
def index_rehash(old: _I64s, new: _I64s) -> None:
    """Move every entry of the index ``old`` into the empty index ``new``."""
    mask = new.shape[0] - 1
    for j in range(old.shape[0]):
        key = old[j, 0]
        if key == EMPTY:
            continue
        s = _slot(key, mask)
        while new[s, 0] != EMPTY:
            s = (s + 1) & mask
        new[s, 0] = key
        new[s, 1] = old[j, 1]


# ------------------------------------------------------------------------------ initial rows
@_jit(inline="always")
def _uniform_into(seed_key: np.uint64, key_id: _Int, scale: float, out: _F32s) -> None:
    key = _mix(np.uint64(key_id) ^ seed_key)
    for j in range(out.shape[0]):
        bits = _mix(key + np.uint64(j + 1) * _GOLDEN)
        u = np.float64(bits >> _S11) * _INV53
        out[j] = np.float32((2.0 * u - 1.0) * scale)


@_jit()
def uniform_rows(seed_key: np.uint64, ids: _I64s, scale: float, out: _F32s) -> None:
    """The uniform initial rows of ``ids`` into float32 ``out`` (n, dim): word ``k`` of id
    ``i`` is ``splitmix64(key_i + (k + 1) * golden)``, ``key_i = splitmix64(uint64(i) xor
    seed_key)``, the value ``float32((2u - 1) * scale)`` with ``u`` its top 53 bits."""
    for i in range(ids.shape[0]):
        _uniform_into(seed_key, ids[i], scale, out[i])


@_jit()
def normal_words(seed_key: np.uint64, ids: _I64s, out: _F64s) -> None:
    """The uniform variates ``u`` (float64 (n, 2 dim)) the normal initializer's Box-Muller
    transform takes (the transform itself stays in numpy, whose transcendental functions the
    contract's values were computed with)."""
    for i in range(ids.shape[0]):
        key = _mix(np.uint64(ids[i]) ^ seed_key)
        for j in range(out.shape[1]):
            bits = _mix(key + np.uint64(j + 1) * _GOLDEN)
            out[i, j] = np.float64(bits >> _S11) * _INV53


# ------------------------------------------------------------------------------ rows
@_jit()
def pull_f32(
    slots: _I64s,
    addrs: _I64s,
    shift: int,
    ids: _I64s,
    seed_key: np.uint64,
    scale: float,
    init: int,
    out: _F32s,
    missing: _I64s,
) -> int:
    """Rows of ``ids`` of a float32 table into ``out`` (n, dim): stored rows copied, others
    their initial row (zeros/uniform here; INIT_OTHER: listed in ``missing`` for the caller).
    Returns how many positions ``missing`` holds."""
    mask = slots.shape[0] - 1
    dim = out.shape[1]
    m = 0
    for i in range(ids.shape[0]):
        key = ids[i]
        s = _slot(key, mask)
        r = np.int64(-1)
        while True:
            k = slots[s, 0]
            if k == key:
                r = slots[s, 1]
                break
            if k == EMPTY:
                break
            s = (s + 1) & mask
        if r >= 0:
            src = _f32_row(addrs, shift, r, dim)
            for j in range(dim):
                out[i, j] = src[j]
        elif init == INIT_UNIFORM:
            _uniform_into(seed_key, key, scale, out[i])
        elif init == INIT_ZEROS:
            for j in range(dim):
                out[i, j] = 0.0
        else:
            missing[m] = i
            m += 1
    return m


@_jit()
def create_rows_f32(
    addrs: _I64s,
    shift: int,
    dim: int,
    rows: _I64s,
    ids: _I64s,
    seed_key: np.uint64,
    scale: float,
    init: int,
) -> None:
    """Write the initial rows (INIT_ZEROS or INIT_UNIFORM) of new ``ids`` at ``rows`` of a
    float32 arena of width ``dim``."""
    for i in range(rows.shape[0]):
        dst = _f32_row(addrs, shift, rows[i], dim)
        if init == INIT_UNIFORM:
            _uniform_into(seed_key, ids[i], scale, dst)
        else:
            for j in range(dim):
                dst[j] = 0.0


@_jit()
def gather_f32(addrs: _I64s, shift: int, rows: _I64s, out: _F32s) -> None:
    """``out[i] = field[rows[i]]`` for a float32 field of width ``out.shape[1]``."""
    width = out.shape[1]
    for i in range(rows.shape[0]):
        src = _f32_row(addrs, shift, rows[i], width)
        for j in range(width):
            out[i, j] = src[j]


@_jit()
def gather_bytes(addrs: _I64s, shift: int, rows: _I64s, out: _U8s) -> None:
    """``out[i] = field[rows[i]]`` as raw bytes (``out`` uint8 (n, row_bytes))."""
    row_bytes = out.shape[1]
    for i in range(rows.shape[0]):
        src = _u8_row(addrs, shift, rows[i], row_bytes)
        for j in range(row_bytes):
            out[i, j] = src[j]


@_jit()
def scatter_bytes(addrs: _I64s, shift: int, rows: _I64s, src: _U8s) -> None:
    """``field[rows[i]] = src[i]`` as raw bytes (``src`` uint8 (n, row_bytes))."""
    row_bytes = src.shape[1]
    for i in range(rows.shape[0]):
        dst = _u8_row(addrs, shift, rows[i], row_bytes)
        for j in range(row_bytes):
            dst[j] = src[i, j]


@_jit()
def fill_bytes(addrs: _I64s, shift: int, start: int, stop: int, pattern: _U8s) -> None:
    """``field[r] = pattern`` (uint8 (row_bytes,)) for rows ``start <= r < stop``."""
    row_bytes = pattern.shape[0]
    for r in range(start, stop):
        dst = _u8_row(addrs, shift, r, row_bytes)
        for j in range(row_bytes):
            dst[j] = pattern[j]


@_jit()
def stamp(
    clock_addrs: _I64s, s_addrs: _I64s, shift: int, rows: _I64s, clock: int, now_s: float
) -> None:
    """Record the clock and time of a push on ``rows`` (expiry bookkeeping)."""
    for i in range(rows.shape[0]):
        _i64_row(clock_addrs, shift, rows[i])[0] = clock
        _f64_row(s_addrs, shift, rows[i])[0] = now_s


# ------------------------------------------------------------------------------ coalesce
@_jit()
def coalesce_first(ids: _I64s, grads: _F32s, uniq: _I64s, sums: _F32s) -> int:
    """Sum the float32 rows of duplicate ids in the caller's order: ``uniq[:m]`` the distinct
    ids in order of first occurrence, ``sums[:m]`` their sums; returns m."""
    n = ids.shape[0]
    dim = grads.shape[1]
    cap = 16
    while cap < 2 * n:
        cap *= 2
    mask = cap - 1
    local = np.full(cap, -1, np.int64)
    m = 0
    for i in range(n):
        key = ids[i]
        s = _slot(key, mask)
        while True:
            k = local[s]
            if k == -1:
                local[s] = m
                uniq[m] = key
                for j in range(dim):
                    sums[m, j] = grads[i, j]
                m += 1
                break
            if uniq[k] == key:
                for j in range(dim):
                    sums[k, j] += grads[i, j]
                break
            s = (s + 1) & mask
    return m


# ------------------------------------------------------------------------------ rules
@_jit()
def apply_sgd(addrs: _I64s, shift: int, rows: _I64s, g: _F32s, lr: np.float32) -> None:
    """``w -= lr * g`` on the float32 rows ``rows`` (lr float32)."""
    dim = g.shape[1]
    for i in range(rows.shape[0]):
        w = _f32_row(addrs, shift, rows[i], dim)
        for j in range(dim):
            w[j] -= lr * g[i, j]


@_jit()
def apply_adagrad(
    addrs: _I64s,
    acc_addrs: _I64s,
    shift: int,
    rows: _I64s,
    g: _F32s,
    lr: np.float32,
    eps: np.float32,
) -> None:
    """Element-wise adagrad (torch.optim.Adagrad; Duchi et al. 2011), float32."""
    dim = g.shape[1]
    for i in range(rows.shape[0]):
        w = _f32_row(addrs, shift, rows[i], dim)
        acc = _f32_row(acc_addrs, shift, rows[i], dim)
        for j in range(dim):
            gj = g[i, j]
            acc[j] += gj * gj
            w[j] -= lr * gj / (np.sqrt(acc[j]) + eps)


@_jit()
def apply_rowwise_adagrad(
    addrs: _I64s,
    acc_addrs: _I64s,
    shift: int,
    rows: _I64s,
    g: _F32s,
    lr: np.float32,
    eps: np.float32,
) -> None:
    """Row-wise adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD): one accumulator per row, the mean
    of the squared gradient over the row, float32."""
    dim = g.shape[1]
    inv = np.float32(dim)
    for i in range(rows.shape[0]):
        w = _f32_row(addrs, shift, rows[i], dim)
        acc = _f32_row(acc_addrs, shift, rows[i], 1)
        total = np.float32(0.0)
        for j in range(dim):
            total += g[i, j] * g[i, j]
        acc[0] += total / inv
        den = np.sqrt(acc[0]) + eps
        for j in range(dim):
            w[j] -= lr * g[i, j] / den


@_jit()
def apply_adam(
    addrs: _I64s,
    m_addrs: _I64s,
    v_addrs: _I64s,
    steps_addrs: _I64s,
    shift: int,
    rows: _I64s,
    g: _F32s,
    lr: float,
    beta1: float,
    beta2: float,
    eps: np.float32,
) -> None:
    """Lazy adam (torch.optim.SparseAdam's arithmetic, the step counted per row), float32."""
    dim = g.shape[1]
    one_b1 = np.float32(1.0 - beta1)
    one_b2 = np.float32(1.0 - beta2)
    for i in range(rows.shape[0]):
        r = rows[i]
        w = _f32_row(addrs, shift, r, dim)
        m = _f32_row(m_addrs, shift, r, dim)
        v = _f32_row(v_addrs, shift, r, dim)
        st = _i64_row(steps_addrs, shift, r)
        st[0] += 1
        t = np.float64(st[0])
        step_size = np.float32(lr * np.sqrt(1.0 - beta2**t) / (1.0 - beta1**t))
        for j in range(dim):
            gj = g[i, j]
            m[j] += (gj - m[j]) * one_b1
            v[j] += (gj * gj - v[j]) * one_b2
            w[j] -= step_size * (m[j] / (np.sqrt(v[j]) + eps))
