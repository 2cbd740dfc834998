"""Keep freed memory in the process for reuse (glibc malloc tuning of the daemons).

A server moving large tensors allocates the same large buffers every round: gRPC's receive
buffers (in its I/O threads), a push's receive buffer, a pull's snapshot and wire frames. With
glibc's defaults, blocks of 128 KiB and more are ``mmap``-ed and handed back to the kernel when
freed (and the dynamic threshold never rises past 32 MiB), and free memory at the top of a heap
is trimmed once it passes twice that threshold, so every round maps fresh pages and the kernel
zeroes each one on first touch. Measured here (2 workers, 16e6 float32 push_pull over gRPC, one
ASP shard): ~19k page faults per round (~76 MB of fresh pages), a sixth of the server's CPU
samples in ``clear_page`` and the page-fault paths (``perf``); with freed blocks kept, ~30 faults
per round and 1.26 instead of 0.96 payload GB/s (``benchmarks/push_pull.py``,
``paramserver-net``).

:func:`retain_freed_memory` sets ``M_MMAP_THRESHOLD`` and then ``M_TRIM_THRESHOLD`` (glibc
``mallopt(3)``, the knobs of the ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``
environment variables) to the same value: blocks below it come from the heaps and are reused,
and a heap is trimmed only once more than it lies free at its top. Limits of glibc itself:

- Arenas of threads other than the main one (gRPC's I/O threads, the offload pool) grow in
  heaps of at most 64 MiB: a larger block allocated there is still mapped afresh every time.
- glibc before 2.35 refuses an mmap threshold over 32 MiB; the threshold then applied is the
  cap (the return value says which).

Costs: the resident size stays near its high-water mark instead of shrinking after a burst, each
thread arena may keep up to a heap's worth of freed memory, and fragmentation of the main heap
can raise the peak (measured unchanged here: ``benchmarks/apply_throughput.py``, server RSS per
parameter byte). ``paramserver serve`` calls it at process start (``--malloc-retain-bytes``,
``PARAMSERVER_MALLOC_RETAIN_BYTES``; 0 keeps glibc's defaults); the client library never changes
its host process's allocator on its own (a worker process may call this itself).
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Mapping

logger = logging.getLogger(__name__)

#: Default limit (bytes): blocks up to 512 MiB (128M float32 elements) on the main thread.
DEFAULT_RETAIN_BYTES = 512 << 20
#: Smallest limit accepted: glibc's own default mmap threshold (128 KiB). A lower one would map
#: *more* blocks afresh than the defaults do.
MIN_RETAIN_BYTES = 128 << 10
#: Largest limit accepted (``mallopt`` takes a C int).
MAX_RETAIN_BYTES = 2**31 - 1

#: ``mallopt`` parameter numbers (glibc ``malloc.h``).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: The largest mmap threshold glibc before 2.35 accepts (half its 64 MiB heap size).
_OLD_GLIBC_MMAP_MAX = 32 << 20

#: Environment variables through which a user tunes glibc malloc directly (theirs wins).
_GLIBC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_GLIBC_TUNABLES = (
    "glibc.malloc.mmap_threshold",
    "glibc.malloc.trim_threshold",
    "glibc.malloc.top_pad",
)


def _glibc() -> ctypes.CDLL | None:
    """The C library of this process when it is glibc (None: musl, macOS, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: no ldconfig lookup needed
        libc.gnu_get_libc_version  # noqa: B018  (absent in musl and other C libraries)
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def check_limit(limit_bytes: int) -> None:
    """Refuse a retain limit that would not do what it says.

    Raises:
        ValueError: not 0 and outside [128 KiB, 2 GiB - 1]: below glibc's own 128 KiB mmap
            threshold a limit would map more blocks afresh (a value meant in MiB, say), and
            ``mallopt`` takes a C int.
    """
    if limit_bytes != 0 and not MIN_RETAIN_BYTES <= limit_bytes <= MAX_RETAIN_BYTES:
        raise ValueError(
            f"malloc retain limit must be 0 (glibc's defaults) or {MIN_RETAIN_BYTES} to "
            f"{MAX_RETAIN_BYTES} bytes, got {limit_bytes}"
        )


def user_malloc_settings(env: Mapping[str, str]) -> bool:
    """Whether ``env`` holds the user's own glibc malloc settings (which take precedence)."""
    tunables = env.get("GLIBC_TUNABLES", "")
    return any(name in env for name in _GLIBC_ENV) or any(t in tunables for t in _GLIBC_TUNABLES)


def retain_freed_memory(limit_bytes: int, env: Mapping[str, str]) -> int:
    """Keep freed blocks below ``limit_bytes`` in the heaps for reuse (see the module notes).

    Args:
        limit_bytes: Blocks smaller than this come from (and go back to) the heaps, and a heap
            is trimmed only past this much free memory at its top; 0 changes nothing.
        env: The process environment: when the user set glibc's own malloc variables
            (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``, or
            those tunables in ``GLIBC_TUNABLES``) nothing is changed.

    Returns:
        The mmap threshold now in effect in bytes (``limit_bytes``, or glibc's 32 MiB cap before
        2.35); 0 when nothing was changed: a limit of 0, the user's own settings, no glibc, or
        the threshold refused (then the trim threshold is left alone too).

    Raises:
        ValueError: ``limit_bytes`` neither 0 nor in [:data:`MIN_RETAIN_BYTES`,
            :data:`MAX_RETAIN_BYTES`] (see :func:`check_limit`).
    """
    check_limit(limit_bytes)
    if limit_bytes == 0 or user_malloc_settings(env):
        return 0
    libc = _glibc()
    if libc is None:
        return 0
    applied = 0
    for threshold in dict.fromkeys((limit_bytes, _OLD_GLIBC_MMAP_MAX)):
        if threshold <= limit_bytes and libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(threshold)):
            applied = threshold
            break
    if not applied:
        return 0
    # (Setting either threshold also stops glibc's dynamic adjustment of both.)
    if not libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(applied)):
        logger.warning("mallopt refused a trim threshold of %d bytes", applied)
    return applied
