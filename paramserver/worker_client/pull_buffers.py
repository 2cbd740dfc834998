"""Result memory for pulls: a key's last result array is reused once its caller has let go of it.

A training loop replaces its parameters every round (``params = await c.push_pull(...)``), so
the array a pull returned one round is garbage by the next. Returning a fresh array each time
costs more than the copy that fills it: a fresh 64 MB array is fresh pages from the kernel,
each zeroed on first touch (and unmapped again when the array dies), which on the network path
at N = 16e6 is about a sixth of the client's CPU. :class:`PullBuffers` keeps a key's last result
and hands the same memory to the key's next pull when nothing outside it still refers to the
array: CPython's reference count of the array is then exactly the references this module holds
(every numpy view, ``memoryview``, ``torch.from_numpy`` tensor or container holding it counts
as one, so an array anyone can still reach is never reused). To the caller every result is
still a fresh array: no object it can reach changes.

Only arrays of at least :data:`MIN_BYTES` are kept (smaller ones come from the allocator's own
warm free lists at no cost), and only on CPython with the GIL, where reference counts are exact.
The memory kept is at most one result per key that the caller has already dropped;
:meth:`PullBuffers.clear` (the client's ``close``) gives it back.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["MIN_BYTES", "PullBuffers", "refcounts_exact"]

#: Results smaller than this (bytes) are not kept.
MIN_BYTES = 1 << 20


def refcounts_exact() -> bool:
    """True where ``sys.getrefcount`` counts every reference (CPython with the GIL)."""
    if sys.implementation.name != "cpython":
        return False
    gil_enabled = getattr(sys, "_is_gil_enabled", None)
    return gil_enabled is None or bool(gil_enabled())


# References to a kept array while :meth:`PullBuffers.empty` checks it: the local name it was
# popped into, and getrefcount's own argument.
_ONLY_OURS = 2


class PullBuffers:
    """Per-key result arrays of one client, reused once the caller has dropped them.

    Args:
        enabled: False: every result is a new array (``WorkerClient(recycle_pull_buffers=False)``).
        min_bytes: Results smaller than this many bytes are not kept.

    Not thread-safe: one client's pulls run on its event loop thread.
    """

    def __init__(self, *, enabled: bool = True, min_bytes: int = MIN_BYTES) -> None:
        self.enabled = enabled and refcounts_exact()
        self.min_bytes = min_bytes
        self._kept: dict[str, np.ndarray] = {}
        #: Results that reused a kept array (for tests and diagnostics).
        self.reused = 0

    def empty(self, key: str, dtype: np.dtype[Any], shape: Sequence[int]) -> np.ndarray:
        """An uninitialised C-contiguous, writeable array of ``dtype`` and ``shape`` for
        ``key``'s result: the key's kept array when nobody else refers to it any more and it
        still has this dtype and shape, else a new one.

        Raises:
            MemoryError: a new array cannot be allocated.
        """
        kept = self._kept.pop(key, None)
        if (
            kept is not None
            and sys.getrefcount(kept) == _ONLY_OURS
            and kept.dtype == dtype
            and kept.shape == tuple(shape)
            and kept.flags.c_contiguous
            and kept.flags.owndata
        ):
            kept.flags.writeable = True  # (owns its data: always allowed)
            self.reused += 1
            return kept
        del kept  # still someone's (or reshaped by them): theirs alone from now on
        return np.empty(shape, dtype)

    def keep(self, key: str, array: np.ndarray) -> None:
        """Remember ``array`` (just returned to the caller as ``key``'s value) for reuse by the
        key's next pull once the caller drops it."""
        if self.enabled and array.nbytes >= self.min_bytes and array.base is None:
            self._kept[key] = array
        else:
            self._kept.pop(key, None)

    def kept_bytes(self) -> int:
        """Bytes of the arrays kept now (some may still be the caller's)."""
        return sum(a.nbytes for a in self._kept.values())

    def clear(self) -> None:
        """Forget every kept array (their memory goes back once the caller drops them too)."""
        self._kept.clear()
