"""Result memory for pulls: a key's last result array is reused once its caller has let go of it.

A training loop replaces its parameters every round (``params = await c.push_pull(...)``), so
the array a pull returned one round is garbage by the next. Returning a fresh array each time
costs more than the copy that fills it: a fresh 64 MB array is fresh pages from the kernel,
each zeroed on first touch (and unmapped again when the array dies), which on the network path
at N = 16e6 is about a sixth of the client's CPU. :class:`PullBuffers` keeps a key's last
results and hands one of them to the key's next pull when nothing outside it still refers to
that array: CPython's reference count of the array is then exactly the references this module holds
(every numpy view, ``memoryview``, ``torch.from_numpy`` tensor or container holding it counts
as one, so an array anyone can still reach is never reused). To the caller every result is
still a fresh array: no object it can reach changes.

The last :data:`DEPTH` (two) results of a key are kept, so the usual loop
``params = await client.push_pull(grads)`` — whose previous ``params`` is still bound while
the next call runs — reuses the result of two rounds ago. Only arrays of at least
:data:`MIN_BYTES` are kept (smaller ones come from the allocator's warm free lists at no cost),
at most ``max_bytes`` in all, and only on CPython with the GIL, where reference counts are
exact. The price is memory: between pulls the client may hold a result its caller has already
dropped (at most one per key in that loop) instead of giving it back to the system; the peak
during a pull is unchanged. :meth:`PullBuffers.clear` (the client's ``close``) lets it go.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["DEFAULT_MAX_BYTES", "DEPTH", "MIN_BYTES", "PullBuffers", "refcounts_exact"]

#: Results smaller than this (bytes) are not kept.
MIN_BYTES = 1 << 20


def refcounts_exact() -> bool:
    """True where ``sys.getrefcount`` counts every reference (CPython with the GIL)."""
    if sys.implementation.name != "cpython":
        return False
    gil_enabled = getattr(sys, "_is_gil_enabled", None)
    return gil_enabled is None or bool(gil_enabled())


#: Results kept per key: the last two, so that ``params = await client.pull()`` — which still
#: holds the previous result while the next pull runs — reuses the one from two pulls ago.
DEPTH = 2
#: Default bound (bytes) on the results kept, all keys together.
DEFAULT_MAX_BYTES = 1 << 30

# References to a kept array while :meth:`PullBuffers.empty` checks it: its slot in the key's
# list, the local name, and getrefcount's own argument.
_ONLY_OURS = 3


class PullBuffers:
    """Per-key result arrays of one client, reused once the caller has dropped them.

    Args:
        enabled: False: every result is a new array (``WorkerClient(recycle_pull_buffers=False)``).
        min_bytes: Results smaller than this many bytes are not kept.
        max_bytes: At most this many bytes of results are kept, all keys together (the oldest
            of a key goes first). Between pulls the client may hold up to this much memory its
            caller has already dropped; during a pull the peak is what it was without reuse.

    Not thread-safe: one client's pulls run on its event loop thread.
    """

    def __init__(
        self,
        *,
        enabled: bool = True,
        min_bytes: int = MIN_BYTES,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.enabled = enabled and refcounts_exact()
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self._kept: dict[str, list[np.ndarray]] = {}  # key -> its last results, oldest first
        self._bytes = 0
        #: Results that reused a kept array (for tests and diagnostics).
        self.reused = 0

    def empty(self, key: str, dtype: np.dtype[Any], shape: Sequence[int]) -> np.ndarray:
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
            while i < len(slots):  # (no enumerate: its cached tuple would hold a reference)
                kept = slots[i]
                if sys.getrefcount(kept) != _ONLY_OURS:
                    i += 1  # still the caller's: it may drop it later
                    continue
                del slots[i]
                self._bytes -= kept.nbytes
                if (
                    kept.dtype == dtype
                    and kept.shape == shape
                    and kept.flags.c_contiguous
                    and kept.flags.owndata
                ):
                    kept.flags.writeable = True  # (owns its data: always allowed)
                    self.reused += 1
                    return kept
                # dropped after being reshaped or retyped in place: let it go
            del kept
        return np.empty(shape, dtype)

    def keep(self, key: str, array: np.ndarray) -> None:
        """Remember ``array`` (just returned to the caller as ``key``'s value) for reuse by a
        later pull of the key once the caller drops it."""
        if not self.enabled or array.nbytes < self.min_bytes or array.base is not None:
            return
        slots = self._kept.setdefault(key, [])
        slots.append(array)
        self._bytes += array.nbytes
        while slots and (len(slots) > DEPTH or self._bytes > self.max_bytes):
            self._bytes -= slots.pop(0).nbytes
        if not slots:
            del self._kept[key]

    def kept_bytes(self) -> int:
        """Bytes of the arrays kept now (some may still be the caller's)."""
        return self._bytes

    def clear(self) -> None:
        """Forget every kept array (their memory goes back once the caller drops them too)."""
        self._kept.clear()
        self._bytes = 0
