"""Bounded slices of per-key work on the event loop.

A request naming many keys (a 100,000-key push) must not hold the event loop for seconds:
heartbeats would wait unread in the sockets and leases lapse while the workers are alive. Loops
over the keys of one request yield to the event loop every :data:`SLICE_KEYS` keys
(``await asyncio.sleep(0)``); work on many keys that cannot be interleaved runs in a worker
thread (:data:`paramserver.server.apply_threads.OFFLOAD_MIN_KEYS`).
"""

from __future__ import annotations

from typing import Final

__all__ = ["SLICE_KEYS"]

#: Keys handled between two yields to the event loop (about a millisecond of per-key work).
SLICE_KEYS: Final = 256
