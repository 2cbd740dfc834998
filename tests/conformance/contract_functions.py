"""The id -> shard function and the initial-row function, written from docs/wire-contract.md
alone ("Placement of table rows" and "Initial rows"): plain Python integers, ``hashlib``,
``math`` and ``struct``; nothing from paramserver. The conformance suite checks this against
the test vectors listed in the document and against a live server, so the document, this
re-implementation and the server cannot drift apart.
"""

from __future__ import annotations

import hashlib
import math
import struct

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB

#: Storage dtypes of a table and the width of their bit patterns (hex digits).
HEX_DIGITS = {"float32": 8, "float16": 4, "bfloat16": 4}


def splitmix64(x: int) -> int:
    """SplitMix64's output function on one unsigned 64-bit integer (wrap-around arithmetic)."""
    z = (x + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def table_hash(table: str) -> int:
    """BLAKE2b with an 8-byte digest (no key, salt or personalization) of the name's UTF-8
    bytes, the 8 bytes read as a little-endian unsigned integer."""
    digest = hashlib.blake2b(table.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def hash64(table: str, row_id: int) -> int:
    """``splitmix64(uint64(id) xor table_hash(table))``."""
    return splitmix64((row_id & MASK64) ^ table_hash(table))


def shard_of(table: str, row_id: int, num_shards: int) -> int:
    """The shard that owns ``row_id`` of ``table`` in a cluster of ``num_shards``."""
    return hash64(table, row_id) % num_shards


def word(seed: int, row_id: int, k: int) -> int:
    """Word ``k`` (k = 0, 1, ...) of the random stream of ``row_id`` under ``seed``."""
    key = splitmix64((row_id & MASK64) ^ splitmix64(seed & MASK64))
    return splitmix64((key + (k + 1) * GOLDEN) & MASK64)


def unit(w: int) -> float:
    """The top 53 bits of a word as a float64 in [0, 1) (exact)."""
    return (w >> 11) * 2.0**-53


def initial_float64(kind: str, scale: float, seed: int, row_id: int, column: int) -> float:
    """Column ``column`` of the initial row of ``row_id``, in float64, before any rounding."""
    if kind == "zeros" or scale == 0.0:
        return 0.0
    if kind == "uniform":
        u = unit(word(seed, row_id, column))
        return (2.0 * u - 1.0) * scale
    if kind != "normal":
        raise ValueError(kind)
    u1 = unit(word(seed, row_id, 2 * column))
    u2 = unit(word(seed, row_id, 2 * column + 1))
    radius = math.sqrt(-2.0 * math.log1p(-u1))
    return radius * math.cos(2.0 * math.pi * u2) * scale


def float32_bits(value: float) -> int:
    """float64 -> float32, round to nearest even; the float32's bits."""
    return int(struct.unpack("<I", struct.pack("<f", value))[0])


def storage_bits(value: float, dtype: str) -> int:
    """The stored bits: float64 -> float32 (nearest even), then float32 -> the storage dtype
    (nearest even): two roundings, in that order."""
    bits32 = float32_bits(value)
    if dtype == "float32":
        return bits32
    if dtype == "float16":
        as32 = struct.unpack("<f", struct.pack("<I", bits32))[0]  # exact in float64
        return int(struct.unpack("<H", struct.pack("<e", as32))[0])
    if dtype == "bfloat16":  # keep the high 16 bits, round to nearest even (no NaN arises)
        return (bits32 + 0x7FFF + ((bits32 >> 16) & 1)) >> 16
    raise ValueError(dtype)


def initial_bits(kind: str, scale: float, seed: int, row_id: int, column: int, dtype: str) -> int:
    """The stored bit pattern of column ``column`` of the initial row of ``row_id``."""
    return storage_bits(initial_float64(kind, scale, seed, row_id, column), dtype)
