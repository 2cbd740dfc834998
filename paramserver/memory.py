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

:func:`retain_freed_memory` sets ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` (glibc
``mallopt(3)``, the same knobs as the ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``
environment variables): blocks below the limit come from the heaps and are reused, and a heap
keeps up to the limit free at its top. The cost is that the process's resident size stays near
its high-water mark instead of shrinking after a burst (its peak is unchanged). The
``paramserver serve`` process calls it at start (``--malloc-retain-bytes``,
``PARAMSERVER_MALLOC_RETAIN_BYTES``; 0 keeps glibc's defaults); the client library never changes
its host process's allocator on its own (a worker process may call this itself).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Mapping

logger = logging.getLogger(__name__)

#: Default limit (bytes): covers tensors up to 512 MiB (128M float32 elements).
DEFAULT_RETAIN_BYTES = 512 << 20

#: ``mallopt`` parameter numbers (glibc ``malloc.h``).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_OLD_GLIBC_MMAP_MAX = 32 << 20

#: Environment variables through which a user tunes glibc malloc directly (theirs wins).
_GLIBC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_GLIBC_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        version = libc.gnu_get_libc_version  # absent in musl and other C libraries
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    return libc


def retain_freed_memory(limit_bytes: int, env: Mapping[str, str]) -> bool:
    """Keep freed blocks below ``limit_bytes`` in the heaps for reuse (see the module notes).

    Args:
        limit_bytes: Blocks smaller than this come from (and return to) the heaps, and a heap
            keeps up to this much free memory at its top; 0 leaves the allocator as it is.
        env: The process environment: when the user set glibc's own malloc variables
            (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``, or
            those tunables in ``GLIBC_TUNABLES``) nothing is changed.

    Returns:
        True when both settings took effect; False with glibc absent (musl, macOS), a limit of
        0, the user's own settings present, or a setting refused.

    Raises:
        ValueError: a negative ``limit_bytes``.
    """
    if limit_bytes < 0:
        raise ValueError(f"malloc retain limit must be >= 0 bytes, got {limit_bytes}")
    if limit_bytes == 0:
        return False
    tunables = env.get("GLIBC_TUNABLES", "")
    if any(name in env for name in _GLIBC_ENV) or any(t in tunables for t in _GLIBC_TUNABLES):
        logger.debug("glibc malloc settings found in the environment: left as they are")
        return False
    libc = _glibc()
    if libc is None:
        return False
    limit = min(limit_bytes, 2**31 - 1)
    if not libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(limit)):
        logger.warning("mallopt refused a trim threshold of %d bytes", limit)
        return False
    if libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(limit)):
        return True
    # glibc before 2.35 caps the mmap threshold at half its heap size (32 MiB on 64-bit):
    # larger blocks then keep being mapped afresh, smaller ones are still retained.
    capped = min(limit, _OLD_GLIBC_MMAP_MAX)
    if libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(capped)):
        logger.info("glibc caps the mmap threshold: blocks over %d bytes are not retained", capped)
        return True
    logger.warning("mallopt refused an mmap threshold of %d bytes", capped)
    return False
