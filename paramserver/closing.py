"""``with`` / ``async with`` for every paramserver object that is opened and closed.

A class mixes in :class:`Closing` (blocking) or :class:`AsyncClosing` (asyncio) and defines
``open()`` and ``close()``; entering the block opens the object and returns it, leaving the block
(normally or by an exception) closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType
from typing import Self


class Closing:
    """``with obj:`` calls ``obj.open()`` on entry (the block gets ``obj``) and ``obj.close()``
    on exit. ``open`` does nothing unless a subclass overrides it."""

    def open(self) -> object:
        return self

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncClosing:
    """``async with obj:`` awaits ``obj.open()`` on entry (the block gets ``obj``) and
    ``obj.close()`` on exit."""

    async def open(self) -> object:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


async def cancelled(task: asyncio.Task[object] | None) -> None:
    """Cancel ``task`` (when there is one) and wait until it has ended (its CancelledError is
    absorbed; any other exception it ends with is raised)."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
