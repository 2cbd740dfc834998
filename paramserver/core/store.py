"""The key → tensor store of one server shard (pure, synchronous; docs/semantics.md).

Each key is declared once with :meth:`ParameterStore.init` (first writer wins) and holds its value,
its :class:`~paramserver.core.optimizers.UpdateRule`, the rule's optimizer state and an update
counter. Gradients are validated before anything changes, and the ``*_many`` methods validate every
key before touching any, so a refused request never leaves a half-applied update.

The store is not thread-safe: one event loop (or one lock held by the caller) owns it. The
numeric part of an update (:meth:`Entry.apply`, :meth:`ParameterStore.apply_checked`) touches only
its keys' arrays, so the owner may run it in a worker thread while it keeps those keys to itself
(see :mod:`paramserver.server.apply_threads`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, TypeAlias

import ml_dtypes
import numpy as np

from paramserver.core.optimizers import (
    BLOCK_ELEMENTS,
    FLOAT_DTYPES,
    Array,
    UpdateRule,
    apply_update,
    init_state,
    overflowing_elements,
    range_refusal,
)
from paramserver.errors import (
    DimensionMismatch,
    DTypeMismatch,
    InvalidArgument,
    KeyConflict,
    KeyNotFound,
    NonFiniteGradient,
    ValueOutOfRange,
)
from paramserver.protocol.limits import check_key, shown

__all__ = [
    "SUPPORTED_DTYPES",
    "ArrayOrScalar",
    "Checked",
    "Entry",
    "ParameterStore",
    "count_non_finite",
    "out_of_range",
]

# A numpy scalar (what numpy reductions return for ``()`` shapes) is taken as a 0-d array.
ArrayOrScalar: TypeAlias = "Array | np.generic"

SUPPORTED_DTYPES: Final[tuple[np.dtype[np.generic], ...]] = (
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(np.int32),
    np.dtype(np.int64),
)
_DTYPES_BY_NAME: Final[dict[str, np.dtype[np.generic]]] = {str(d): d for d in SUPPORTED_DTYPES}
_PARAM_PREFIX: Final = "param/"
_STATE_PREFIX: Final = "state/"


@dataclass
class Entry:
    """One declared key.

    Attributes:
        key: The key's name (non-empty).
        value: The parameter, the store's own C-order array; its dtype and shape are fixed.
        rule: The key's update rule.
        state: Optimizer state from :func:`~paramserver.core.optimizers.init_state`.
        updates: Gradients applied to this key.
    """

    key: str
    value: Array
    rule: UpdateRule
    state: dict[str, Array] = field(repr=False)
    updates: int = 0

    def apply(self, grad: Array) -> None:
        """Apply an already validated gradient in place (the numeric part of an update only).

        Touches only this entry's arrays, so it may run in a worker thread while nothing else
        reads or writes this key.
        """
        apply_update(self.rule, self.value, grad, self.state)  # the thread's block scratch
        self.updates += 1


#: A validated gradient and the entry it applies to (see :meth:`ParameterStore.check_many`).
Checked: TypeAlias = tuple[Entry, Array]


_BLAS_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def count_non_finite(grad: Array) -> int:
    """Number of NaN/±Inf elements of a floating ``grad`` (0 for integers).

    Allocates nothing of ``grad``'s size (except a native-order copy of a byte-swapped
    ``grad``): the fast path is one sum (of squares for float32 and float64, finite only if
    every term is); an overflowing sum of finite terms, or a non-finite one, is counted exactly
    block by block with block-sized temporaries.
    """
    if not grad.dtype.isnative:  # (not from the wire, which is decoded native) a copy
        grad = grad.astype(grad.dtype.newbyteorder("="))
    if grad.dtype not in FLOAT_DTYPES or grad.size == 0:
        return 0
    if grad.size <= BLOCK_ELEMENTS:
        # One block: count directly (exact, a block-sized temporary; cheaper for small
        # gradients than the sum below and its np.errstate).
        return int(grad.size - np.count_nonzero(np.isfinite(grad)))
    with np.errstate(over="ignore", invalid="ignore"):
        if grad.dtype in _BLAS_DTYPES and grad.flags.c_contiguous:
            # x . x (a BLAS dot: ~2x numpy's pairwise sum here, 1e6 float32 in 0.06 ms): a sum
            # of non-negative terms, finite iff every term is and it does not overflow.
            flat = grad.reshape(-1)
            total = np.dot(flat, flat)
        else:
            acc = np.float64 if grad.dtype == np.float64 else np.float32
            total = np.add.reduce(grad, axis=None, dtype=acc)
    if np.isfinite(total):
        return 0
    flat = grad.reshape(-1)  # a copy only for a strided gradient
    finite = 0
    for start in range(0, flat.size, BLOCK_ELEMENTS):
        finite += int(np.count_nonzero(np.isfinite(flat[start : start + BLOCK_ELEMENTS])))
    return int(flat.size - finite)


def out_of_range(entry: Entry, grad: Array) -> ValueOutOfRange | None:
    """The refusal of an update of ``entry`` by ``grad`` whose finite result would not fit the
    key's dtype (see :func:`~paramserver.core.optimizers.overflowing_elements`), or None.

    The error names the key, the rule, the element count and the dtype's range.
    """
    bad = overflowing_elements(entry.rule, entry.value, grad, entry.state)
    if not bad:
        return None
    return range_refusal(f"update of key {entry.key!r}", entry.rule.kind, bad, entry.value.dtype)


class ParameterStore:
    """Keys → tensors with server-side update rules.

    Values have any shape (``()`` and zero-size included) and dtype float16, bfloat16
    (``ml_dtypes``), float32, float64, int32 or int64; integer keys take ``assign``/``add`` only.
    """

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}

    # -- declaration ---------------------------------------------------------------------------

    @staticmethod
    def _check_init(key: object, value: object, rule: object) -> None:
        if not isinstance(key, str) or not key:
            raise InvalidArgument(f"key must be a non-empty string, got {key!r}")
        check_key(key)
        if not isinstance(value, np.ndarray | np.generic):
            raise InvalidArgument(
                f"value for key {key!r} must be a numpy array, got {type(value).__name__}"
            )
        if value.dtype not in SUPPORTED_DTYPES:
            raise InvalidArgument(
                f"value for key {key!r} has unsupported dtype {value.dtype}; "
                f"expected one of {', '.join(_DTYPES_BY_NAME)}"
            )
        if not isinstance(rule, UpdateRule):
            raise InvalidArgument(f"rule for key {key!r} must be an UpdateRule, got {rule!r}")
        try:
            init_state(rule, np.asarray(value))
        except InvalidArgument as exc:
            raise InvalidArgument(f"key {key!r}: {exc.message}") from exc

    def _create(self, key: str, value: ArrayOrScalar, rule: UpdateRule, take: bool) -> bool:
        if key in self._entries:
            return False
        if (
            take
            and isinstance(value, np.ndarray)
            and type(value) is np.ndarray
            and value.flags.c_contiguous
            and value.flags.writeable
            and value.dtype.isnative
        ):
            stored = value  # handed over by the caller: no copy
        else:
            stored = np.array(value, copy=True, order="C")  # a 0-d array for a numpy scalar
        self._entries[key] = Entry(key, stored, rule, init_state(rule, stored))
        return True

    def init(self, key: str, value: ArrayOrScalar, rule: UpdateRule, *, take: bool = False) -> bool:
        """Declare ``key`` with ``value`` and ``rule``; the first writer wins.

        Args:
            key: Non-empty key name.
            value: Initial value, any shape, a supported dtype (a numpy scalar is stored as a 0-d
                array). Copied into a new C-order array, never aliased, unless ``take``.
            rule: The key's update rule.
            take: The caller hands ``value`` over (e.g. a receive buffer it will never touch
                again): a writeable, C-contiguous, native-order ndarray is stored as is, without
                a copy. Other values are still copied.

        Returns:
            True if the key was created; False if it existed (its value and rule are untouched).

        Raises:
            InvalidArgument: (INVALID_ARGUMENT) empty key, unsupported dtype, or an optimizer rule
                on an integer value; checked even when the key exists.
            KeyConflict: (ALREADY_EXISTS) the key exists with another dtype or shape.
        """
        self._check_init(key, value, rule)
        self._check_redeclare(key, value)
        return self._create(key, value, rule, take)

    def init_many(
        self,
        items: Mapping[str, ArrayOrScalar],
        rule: UpdateRule,
        *,
        take: bool = False,
        before_create: Callable[[dict[str, bool]], None] | None = None,
    ) -> dict[str, bool]:
        """Declare several keys with one rule, all or nothing.

        Args:
            items: Key → initial value, as for :meth:`init`.
            rule: The update rule of every key.
            take: As for :meth:`init`, for every value.
            before_create: Called with key → "will be created" once every item is valid and
                before anything is stored (the write-ahead log); if it raises, nothing is
                stored.

        Returns:
            Key → whether it was created (False: it existed and was left untouched).

        Raises:
            InvalidArgument: (INVALID_ARGUMENT) any item is invalid; then no key is created.
            KeyConflict: (ALREADY_EXISTS) an existing key declared with another dtype or shape.
        """
        for key, value in items.items():
            self._check_init(key, value, rule)
            self._check_redeclare(key, value)
        if before_create is not None:
            before_create({key: key not in self._entries for key in items})
        return {key: self._create(key, value, rule, take) for key, value in items.items()}

    def _check_redeclare(self, key: str, value: ArrayOrScalar) -> None:
        """Refuse a declaration of an existing key with another dtype or shape.

        Raises:
            KeyConflict: (ALREADY_EXISTS) naming both declarations.
        """
        entry = self._entries.get(key)
        if entry is None:
            return
        have = entry.value
        dtype, shape = np.dtype(value.dtype), tuple(np.shape(value))
        if have.dtype != dtype or have.shape != shape:
            raise KeyConflict(
                f"key {key!r} is already declared as {have.dtype} {tuple(have.shape)}; "
                f"this init declares it as {dtype} {shape}"
            )

    # -- lookup --------------------------------------------------------------------------------

    def get(self, key: str) -> Entry:
        """The live entry of ``key`` (not a copy).

        Raises:
            KeyNotFound: (NOT_FOUND) ``key`` was never declared.
        """
        try:
            return self._entries[key]
        except KeyError:
            raise KeyNotFound(f"unknown key {shown(key)!r}; declare it with init first") from None

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        """Declared keys in declaration order (a new list)."""
        return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    # -- updates -------------------------------------------------------------------------------

    def _validate(
        self, key: str, grad: object, *, allow_non_finite: bool, allow_aggregate: bool
    ) -> tuple[Entry, Array]:
        entry = self.get(key)
        if isinstance(grad, np.generic):  # numpy reductions over () keys yield scalars
            grad = np.asarray(grad)
        if not isinstance(grad, np.ndarray):
            raise InvalidArgument(
                f"gradient for key {key!r} must be a numpy array, got {type(grad).__name__}"
            )
        value = entry.value
        problems = []
        if grad.shape != value.shape:
            problems.append(f"shape {grad.shape} (expected {value.shape})")
        aggregate_ok = (
            allow_aggregate
            and grad.dtype in (np.float32, np.float64)
            and value.dtype in FLOAT_DTYPES
        )
        if grad.dtype != value.dtype and not aggregate_ok:
            problems.append(f"dtype {grad.dtype} (expected {value.dtype})")
        if problems:
            cls = DTypeMismatch if grad.shape == value.shape else DimensionMismatch
            raise cls(f"gradient for key {shown(key)!r} has {' and '.join(problems)}")
        if not allow_non_finite:
            bad = count_non_finite(grad)
            if bad:
                raise NonFiniteGradient(
                    f"gradient for key {key!r} has {bad} non-finite value(s) (NaN or Inf) "
                    f"out of {grad.size}"
                )
        return entry, grad

    def validate_gradient(
        self, key: str, grad: ArrayOrScalar, *, allow_non_finite: bool = False
    ) -> None:
        """Check a pushed gradient against ``key`` without applying it.

        Args:
            key: A declared key.
            grad: Must have the key's shape and exactly its dtype (a numpy scalar counts as 0-d).
            allow_non_finite: Accept NaN/Inf (otherwise refused; -0.0 and subnormals are fine).

        Raises:
            KeyNotFound: (NOT_FOUND) unknown key.
            DimensionMismatch: (INVALID_ARGUMENT) shape or dtype differs; names the key and both.
            NonFiniteGradient: (INVALID_ARGUMENT) NaN/Inf present; names the key and the count.
            InvalidArgument: (INVALID_ARGUMENT) ``grad`` is not a numpy array.
        """
        self._validate(key, grad, allow_non_finite=allow_non_finite, allow_aggregate=False)

    def apply(self, key: str, grad: ArrayOrScalar, *, allow_non_finite: bool = False) -> None:
        """Validate ``grad`` and apply it to ``key`` in place under the key's rule.

        Args:
            key: A declared key.
            grad: The key's shape; its dtype, or float32/float64 (an aggregate's accumulation
                dtype) for a floating key. A numpy
                scalar counts as a 0-d array.
            allow_non_finite: Accept NaN/Inf.

        Raises:
            KeyNotFound: (NOT_FOUND) unknown key.
            DimensionMismatch: (INVALID_ARGUMENT) shape or dtype differs.
            NonFiniteGradient: (INVALID_ARGUMENT) NaN/Inf present; nothing changes.
            ValueOutOfRange: (INVALID_ARGUMENT) the result would overflow the key's dtype.
        """
        entry, array = self._validate(
            key, grad, allow_non_finite=allow_non_finite, allow_aggregate=True
        )
        checked = [(entry, array)]
        self.check_range(checked)
        self.apply_checked(checked)

    def apply_many(
        self, grads: Mapping[str, ArrayOrScalar], *, allow_non_finite: bool = False
    ) -> None:
        """Apply several gradients: every one is validated before any is applied.

        Args:
            grads: Key → gradient, each as for :meth:`apply`.
            allow_non_finite: Accept NaN/Inf.

        Raises:
            KeyNotFound: (NOT_FOUND) an unknown key; nothing is applied.
            DimensionMismatch: (INVALID_ARGUMENT) a shape or dtype differs; nothing is applied.
            NonFiniteGradient: (INVALID_ARGUMENT) NaN/Inf present; nothing is applied.
            ValueOutOfRange: (INVALID_ARGUMENT) a result would overflow its key's dtype;
                nothing is applied.
        """
        checked = self.check_many(grads, allow_non_finite=allow_non_finite)
        self.check_range(checked)
        self.apply_checked(checked)

    def check_many(
        self,
        grads: Mapping[str, ArrayOrScalar],
        *,
        allow_non_finite: bool = False,
        allow_aggregate: bool = True,
    ) -> list[Checked]:
        """Validate several gradients (the decision part of :meth:`apply_many`); nothing changes.

        Args:
            grads: Key → gradient.
            allow_non_finite: Accept NaN/Inf.
            allow_aggregate: Accept float32/float64 for any floating key (an aggregate); when
                False the dtype must be the key's own (a pushed gradient, as
                :meth:`validate_gradient`).

        Returns:
            ``(entry, gradient)`` pairs for :meth:`apply_checked`, in ``grads`` order.

        Raises:
            As :meth:`apply_many`.
        """
        return [
            self._validate(k, g, allow_non_finite=allow_non_finite, allow_aggregate=allow_aggregate)
            for k, g in grads.items()
        ]

    @staticmethod
    def check_range(checked: Iterable[Checked]) -> None:
        """Refuse updates whose result would overflow their key's dtype (:func:`out_of_range`),
        before any is applied; call it on the values the updates will see.

        Raises:
            ValueOutOfRange: (INVALID_ARGUMENT) naming the key, the rule and the range.
        """
        for entry, grad in checked:
            refusal = out_of_range(entry, grad)
            if refusal is not None:
                raise refusal

    @staticmethod
    def apply_checked(checked: Iterable[Checked]) -> None:
        """Apply gradients validated by :meth:`check_many` and :meth:`check_range` (the
        numeric part only; the caller ran both: the core when it decides a push, and at a BSP
        step's close).

        Touches only the entries' arrays (never the key table), so it may run in a worker
        thread while no one else reads or writes those keys.
        """
        for entry, grad in checked:
            entry.apply(grad)

    # -- snapshots and checkpoints -------------------------------------------------------------

    def snapshot(self, keys: Iterable[str] | None = None) -> dict[str, Array]:
        """Copies of the values of ``keys`` (all keys when None).

        Raises:
            KeyNotFound: (NOT_FOUND) an unknown key; nothing is returned.
        """
        entries = list(self._entries.values()) if keys is None else [self.get(k) for k in keys]
        return {e.key: e.value.copy() for e in entries}

    def state_dict(self) -> tuple[dict[str, Array], dict[str, object]]:
        """Flat copies of every tensor plus JSON-able metadata, for a safetensors checkpoint.

        Returns:
            ``(tensors, meta)``: ``tensors`` maps ``"param/{key}"`` to the value and
            ``"state/{key}/{name}"`` to each optimizer state array (copies, C order); ``meta``
            maps each key to ``{"rule": rule.to_dict(), "dtype": str, "shape": [int, ...],
            "updates": int}`` in declaration order.
        """
        tensors: dict[str, Array] = {}
        meta: dict[str, object] = {}
        for key, entry in self._entries.items():
            tensors[f"{_PARAM_PREFIX}{key}"] = entry.value.copy()
            for name, array in entry.state.items():
                tensors[f"{_STATE_PREFIX}{key}/{name}"] = array.copy()
            meta[key] = {
                "rule": entry.rule.to_dict(),
                "dtype": str(entry.value.dtype),
                "shape": list(entry.value.shape),
                "updates": entry.updates,
            }
        return tensors, meta

    @classmethod
    def from_state_dict(
        cls, tensors: Mapping[str, Array], meta: Mapping[str, object]
    ) -> ParameterStore:
        """Rebuild a store from :meth:`state_dict` output (exact round trip; arrays are copied).

        Tensors outside the ``param/`` and ``state/`` prefixes are ignored (a checkpoint may hold
        other tensors).

        Raises:
            InvalidArgument: (INVALID_ARGUMENT) metadata malformed, a tensor missing, of the wrong
                dtype or shape, or an unexpected ``param/``/``state/`` tensor; names the key.
        """
        store = cls()
        used: set[str] = set()

        def take(name: str, key: str, dtype: np.dtype[np.generic], shape: tuple[int, ...]) -> Array:
            array = tensors.get(name)
            if not isinstance(array, np.ndarray):
                raise InvalidArgument(f"checkpoint of key {key!r} lacks tensor {name!r}")
            if array.dtype != dtype or array.shape != shape:
                raise InvalidArgument(
                    f"checkpoint tensor {name!r} is {array.dtype}{list(array.shape)}, "
                    f"expected {dtype}{list(shape)}"
                )
            used.add(name)
            return np.array(array, copy=True, order="C")

        for key, info in meta.items():
            if not isinstance(info, Mapping):
                raise InvalidArgument(f"checkpoint metadata of key {key!r} is not a mapping")
            try:
                rule = UpdateRule.from_dict(info["rule"])
                dtype = _DTYPES_BY_NAME[info["dtype"]]
                shape = tuple(int(n) for n in info["shape"])
                updates = int(info["updates"])
            except (KeyError, TypeError, ValueError) as exc:
                raise InvalidArgument(
                    f"checkpoint metadata of key {key!r} is malformed: {exc!r}"
                ) from exc
            except InvalidArgument as exc:
                raise InvalidArgument(f"checkpoint rule of key {key!r}: {exc.message}") from exc
            if updates < 0 or any(n < 0 for n in shape):
                raise InvalidArgument(f"checkpoint metadata of key {key!r} has negative numbers")
            value = take(f"{_PARAM_PREFIX}{key}", key, dtype, shape)
            cls._check_init(key, value, rule)
            state = {
                name: take(f"{_STATE_PREFIX}{key}/{name}", key, fresh.dtype, fresh.shape)
                for name, fresh in init_state(rule, value).items()
            }
            store._entries[key] = Entry(key, value, rule, state, updates)
        extra = sorted(
            name
            for name in tensors
            if name.startswith((_PARAM_PREFIX, _STATE_PREFIX)) and name not in used
        )
        if extra:
            raise InvalidArgument(f"checkpoint holds tensors of no declared key: {extra}")
        return store
