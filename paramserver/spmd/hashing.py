"""Deterministic sequence hashes of block contents (the object-tier key of a block).

A *sequence hash* names one block of a token sequence *together with its whole prefix*, as in
vLLM's automatic prefix caching and Dynamo KVBM's ``SequenceHash``: two blocks with the same
tokens but different prefixes get different hashes, so a hash identifies the KV-cache contents.

Definition (version 1), identical in every process, platform and Python run — it never uses
Python's salted ``hash()``::

    H(tokens, parent) = u64_le( BLAKE2b-64( person = b"paramserver-seq1",
                                            data   = tag || prefix || len || body ) )

    tag    = b"T" for token ids, b"B" for raw bytes, b"A" for arrays (content hashes)
    prefix = b"\\x00"                          for the first block of a sequence (no parent)
             b"\\x01" || u64_le(parent)        otherwise
    len    = u64_le(number of tokens)         (or of bytes for content hashes)
    body   = each token id as u64 little-endian, in order (or the raw bytes)

An array's content hash (tag ``b"A"``) hashes its *logical* value, never its memory: ``len`` is
the byte count of its element data and ``body`` is its canonical encoding::

    body = u64_le(len(name)) || name || u64_le(ndim) || u64_le(dim) for each dim || data

    name = the dtype's name in ASCII ("float32", "int64", "bfloat16", "bool", ...)
    data = the elements in little-endian byte order, C (row-major) order

so a big-endian or Fortran-ordered copy of an array has the same key as the original, while
equal bytes of another dtype or shape (the zeros of float32 (4,), int32 (4,) and float32 (2, 2))
get distinct keys. Bytes-like input keeps the raw-bytes definition (tag ``b"B"``), so keys of
byte strings stored by earlier versions are unchanged.

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


def _digest(
    tag: bytes, parent_hash: int | None, length: int, *body: bytes | bytearray | memoryview
) -> int:
    h = hashlib.blake2b(digest_size=8, person=HASH_PERSON)
    h.update(tag)
    if parent_hash is None:
        h.update(b"\x00")
    else:
        if not 0 <= parent_hash <= _U64_MAX:
            raise InvalidArgument(f"parent hash must lie in [0, 2**64), got {parent_hash}")
        h.update(b"\x01" + parent_hash.to_bytes(8, "little"))
    h.update(length.to_bytes(8, "little"))
    for part in body:
        h.update(part)
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


def content_hash(
    data: bytes | bytearray | memoryview | npt.NDArray[np.generic], parent_hash: int | None = None
) -> int:
    """Sequence hash of a block known only by its contents (domain-separated from token hashes).

    Byte strings are hashed as they are. Arrays (and typed buffers, e.g. a ``memoryview`` of an
    array) are hashed by a canonical encoding of their logical value — dtype name, shape and the
    elements as little-endian C-order bytes (module docstring) — so byte order and memory layout
    never change the key, and dtype and shape always do.

    Args:
        data: the block: ``bytes``, ``bytearray``, a byte ``memoryview``, or a numpy array of a
            numeric dtype (bool, integers, floats, complex, ``ml_dtypes`` floats such as
            bfloat16), any shape, any byte order, any memory layout.
        parent_hash: hash of the previous block, or ``None``.

    Returns:
        An integer in ``[0, 2**64)``.

    Raises:
        InvalidArgument: ``data`` is neither bytes-like nor an array, or the array's dtype has
            no canonical encoding (object, string, datetime, structured) (INVALID_ARGUMENT).
    """
    if isinstance(data, bytes | bytearray):
        return _digest(b"B", parent_hash, len(data), data)
    if isinstance(data, memoryview):
        if data.format in ("B", "b", "c") and data.ndim <= 1 and data.contiguous:
            view = data.cast("B")
            return _digest(b"B", parent_hash, view.nbytes, view)
        try:
            data = np.asarray(data)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"content_hash: unsupported buffer ({exc})") from None
    if not isinstance(data, np.ndarray):
        raise InvalidArgument(
            f"content_hash takes bytes, bytearray, memoryview or a numpy array, "
            f"got {type(data).__name__}"
        )
    name, elements = _canonical_array(data)
    header = bytearray(len(name).to_bytes(8, "little") + name)
    header += data.ndim.to_bytes(8, "little")
    for dim in data.shape:
        header += int(dim).to_bytes(8, "little")
    return _digest(b"A", parent_hash, elements.nbytes, bytes(header), elements)


def _canonical_array(arr: npt.NDArray[np.generic]) -> tuple[bytes, memoryview]:
    """(dtype name, little-endian C-order element bytes) of ``arr``."""
    dtype = arr.dtype
    extension = dtype.type.__module__.startswith("ml_dtypes")
    if dtype.fields is not None or (dtype.kind not in "biufc" and not extension):
        raise InvalidArgument(
            f"content_hash: dtype {dtype} has no canonical encoding "
            "(use a bool, integer, float or complex array, or bytes)"
        )
    little = dtype.newbyteorder("<")
    canon = np.asarray(arr.astype(little, order="C", copy=False))
    flat = canon.reshape(-1).view(np.uint8)  # astype(order="C") is C-contiguous: a view
    return little.name.encode("ascii"), flat.data.cast("B")


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
