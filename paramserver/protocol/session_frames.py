"""Sizes of the ``Session`` stream's messages that both ends agree on.

A pushed or pulled tensor goes inline in a ``SessionRequest``/``SessionResponse`` up to these
sizes; a larger one travels in a shared-memory slot (:mod:`paramserver.protocol.shm`) or in
the frames of the Push and Pull streams.
"""

from __future__ import annotations

#: Pulled values up to this many bytes in total go inline even when a segment is mapped.
SMALL_INLINE_BYTES = 64 << 10
#: Largest inline payload (bytes) of one message: well under a 4 MiB receive limit and under
#: the ~1 MiB frame size of the streams (docs/semantics.md).
MAX_INLINE_BYTES = (1 << 20) - (32 << 10)
