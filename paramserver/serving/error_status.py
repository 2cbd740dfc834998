"""One error mapping for every paramserver gRPC servicer: the :func:`grpc_errors` decorator.

A :class:`~paramserver.errors.ParamServerError` becomes ``context.abort(code, message)`` with the
error's class in the trailing metadata, a MemoryError RESOURCE_EXHAUSTED
(:class:`~paramserver.errors.CapacityExceeded`), anything else a logged INTERNAL; a refused
client stream is read to its end before the status is sent (grpc/grpc#36066,
:mod:`paramserver.serving.early_refusal`).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn, TypeVar

import grpc

from paramserver.errors import ERROR_CLASS_METADATA_KEY, CapacityExceeded, ParamServerError
from paramserver.method_handlers import ServicerContext
from paramserver.protocol.limits import cut_details
from paramserver.serving.early_refusal import announce_refusal, drain_request_stream

__all__ = ["abort_with", "grpc_errors"]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


async def abort_with(context: ServicerContext, exc: BaseException, method: str) -> NoReturn:
    """End the call with ``exc``'s status (a :class:`ParamServerError`; a MemoryError becomes
    :class:`~paramserver.errors.CapacityExceeded`, RESOURCE_EXHAUSTED), or a logged INTERNAL."""
    if isinstance(exc, MemoryError):
        logger.error("%s ran out of memory", method, exc_info=exc)
        exc = CapacityExceeded(f"{method}: the server could not allocate the memory it needs")
    if isinstance(exc, ParamServerError):
        details = cut_details(exc.message)
        logger.debug("%s refused: %s", method, details)
        context.set_trailing_metadata(((ERROR_CLASS_METADATA_KEY, type(exc).__name__),))
        await context.abort(exc.code, details)
    logger.error("%s failed with an unexpected error", method, exc_info=exc)
    await context.abort(
        grpc.StatusCode.INTERNAL, cut_details(f"internal error in {method}: {exc!r}")
    )


def grpc_errors(fn: F) -> F:
    """Turn ParamServerError into its status code; anything else into a logged INTERNAL."""
    name = fn.__name__
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def gen_wrapper(
            self: object, request: object, context: ServicerContext
        ) -> AsyncIterator[object]:
            try:
                async for item in fn(self, request, context):
                    yield item
            except (grpc.aio.AbortError, GeneratorExit):
                raise
            except Exception as exc:
                # a bidi stream (the row streams) the client may still be writing: as below
                await announce_refusal(context, request, exc)
                await drain_request_stream(request)
                await abort_with(context, exc, name)

        return gen_wrapper  # type: ignore[return-value]

    @functools.wraps(fn)
    async def wrapper(self: object, request: object, context: ServicerContext) -> object:
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await announce_refusal(context, request, exc)  # the client stops writing at once
            await drain_request_stream(request)
            await abort_with(context, exc, name)

    return wrapper  # type: ignore[return-value]
