"""Request ids of one mutation kind (dense pushes, row pushes), numbered so that a resumed
worker repeats its predecessor's.

A server remembers, per registration and kind, the ids it applied (its dedup window) and
answers a request whose id it holds as a duplicate. A worker that replaces a lost predecessor
with ``resume`` takes over that window, so its push of the batch the predecessor pushed but
never clocked (it died between the two) must carry the same id: ids here are a function of the
worker's name, its clock and the push's place among this kind's pushes at that clock.

Layout (62 bits): 20 bits of salt (the name's BLAKE2b hash with ``resume``, else random; random
again after the clock went back: a re-registration that starts at a lower clock must not reuse
the ids of pushes it already made), 26 bits of the clock, 16 bits of the count at that clock
(wrapping; the window remembers far fewer ids than either wraps over).
"""

from __future__ import annotations

import hashlib
import secrets

__all__ = ["RequestIds"]

_SALT_BITS = 20
_CLOCK_BITS = 26
_COUNT_BITS = 16


class RequestIds:
    """The request ids of one kind of push of one worker.

    Args:
        worker_name: The worker's stable name (the salt with ``resume``).
        resume: Number from the name (a successor repeats its predecessor's ids) rather than
            from a random salt (every id new).
    """

    def __init__(self, worker_name: str, resume: bool) -> None:
        if resume:
            digest = hashlib.blake2b(worker_name.encode(), digest_size=8).digest()
            salt = int.from_bytes(digest, "big")
        else:
            salt = secrets.randbits(62)
        self._salt = salt & ((1 << _SALT_BITS) - 1)
        self._clock = 0
        self._count = 0

    def take(self, clock: int, count: int = 1) -> int:
        """The first of ``count`` consecutive ids (one per table of a multi-table push) for
        the next push at ``clock``; the ids ``first .. first + count - 1`` are all of this
        push's.

        Raises:
            ValueError: ``count`` outside [1, 65536].
        """
        if not 1 <= count <= 1 << _COUNT_BITS:
            raise ValueError(f"count must be in [1, {1 << _COUNT_BITS}], got {count}")
        if clock < self._clock:
            self._salt = secrets.randbits(_SALT_BITS)
        if clock != self._clock:
            self._clock, self._count = clock, 0
        n = self._count & ((1 << _COUNT_BITS) - 1)
        if n + count > 1 << _COUNT_BITS:  # consecutive ids must not run into the next clock
            n = 0
        self._count = n + count
        clock_bits = clock & ((1 << _CLOCK_BITS) - 1)
        return (self._salt << (_CLOCK_BITS + _COUNT_BITS)) | (clock_bits << _COUNT_BITS) | n
