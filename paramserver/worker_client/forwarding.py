"""Attributes one object forwards to another (a facade's state is its delegate's)."""

from __future__ import annotations

from typing import Generic, Self, TypeVar, overload

__all__ = ["Forwarded"]

T = TypeVar("T")


class Forwarded(Generic[T]):
    """A descriptor: reading or writing the attribute reads or writes the attribute of the same
    name on the object's ``via`` attribute (e.g. ``worker_id`` of a cluster client is its
    current client's ``worker_id``).

    Args:
        via: The name of the attribute holding the delegate.
        doc: The attribute's docstring.
    """

    def __init__(self, via: str, doc: str) -> None:
        self._via = via
        self._name = ""
        self.__doc__ = doc

    def __set_name__(self, owner: type[object], name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: type[object] | None = None) -> Self: ...

    @overload
    def __get__(self, obj: object, owner: type[object] | None = None) -> T: ...

    def __get__(self, obj: object | None, owner: type[object] | None = None) -> Self | T:
        if obj is None:
            return self
        value: T = getattr(getattr(obj, self._via), self._name)
        return value

    def __set__(self, obj: object, value: T) -> None:
        setattr(getattr(obj, self._via), self._name, value)
