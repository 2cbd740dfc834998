"""Result memory for pulls: a key's last result array is reused once its caller has let go of it.

A training loop replaces its parameters every round (``params = await c.push_pull(...)``), so
the array a pull returned one round is garbage by the next. Returning a fresh array each time
costs more than the copy that fills it: a fresh 64 MB array is fresh pages from the kernel,
each zeroed on first touch (and unmapped again when the array dies), which on the network path
at N = 16e6 is about a sixth of the client's CPU. :class:`PullBuffers` keeps a key's last
results and hands one of them to the key's next pull when nothing outside this module refers to
that array any more: its CPython reference count is then exactly this module's (every numpy
view, ``memoryview``, ``torch.from_numpy`` tensor or container holding it counts as one) and it
has no weak references (a ``weakref``, ``WeakValueDictionary`` entry or ``weakref.finalize``
keeps it from reuse too). To the caller every result is still a fresh array: no object it can
reach changes. The count is calibrated at import rather than assumed (CPython 3.14 passes some
references borrowed), and reuse is off where it cannot be trusted (other interpreters, the
free-threaded build without the GIL).

The last :data:`DEPTH` (two) results of a key are kept, so the usual loop
``params = await client.push_pull(grads)`` — whose previous ``params`` is still bound while
the next call runs — reuses the result of two rounds ago. Only arrays of at least
:data:`MIN_BYTES` are kept (smaller ones come from the allocator's warm free lists at no cost),
at most ``max_bytes`` per client, and only where reference counts can be trusted.

What it costs:

- memory: the client may hold results its caller has already dropped (up to ``max_bytes``; one
  per key in that loop) instead of giving them back to the system, between pulls and during
  them. :meth:`PullBuffers.clear` (the client's ``close``) lets them go. A sharded client's
  per-shard clients each keep their own; a tensor split across shards is reassembled into a new
  array (its per-shard pieces are what is reused).
- ``ndarray.resize`` with its default reference check refuses a kept result (the client's
  reference counts); copy it first, or turn reuse off.
- memory a dropped result occupied is written by a later pull: a consumer still reading it
  through a raw pointer it kept no reference for (zero-copy sends, pinned-memory DMA) sees new
  values, as it could after any allocator reuse.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence

import numpy as np

from paramserver.errors import InvalidArgument

__all__ = ["DEFAULT_MAX_BYTES", "DEPTH", "MIN_BYTES", "PullBuffers", "refcounts_exact"]

#: Results smaller than this (bytes) are not kept.
MIN_BYTES = 1 << 20


def _slot_refcount(slots: Sequence[object], i: int) -> int:
    """``sys.getrefcount`` of ``slots[i]`` read through a temporary (a strong reference on
    every CPython, unlike a local name, which 3.14+ may pass borrowed)."""
    return sys.getrefcount(slots[i])


def _calibrate() -> int | None:
    """What :func:`_slot_refcount` reads for an object only a list holds, or None when a second
    reference does not read exactly one more (reference counts cannot be trusted here)."""
    probe: list[object] = [object()]
    alone = _slot_refcount(probe, 0)
    other = probe[0]
    shared = _slot_refcount(probe, 0)
    del other
    return alone if shared == alone + 1 else None


def refcounts_exact() -> bool:
    """True where reference counts tell whether anyone else holds an array: CPython with the
    GIL, where a second reference reads exactly one more."""
    if sys.implementation.name != "cpython":
        return False
    gil_enabled = getattr(sys, "_is_gil_enabled", None)
    if gil_enabled is not None and not gil_enabled():
        return False
    return _ONLY_OURS is not None


#: Results kept per key: the last two, so that ``params = await client.pull()`` — which still
#: holds the previous result while the next pull runs — reuses the one from two pulls ago.
DEPTH = 2
#: Default bound (bytes) on the results kept, all keys together.
DEFAULT_MAX_BYTES = 1 << 30

# What _slot_refcount reads for a kept array nobody else refers to (its slot in the key's list
# and the temporary), measured rather than assumed: CPython versions count differently.
_ONLY_OURS = _calibrate()


class PullBuffers:
    """Per-key result arrays of one client, reused once the caller has dropped them.

    Args:
        enabled: False: every result is a new array (``WorkerClient(recycle_pull_buffers=False)``).
        min_bytes: Results smaller than this many bytes are not kept.
        max_bytes: At most this many bytes of results are kept, all keys together (the oldest
            of a key goes first). The client may hold up to this much memory its caller has
            already dropped, between pulls and during them.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) ``min_bytes`` or ``max_bytes`` is not an int >= 0.

    Not thread-safe: one client's pulls run on its event loop thread.
    """

    def __init__(
        self,
        *,
        enabled: bool = True,
        min_bytes: int = MIN_BYTES,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        for name, value in (("min_bytes", min_bytes), ("max_bytes", max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(
                    f"pull buffers: {name} must be an int >= 0 (bytes), got {value!r}"
                )
        self.enabled = enabled and refcounts_exact()
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        # key -> its last results with their sizes when kept, oldest first
        self._kept: dict[str, list[np.ndarray]] = {}
        self._sizes: dict[str, list[int]] = {}
        self._bytes = 0
        #: Results that reused a kept array (for tests and diagnostics).
        self.reused = 0

    def _only_ours(self, slots: list[np.ndarray], i: int) -> bool:
        """Nothing but this module refers to ``slots[i]``: no reference (views, memoryviews,
        containers, tensors) and no weak reference."""
        return _slot_refcount(slots, i) == _ONLY_OURS and weakref.getweakrefcount(slots[i]) == 0

    def _drop(self, key: str, i: int) -> np.ndarray:
        self._bytes -= self._sizes[key].pop(i)
        return self._kept[key].pop(i)

    def empty(self, key: str, dtype: np.dtype[np.generic], shape: Sequence[int]) -> np.ndarray:
        """An uninitialised C-contiguous, writeable array of ``dtype`` and ``shape`` for
        ``key``'s result: one of the key's kept arrays that nobody else refers to any more
        and that still has this dtype and shape, else a new one.

        Raises:
            MemoryError: a new array cannot be allocated.
        """
        slots = self._kept.get(key)
        if slots:
            shape = tuple(shape)
            i = 0
            while i < len(slots):
                if not self._only_ours(slots, i):
                    i += 1  # still the caller's: it may drop it later
                    continue
                kept = self._drop(key, i)
                if (
                    kept.dtype == dtype
                    and kept.shape == shape
                    and kept.flags.c_contiguous
                    and kept.flags.owndata
                ):
                    kept.flags.writeable = True  # (owns its data: always allowed)
                    self.reused += 1
                    return kept
                del kept  # dropped after being reshaped or retyped in place: let it go
        return np.empty(shape, dtype)

    def keep(self, key: str, array: np.ndarray) -> None:
        """Remember ``array`` (just returned to the caller as ``key``'s value) for reuse by a
        later pull of the key once the caller drops it."""
        if not self.enabled or array.nbytes < self.min_bytes or array.base is not None:
            return
        slots = self._kept.setdefault(key, [])
        sizes = self._sizes.setdefault(key, [])
        slots.append(array)
        sizes.append(array.nbytes)
        self._bytes += array.nbytes
        while slots and (len(slots) > DEPTH or self._bytes > self.max_bytes):
            self._drop(key, 0)
        if not slots:
            del self._kept[key], self._sizes[key]

    def kept_bytes(self) -> int:
        """Bytes of the arrays kept now (some may still be the caller's)."""
        return self._bytes

    def clear(self) -> None:
        """Forget every kept array (their memory goes back once the caller drops them too)."""
        self._kept.clear()
        self._sizes.clear()
        self._bytes = 0
