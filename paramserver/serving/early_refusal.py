"""Prompt refusal of a client stream the client is still writing (Push, Init, the row streams).

A status sent while a grpc.aio client is still writing can reach it as INTERNAL "Internal error
from Core" instead of the real code (grpc/grpc#36066). So a refused client stream is read to its
end before the status goes out; to make that end come at once, the refusal is announced first
in the call's initial metadata (:data:`~paramserver.errors.REFUSAL_METADATA_KEY`). The
product's clients watch for it while they send, stop writing and half-close, and then receive
the real status within a round trip; other clients are read (and their frames discarded) for
at most :data:`DRAIN_S` seconds, as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable

from paramserver.errors import REFUSAL_METADATA_KEY, ParamServerError
from paramserver.method_handlers import ServicerContext

__all__ = ["DRAIN_S", "announce_refusal", "drain_request_stream"]

logger = logging.getLogger(__name__)

#: Longest a refused client-streaming call keeps reading (and discarding) the client's frames.
DRAIN_S = 10.0


async def announce_refusal(context: ServicerContext, request: object, exc: BaseException) -> None:
    """Send the refusal of a client stream in the initial metadata (only for a client stream
    and a :class:`ParamServerError`; nothing when initial metadata is already out)."""
    if not hasattr(request, "__aiter__") or not isinstance(exc, ParamServerError):
        return
    value = f"{type(exc).__name__} {exc.code.name}"
    try:
        await context.send_initial_metadata(((REFUSAL_METADATA_KEY, value),))
    except Exception:  # already sent, or the call is gone: the drain and status still follow
        logger.debug("could not announce the refusal %s", value, exc_info=True)


async def drain_request_stream(request: object) -> None:
    """Read and discard the rest of a client stream (Init, Push, a row stream) before refusing
    it, for at most :data:`DRAIN_S` seconds. Unary requests (protobuf messages) are left
    alone."""
    if not isinstance(request, AsyncIterable):  # has __aiter__
        return
    try:
        async with asyncio.timeout(DRAIN_S):
            async for _ in request:
                pass
    except Exception:  # a broken or cancelled stream, or the time ran out: refuse now
        return
