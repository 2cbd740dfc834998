"""Embedding-table specs both sides share: dtypes, update-rule kinds, initializers, the
id -> shard placement (splitmix64; :func:`shard_of_ids`, :func:`check_owned`) and
:class:`TableSpec` (what ``InitTable`` declares).

The placement and the initial-row function (:func:`paramserver.core.tables.initial_rows`) are
specified step by step, with test vectors, in ``docs/wire-contract.md``; existing checkpoints
and clusters depend on their values, so they never change. The table itself (rows, id index,
update rules) is :mod:`paramserver.core.tables`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypedDict

import ml_dtypes
import numpy as np
import numpy.typing as npt

from paramserver.errors import InvalidArgument, WrongShard
from paramserver.protocol.limits import MAX_TABLE_DIM, check_table_name, shown

F32 = np.dtype(np.float32)

TABLE_DTYPES: Final[dict[str, np.dtype[np.generic]]] = {
    "float32": F32,
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
TABLE_RULE_KINDS: Final = ("sgd", "adagrad", "rowwise_adagrad", "adam")
INITIALIZERS: Final = ("uniform", "normal", "zeros")
CONSISTENCIES: Final = ("asp", "ssp", "bsp")

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_M1 = _U64(0xBF58476D1CE4E5B9)
_M2 = _U64(0x94D049BB133111EB)


def splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """SplitMix64's finalizer, element-wise (uint64 wrap-around arithmetic; Steele et al. 2014).

    Args:
        x: uint64 array of any shape.

    Returns:
        A new uint64 array of the same shape: a bijective, well-mixed hash of each element.
    """
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> _U64(30))) * _M1
        z = (z ^ (z >> _U64(27))) * _M2
        return z ^ (z >> _U64(31))


def table_hash(name: str) -> int:
    """A stable 64-bit hash of a table name: BLAKE2b with an 8-byte digest (``digest_size=8``,
    a parameter of the hash, not a truncated 64-byte digest; no key, salt or personalization)
    of the name's UTF-8 bytes, the 8 bytes read as a little-endian unsigned integer (RFC 7693).
    """
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def shard_of_ids(table: str, ids: npt.NDArray[np.int64], num_shards: int) -> npt.NDArray[np.int64]:
    """The shard of each id: ``hash64(table, id) mod num_shards`` (vectorized).

    ``hash64(table, id) = splitmix64(uint64(id) xor table_hash(table))``.

    Args:
        table: Table name.
        ids: int64 array, shape (n,).
        num_shards: Number of shards S >= 1.

    Returns:
        int64 array (n,) with values in [0, S).
    """
    h = splitmix64(ids.astype(np.int64, copy=False).view(np.uint64) ^ _U64(table_hash(table)))
    return (h % _U64(num_shards)).astype(np.int64)


def check_owned(table: str, ids: npt.NDArray[np.int64], shard_index: int, num_shards: int) -> None:
    """Refuse ids that another shard owns (changes nothing).

    Args:
        table: Table name.
        ids: Validated int64 ids (n,), each >= 0.
        shard_index: This shard's index in [0, num_shards).
        num_shards: Shards in the cluster (1: every id is this shard's).

    Raises:
        WrongShard: an id with ``shard_of_ids(table, id, num_shards) != shard_index``; names
            the table, the first such id, its owner, this shard's index and the shard count
            (FAILED_PRECONDITION).
    """
    if num_shards <= 1 or ids.shape[0] == 0:
        return
    owner = shard_of_ids(table, ids, num_shards)
    foreign = np.flatnonzero(owner != shard_index)
    if foreign.shape[0]:
        first = int(foreign[0])
        raise WrongShard(
            f"table {table!r}: id {int(ids[first])} belongs to shard {int(owner[first])}, "
            f"not to this shard (index {shard_index} of {num_shards} shards); "
            f"{foreign.shape[0]} of the request's {ids.shape[0]} ids are other shards'. "
            f"Send each id to shard hash64(table, id) mod {num_shards}; nothing was applied"
        )


@dataclass(frozen=True)
class Initializer:
    """How the initial row of an id is drawn.

    Attributes:
        kind: ``uniform`` (U[-scale, scale)), ``normal`` (N(0, scale²), Box-Muller) or ``zeros``.
        scale: Half-width (uniform) or standard deviation (normal); finite and >= 0.
    """

    kind: str = "uniform"
    scale: float = 0.01

    def __post_init__(self) -> None:
        if self.kind not in INITIALIZERS:
            raise InvalidArgument(f"initializer must be one of {INITIALIZERS}, got {self.kind!r}")
        if not (math.isfinite(self.scale) and self.scale >= 0):
            raise InvalidArgument(f"initializer scale must be finite and >= 0, got {self.scale}")


@dataclass(frozen=True, init=False)
class TableRule:
    """A row-wise update rule (resolved floats; see the module docstring for the sources).

    ``eps`` left as ``None`` takes the kind's default (adagrad and rowwise_adagrad 1e-10,
    adam 1e-8); an explicit value is used as given, so ``eps=0`` is refused, never replaced.
    The attribute always holds the resolved float.

    Attributes:
        kind: ``sgd``, ``adagrad``, ``rowwise_adagrad`` or ``adam`` (lazy).
        lr: Learning rate, finite and >= 0.
        eps: Denominator epsilon, finite and > 0.
        beta1: Adam first-moment decay in [0, 1).
        beta2: Adam second-moment decay in [0, 1).
        initial_accumulator: Adagrad accumulator start value, >= 0.

    Raises:
        InvalidArgument: an unknown kind or a value out of range (INVALID_ARGUMENT).
    """

    kind: str
    lr: float
    eps: float
    beta1: float
    beta2: float
    initial_accumulator: float

    def __init__(
        self,
        kind: str = "sgd",
        lr: float = 0.01,
        eps: float | None = None,
        beta1: float = 0.9,
        beta2: float = 0.999,
        initial_accumulator: float = 0.0,
    ) -> None:
        if kind not in TABLE_RULE_KINDS:
            raise InvalidArgument(f"table rule must be one of {TABLE_RULE_KINDS}, got {kind!r}")
        resolved = (1e-8 if kind == "adam" else 1e-10) if eps is None else eps
        values = {
            "kind": kind,
            "lr": lr,
            "eps": resolved,
            "beta1": beta1,
            "beta2": beta2,
            "initial_accumulator": initial_accumulator,
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)
        for name in ("lr", "initial_accumulator"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise InvalidArgument(f"table rule {name} must be finite and >= 0, got {v}")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise InvalidArgument(
                f"table rule {kind!r}: eps must be finite and > 0, got {self.eps} (leave it "
                "unset for the default)"
            )
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise InvalidArgument(f"table rule {name} must lie in [0, 1), got {v}")


class InitializerDict(TypedDict):
    """An :class:`Initializer` as JSON (:meth:`TableSpec.to_dict`)."""

    kind: str
    scale: float


class TableSpecDict(TypedDict):
    """A :class:`TableSpec` as JSON (:meth:`TableSpec.to_dict`; checkpoint manifests, WAL)."""

    name: str
    dim: int
    dtype: str
    #: The rule's ``kind`` and its floats by name (``lr``, ``eps``, ...).
    rule: dict[str, str | float]
    initializer: InitializerDict
    seed: int
    num_embeddings: int | None
    consistency: str
    staleness: int
    expiry_clocks: int
    expiry_s: float
    min_pushes: int


@dataclass(frozen=True)
class TableSpec:
    """One table's declaration (first writer wins; later identical declarations are no-ops).

    Attributes:
        name: Table name, 1 to 1,024 bytes of UTF-8 (shares no namespace with dense keys).
        dim: Row width, 1 to 65,536 values.
        dtype: Storage dtype name: ``float32``, ``float16`` or ``bfloat16``.
        rule: The row-wise update rule.
        initializer: How initial rows are drawn.
        seed: Seed of the initial rows (any int >= 0, < 2**64).
        num_embeddings: When set, ids must lie in [0, num_embeddings); else any id >= 0.
        consistency: ``asp``, ``ssp`` or ``bsp``, independent of the server's dense keys.
        staleness: SSP bound s in clocks (must be 0 under bsp; ignored under asp).
        expiry_clocks: Drop a stored row not pushed for this many clocks (0: never).
        expiry_s: Drop a stored row not pushed for this many seconds (0: never).
        min_pushes: Frequency filter k: an id gets a stored row at its k-th push (1: off).
    """

    name: str
    dim: int
    dtype: str = "float32"
    rule: TableRule = field(default_factory=TableRule)
    initializer: Initializer = field(default_factory=Initializer)
    seed: int = 0
    num_embeddings: int | None = None
    consistency: str = "asp"
    staleness: int = 0
    expiry_clocks: int = 0
    expiry_s: float = 0.0
    min_pushes: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise InvalidArgument("a table needs a non-empty name")
        check_table_name(self.name)
        where = f"table {shown(self.name)!r}"
        if not isinstance(self.dim, int) or not 1 <= self.dim <= MAX_TABLE_DIM:
            raise InvalidArgument(
                f"{where}: dim must be an int in [1, {MAX_TABLE_DIM}], got {self.dim!r}"
            )
        if self.dtype not in TABLE_DTYPES:
            raise InvalidArgument(
                f"{where}: dtype must be one of {sorted(TABLE_DTYPES)}, got {self.dtype!r}"
            )
        if not 0 <= self.seed < (1 << 64):
            raise InvalidArgument(f"{where}: seed must lie in [0, 2**64), got {self.seed}")
        if self.num_embeddings is not None and self.num_embeddings < 1:
            raise InvalidArgument(
                f"{where}: num_embeddings must be >= 1 when set, got {self.num_embeddings}"
            )
        if self.consistency not in CONSISTENCIES:
            raise InvalidArgument(
                f"{where}: consistency must be one of {CONSISTENCIES}, got {self.consistency!r}"
            )
        if self.staleness < 0:
            raise InvalidArgument(f"{where}: staleness must be >= 0, got {self.staleness}")
        if self.consistency == "bsp" and self.staleness != 0:
            raise InvalidArgument(
                f"{where}: a bsp table has staleness 0, got {self.staleness} (declare ssp "
                "for a bound above 0)"
            )
        if self.expiry_clocks < 0 or not (math.isfinite(self.expiry_s) and self.expiry_s >= 0):
            raise InvalidArgument(f"{where}: expiry_clocks and expiry_s must be >= 0")
        if self.min_pushes < 1:
            raise InvalidArgument(f"{where}: min_pushes must be >= 1, got {self.min_pushes}")

    @property
    def np_dtype(self) -> np.dtype[np.generic]:
        """The storage dtype as a numpy dtype."""
        return TABLE_DTYPES[self.dtype]

    def to_dict(self) -> TableSpecDict:
        """JSON-able form (checkpoint manifests, WAL)."""
        r, init = self.rule, self.initializer
        return {
            "name": self.name,
            "dim": self.dim,
            "dtype": self.dtype,
            "rule": {
                "kind": r.kind,
                "lr": r.lr,
                "eps": r.eps,
                "beta1": r.beta1,
                "beta2": r.beta2,
                "initial_accumulator": r.initial_accumulator,
            },
            "initializer": {"kind": init.kind, "scale": init.scale},
            "seed": self.seed,
            "num_embeddings": self.num_embeddings,
            "consistency": self.consistency,
            "staleness": self.staleness,
            "expiry_clocks": self.expiry_clocks,
            "expiry_s": self.expiry_s,
            "min_pushes": self.min_pushes,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TableSpec:
        """Inverse of :meth:`to_dict`."""
        d = dict(d)
        d["rule"] = TableRule(**d["rule"])
        d["initializer"] = Initializer(**d["initializer"])
        return cls(**d)
