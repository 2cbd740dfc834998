"""paramserver.server.allocator: freed large blocks stay in the process (counted in page faults),
the
user's own glibc settings win, and the server config carries the limit."""

from __future__ import annotations

import subprocess
import sys

import pytest

from paramserver.errors import InvalidArgument
from paramserver.server.allocator import (
    DEFAULT_RETAIN_BYTES,
    MAX_RETAIN_BYTES,
    MIN_RETAIN_BYTES,
    _glibc,
    retain_freed_memory,
)
from paramserver.server.config import ServerConfig

BLOCK = 64 << 20
PAGES = BLOCK // 4096
ROUNDS = 10

# A fresh process per setting (mallopt is process-wide and sticky): allocate, fill and free a
# 64 MiB block ROUNDS times and print the minor page faults that took.
_PROBE = r"""
import resource, sys
from paramserver.server.allocator import retain_freed_memory
applied = retain_freed_memory(int(sys.argv[1]), {}) if sys.argv[1] != "0" else 0
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(int(sys.argv[2])):
    block = bytearray(int(sys.argv[3]))  # zero-filled: every page touched
    del block
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(limit: int) -> tuple[int, int]:
    """(mmap threshold applied, minor page faults) of the probe in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(limit), str(ROUNDS), str(BLOCK)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    applied, faults = out.stdout.split()
    return int(applied), int(faults)


@pytest.mark.skipif(_glibc() is None, reason="needs glibc malloc")
def test_retained_blocks_are_not_faulted_in_again() -> None:
    _, plain = _faults(0)
    if plain < ROUNDS * PAGES // 2:
        pytest.skip(f"{plain} faults for {ROUNDS} fresh 64 MiB blocks: huge pages here")
    applied, retained = _faults(256 << 20)
    if applied <= BLOCK:
        pytest.skip(f"this glibc caps the mmap threshold at {applied} bytes (before 2.35)")
    assert applied == 256 << 20
    # glibc defaults: every round maps fresh pages (ROUNDS * PAGES faults). Retained: the
    # first round's pages only, reused by the next nine.
    assert retained <= 2 * PAGES
    assert plain >= 4 * retained


def test_user_settings_and_zero_leave_the_allocator_alone() -> None:
    assert retain_freed_memory(0, {}) == 0
    assert retain_freed_memory(1 << 20, {"MALLOC_TRIM_THRESHOLD_": "131072"}) == 0
    assert retain_freed_memory(1 << 20, {"MALLOC_MMAP_THRESHOLD_": "131072"}) == 0
    assert retain_freed_memory(1 << 20, {"MALLOC_TOP_PAD_": "0"}) == 0
    for tunable in ("trim_threshold", "mmap_threshold", "top_pad"):
        env = {"GLIBC_TUNABLES": f"glibc.malloc.{tunable}=131072"}
        assert retain_freed_memory(1 << 20, env) == 0
    # Below glibc's own 128 KiB threshold a limit would map more blocks afresh (a value meant
    # in MiB, say); mallopt takes a C int.
    for bad in (-1, 1, 512, MIN_RETAIN_BYTES - 1, MAX_RETAIN_BYTES + 1):
        with pytest.raises(ValueError, match=f"must be 0 .* got {bad}$"):
            retain_freed_memory(bad, {})


def test_server_config_carries_the_limit() -> None:
    assert ServerConfig.from_sources({}, {}).malloc_retain_bytes == DEFAULT_RETAIN_BYTES
    env = {"PARAMSERVER_MALLOC_RETAIN_BYTES": "0"}
    assert ServerConfig.from_sources({}, env).malloc_retain_bytes == 0
    assert ServerConfig.from_sources({"malloc_retain_bytes": 1 << 20}, env).malloc_retain_bytes == (
        1 << 20
    )
    for bad in (-5, 512):
        with pytest.raises(InvalidArgument, match=f"malloc_retain_bytes: .* got {bad}$"):
            ServerConfig.from_sources({"malloc_retain_bytes": bad}, {})
    assert ServerConfig.from_sources({"malloc_retain_bytes": MIN_RETAIN_BYTES}, {})
