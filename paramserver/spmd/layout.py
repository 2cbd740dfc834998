"""Block layouts and storage tiers of the SPMD block-transfer layer (docs/spmd.md).

A layout describes one fully contiguous, block-major pool: ``num_blocks`` blocks, each of shape
``[num_layers, outer_dim, page_size, inner_dim]`` and element type ``dtype``. Because the pool
is block-major, block ``b`` is the single byte span
``[b * bytes_per_block, (b + 1) * bytes_per_block)`` of the pool, in host memory (G2), in the
pool file on disk (G3) or on the device (G1). After Dynamo KVBM's fully contiguous layout.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from paramserver.api.v1 import spmd_pb2
from paramserver.errors import InvalidArgument

__all__ = ["DTYPES", "Layout", "Tier", "parse_layout_spec"]


class Tier(enum.IntEnum):
    """Storage tier of a block pool; values equal the wire enum ``paramserver.api.v1.Tier``."""

    G1 = 1
    """Accelerator memory; registered only where a GPU is present."""
    G2 = 2
    """Host memory in a POSIX shared-memory segment (a same-host peer can map it)."""
    G3 = 3
    """Disk: one file per layout, block ``b`` at byte offset ``b * bytes_per_block``."""
    G4 = 4
    """Object store, keys ``"{rank}/{sequence_hash:016x}"``; never a local-transfer endpoint."""

    @property
    def wire(self) -> spmd_pb2.Tier.ValueType:
        """The wire enum value (``paramserver.api.v1.Tier``)."""
        return spmd_pb2.Tier.ValueType(self.value)

    @classmethod
    def parse(cls, value: Tier | int | str) -> Tier:
        """Accept a :class:`Tier`, its integer value, or a name such as ``"G2"`` / ``"host"``.

        Raises:
            InvalidArgument: unknown tier (INVALID_ARGUMENT).
        """
        if isinstance(value, Tier):
            return value
        if isinstance(value, int):
            try:
                return cls(value)
            except ValueError:
                raise InvalidArgument(f"unknown tier {value}") from None
        aliases = {"device": cls.G1, "host": cls.G2, "disk": cls.G3, "object": cls.G4}
        name = value.strip()
        if name.lower() in aliases:
            return aliases[name.lower()]
        try:
            return cls[name.upper()]
        except KeyError:
            raise InvalidArgument(f"unknown tier {value!r} (expected G1..G4)") from None


DTYPES: Mapping[str, tuple[np.dtype[np.generic], spmd_pb2.BlockDType.ValueType]] = {
    "float16": (np.dtype(np.float16), spmd_pb2.BLOCK_D_TYPE_FLOAT16),
    "bfloat16": (np.dtype(ml_dtypes.bfloat16), spmd_pb2.BLOCK_D_TYPE_BFLOAT16),
    "float32": (np.dtype(np.float32), spmd_pb2.BLOCK_D_TYPE_FLOAT32),
    "float64": (np.dtype(np.float64), spmd_pb2.BLOCK_D_TYPE_FLOAT64),
    "int8": (np.dtype(np.int8), spmd_pb2.BLOCK_D_TYPE_INT8),
    "uint8": (np.dtype(np.uint8), spmd_pb2.BLOCK_D_TYPE_UINT8),
    "int32": (np.dtype(np.int32), spmd_pb2.BLOCK_D_TYPE_INT32),
    "int64": (np.dtype(np.int64), spmd_pb2.BLOCK_D_TYPE_INT64),
    "float8_e4m3fn": (np.dtype(ml_dtypes.float8_e4m3fn), spmd_pb2.BLOCK_D_TYPE_FLOAT8_E4M3FN),
}
"""Supported element types: name -> (numpy dtype, wire enum value)."""

_DTYPE_BY_WIRE = {wire: name for name, (_, wire) in DTYPES.items()}

_MAX_DIM = 1 << 31


@dataclasses.dataclass(frozen=True)
class Layout:
    """A fully contiguous, block-major pool layout.

    Attributes:
        num_blocks: blocks in the pool; valid ids are ``0 .. num_blocks - 1``.
        num_layers: layers per block.
        outer_dim: outer dimension per layer (2 for separate K and V, 1 for MLA).
        page_size: tokens per block.
        inner_dim: elements per token per outer slot (heads x head size).
        dtype: element type name, one of :data:`DTYPES` (little-endian).

    A block is an array of shape ``(num_layers, outer_dim, page_size, inner_dim)`` and dtype
    ``dtype``; the pool is ``(num_blocks, num_layers, outer_dim, page_size, inner_dim)``.

    Raises:
        InvalidArgument: a dimension below 1 (0 allowed for ``num_blocks``) or an unknown
            dtype (INVALID_ARGUMENT).
    """

    num_blocks: int
    num_layers: int = 4
    outer_dim: int = 2
    page_size: int = 16
    inner_dim: int = 128
    dtype: str = "float16"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"unknown block dtype {self.dtype!r}; known: {sorted(DTYPES)}")
        if not 0 <= self.num_blocks < (1 << 40):
            raise InvalidArgument(f"num_blocks must be >= 0, got {self.num_blocks}")
        for name in ("num_layers", "outer_dim", "page_size", "inner_dim"):
            value = getattr(self, name)
            if not 1 <= value < _MAX_DIM:
                raise InvalidArgument(f"{name} must be in [1, 2**31), got {value}")

    @property
    def np_dtype(self) -> np.dtype[np.generic]:
        """The numpy dtype of the elements."""
        return DTYPES[self.dtype][0]

    @property
    def itemsize_bytes(self) -> int:
        """Bytes per element."""
        return int(self.np_dtype.itemsize)

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """Shape of one block: ``(num_layers, outer_dim, page_size, inner_dim)``."""
        return (self.num_layers, self.outer_dim, self.page_size, self.inner_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block: product of the block shape times the itemsize."""
        n = self.num_layers * self.outer_dim * self.page_size * self.inner_dim
        return n * self.itemsize_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole pool: ``num_blocks * bytes_per_block``."""
        return self.num_blocks * self.bytes_per_block

    def block_offset_bytes(self, block_id: int) -> int:
        """Byte offset of ``block_id`` within the pool (no range check)."""
        return block_id * self.bytes_per_block

    def with_blocks(self, num_blocks: int) -> Layout:
        """The same block shape with another block count."""
        return dataclasses.replace(self, num_blocks=num_blocks)

    def same_block_format(self, other: Layout) -> bool:
        """True when blocks of ``self`` and ``other`` are byte-compatible (shape and dtype)."""
        return self.block_shape == other.block_shape and self.dtype == other.dtype

    def to_proto(self, tier: Tier, *, shm_name: str = "", path: str = "") -> spmd_pb2.LayoutSpec:
        """Encode as a wire ``LayoutSpec`` of ``tier``."""
        return spmd_pb2.LayoutSpec(
            tier=tier.wire,
            num_blocks=self.num_blocks,
            num_layers=self.num_layers,
            outer_dim=self.outer_dim,
            page_size=self.page_size,
            inner_dim=self.inner_dim,
            dtype=DTYPES[self.dtype][1],
            bytes_per_block=self.bytes_per_block,
            shm_name=shm_name,
            path=path,
        )

    @classmethod
    def from_proto(cls, spec: spmd_pb2.LayoutSpec) -> Layout:
        """Decode a wire ``LayoutSpec``.

        Raises:
            InvalidArgument: unknown dtype, bad dims, or ``bytes_per_block`` that disagrees with
                the dims (INVALID_ARGUMENT).
        """
        if spec.dtype not in _DTYPE_BY_WIRE:
            raise InvalidArgument(f"unknown block dtype enum {spec.dtype}")
        layout = cls(
            num_blocks=int(spec.num_blocks),
            num_layers=int(spec.num_layers),
            outer_dim=int(spec.outer_dim),
            page_size=int(spec.page_size),
            inner_dim=int(spec.inner_dim),
            dtype=_DTYPE_BY_WIRE[spec.dtype],
        )
        if spec.bytes_per_block and spec.bytes_per_block != layout.bytes_per_block:
            raise InvalidArgument(
                f"layout says bytes_per_block={spec.bytes_per_block} but its dims give "
                f"{layout.bytes_per_block}"
            )
        return layout


def parse_layout_spec(text: str, *, base: Layout | None = None) -> Layout:
    """Parse ``"num_layers=4,outer_dim=2,page_size=16,inner_dim=128,dtype=float16"``.

    Keys not given keep the values of ``base`` (or the :class:`Layout` defaults).
    ``num_blocks`` is accepted too but is normally set per tier.

    Raises:
        InvalidArgument: malformed text, unknown key, or invalid values (INVALID_ARGUMENT).
    """
    current = base if base is not None else Layout(num_blocks=0)
    fields: dict[str, Any] = dataclasses.asdict(current)
    text = text.strip()
    if text:
        for item in text.split(","):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in fields:
                raise InvalidArgument(
                    f"bad layout item {item!r}; expected key=value with key in {sorted(fields)}"
                )
            if key == "dtype":
                fields[key] = value.strip()
            else:
                try:
                    fields[key] = int(value)
                except ValueError:
                    raise InvalidArgument(
                        f"layout {key} must be an integer, got {value!r}"
                    ) from None
    return Layout(**fields)
