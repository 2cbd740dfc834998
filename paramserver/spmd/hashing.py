"""Deterministic sequence hashes of block contents (the object-tier key of a block).

A *sequence hash* names one block of a token sequence *together with its whole prefix*, as in
vLLM's automatic prefix caching and Dynamo KVBM's ``SequenceHash``: two blocks with the same
tokens but different prefixes get different hashes, so a hash identifies the KV-cache contents.

Definition (version 1), identical in every process, platform and Python run — it never uses
Python's salted ``hash()``::

    H(tokens, parent) = u64_le( BLAKE2b-64( person = b"paramserver-seq1",
                                            data   = tag || prefix || len || body ) )

    tag    = b"T" for token ids, b"B" for raw bytes (content hashes)
    prefix = b"\\x00"                          for the first block of a sequence (no parent)
             b"\\x01" || u64_le(parent)        otherwise
    len    = u64_le(number of tokens)         (or of bytes for content hashes)
    body   = each token id as u64 little-endian, in order (or the raw bytes)

``u64_le`` is the 8-byte little-endian encoding; the 8-byte digest read little-endian is the
hash, an integer in ``[0, 2**64)``. Object keys are ``"{rank}/{sequence_hash:016x}"``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from paramserver.errors import InvalidArgument

__all__ = [
    "HASH_PERSON",
    "content_hash",
    "object_key",
    "sequence_hash",
    "sequence_hashes",
]

HASH_PERSON = b"paramserver-seq1"
"""BLAKE2b personalization string of version 1 of the hash (16 bytes)."""

_U64_MAX = (1 << 64) - 1

TokenIds = Sequence[int] | npt.NDArray[np.integer]


def _encode_tokens(token_ids: TokenIds) -> bytes:
    if isinstance(token_ids, np.ndarray):
        arr = token_ids
        if arr.ndim != 1:
            raise InvalidArgument(f"token ids must be 1-D, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise InvalidArgument(f"token ids must be integers, got dtype {arr.dtype}")
        if arr.size and arr.dtype.kind == "i" and int(arr.min()) < 0:
            raise InvalidArgument("token ids must lie in [0, 2**64)")
        return np.ascontiguousarray(arr.astype("<u8")).tobytes()
    values: list[int] = []
    for t in token_ids:
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            raise InvalidArgument(f"token id {t!r} is not an integer")
        value = int(t)
        if not 0 <= value <= _U64_MAX:
            raise InvalidArgument(f"token id {value} outside [0, 2**64)")
        values.append(value)
    return np.array(values, dtype="<u8").tobytes()


def _digest(tag: bytes, parent_hash: int | None, length: int, body: bytes | memoryview) -> int:
    h = hashlib.blake2b(digest_size=8, person=HASH_PERSON)
    h.update(tag)
    if parent_hash is None:
        h.update(b"\x00")
    else:
        if not 0 <= parent_hash <= _U64_MAX:
            raise InvalidArgument(f"parent hash must lie in [0, 2**64), got {parent_hash}")
        h.update(b"\x01" + parent_hash.to_bytes(8, "little"))
    h.update(length.to_bytes(8, "little"))
    h.update(body)
    return int.from_bytes(h.digest(), "little")


def sequence_hash(token_ids: TokenIds, parent_hash: int | None = None) -> int:
    """Sequence hash of one block of token ids, chained to its parent block's hash.

    Args:
        token_ids: the block's token ids, 1-D, integers in ``[0, 2**64)``.
        parent_hash: sequence hash of the previous block; ``None`` for the first block.

    Returns:
        The hash, an integer in ``[0, 2**64)`` (see the module docstring for the definition).

    Raises:
        InvalidArgument: non-integer or out-of-range ids, or a bad parent (INVALID_ARGUMENT).
    """
    body = _encode_tokens(token_ids)
    return _digest(b"T", parent_hash, len(body) // 8, body)


def sequence_hashes(
    token_ids: TokenIds, block_size: int, parent_hash: int | None = None
) -> list[int]:
    """Chained sequence hashes of every *full* block of a token sequence.

    Tokens are cut into blocks of ``block_size``; a trailing partial block gets no hash (it is
    not immutable yet), as in vLLM/Dynamo prefix caching.

    Args:
        token_ids: 1-D integer token ids of the whole sequence.
        block_size: tokens per block (the layout's ``page_size``), >= 1.
        parent_hash: hash preceding the first block, ``None`` at the start of a sequence.

    Returns:
        ``len(token_ids) // block_size`` hashes, block ``i`` chained to block ``i - 1``.

    Raises:
        InvalidArgument: ``block_size < 1`` or bad token ids (INVALID_ARGUMENT).
    """
    if block_size < 1:
        raise InvalidArgument(f"block_size must be >= 1, got {block_size}")
    seq = token_ids if isinstance(token_ids, np.ndarray) else list(token_ids)
    out: list[int] = []
    parent = parent_hash
    for start in range(0, (len(seq) // block_size) * block_size, block_size):
        parent = sequence_hash(seq[start : start + block_size], parent)
        out.append(parent)
    return out


def content_hash(data: bytes | bytearray | memoryview, parent_hash: int | None = None) -> int:
    """Sequence hash of a block known only by its bytes (domain-separated from token hashes).

    Args:
        data: the block's raw bytes.
        parent_hash: hash of the previous block, or ``None``.

    Returns:
        An integer in ``[0, 2**64)``.
    """
    view = memoryview(data).cast("B")
    return _digest(b"B", parent_hash, view.nbytes, view)


def object_key(rank: int, seq_hash: int) -> str:
    """The object-tier key of one rank's shard of a block: ``"{rank}/{sequence_hash:016x}"``.

    Raises:
        InvalidArgument: negative rank or a hash outside ``[0, 2**64)`` (INVALID_ARGUMENT).
    """
    if rank < 0:
        raise InvalidArgument(f"rank must be >= 0, got {rank}")
    if not 0 <= seq_hash <= _U64_MAX:
        raise InvalidArgument(f"sequence hash must lie in [0, 2**64), got {seq_hash}")
    return f"{rank}/{seq_hash:016x}"
