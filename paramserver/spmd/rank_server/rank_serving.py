"""The rank server's gRPC plumbing, in one place: the error decorator every handler wears
(:func:`rank_rpc_errors`) and the ``grpc.aio`` server construction (:func:`start_rank_grpc_server`).

Refusals map to status codes through the :mod:`paramserver.errors` tree (the class name rides
in the trailing metadata); anything unexpected is logged with its traceback and becomes INTERNAL.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from paramserver.api.v1 import spmd_pb2_grpc
from paramserver.errors import ERROR_CLASS_METADATA_KEY, ParamServerError
from paramserver.protocol.keepalive import SERVER_KEEPALIVE_OPTIONS
from paramserver.security.tls import bind
from paramserver.server.observability.prometheus import enable_reflection
from paramserver.spmd.rank_server.rank_config import CHANNEL_OPTIONS, SERVICE_NAME, RankServerConfig

__all__ = ["rank_rpc_errors", "start_rank_grpc_server"]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


class _CountsFailures(Protocol):
    def count_failure(self) -> None: ...


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    if isinstance(exc, ParamServerError):
        context.set_trailing_metadata(((ERROR_CLASS_METADATA_KEY, type(exc).__name__),))
        await context.abort(exc.code, exc.message)
    logger.error("unexpected error in rank server handler", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


def _cancel_when_rpc_ends(context: grpc.aio.ServicerContext) -> Callable[[], None]:
    """Cancel the handler task if the RPC ends (client gone, deadline) while it still runs.

    A belt-and-braces guard: whatever the handler awaits (a peer rank, a worker thread, the
    request stream), it unwinds once its RPC is over, so reservations and temp objects are
    released. (With a client SIGKILLed mid-stream, grpc.aio 1.85 sometimes closes the handler
    coroutine instead of cancelling it; cleanup in ``finally`` blocks is therefore synchronous.)
    Returns the "handler finished" marker to call when the handler returns.
    """
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    finished = False

    def cancel_if_running() -> None:
        if not finished and task is not None and not task.done():
            task.cancel()

    def on_done(_: Any) -> None:
        loop.call_soon_threadsafe(cancel_if_running)

    context.add_done_callback(on_done)

    def mark_finished() -> None:
        nonlocal finished
        finished = True

    return mark_finished


def rank_rpc_errors(fn: F) -> F:
    """Decorate a rank-server handler (unary or server-streaming, ``(self, request, context)``).

    A :class:`~paramserver.errors.ParamServerError` becomes ``context.abort(code)``, anything
    else INTERNAL; each failure is counted (``self.count_failure()``). The handler task is
    cancelled when its RPC ends before it does (:func:`_cancel_when_rpc_ends`).
    """

    async def fail(
        owner: _CountsFailures, context: grpc.aio.ServicerContext, exc: Exception
    ) -> None:
        owner.count_failure()
        await _abort(context, exc)

    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def streaming(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            mark_finished = _cancel_when_rpc_ends(context)
            try:
                async for item in fn(self, request, context):
                    yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:
                mark_finished()
                await fail(self, context, exc)
            finally:
                mark_finished()

        return cast(F, streaming)

    @functools.wraps(fn)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        mark_finished = _cancel_when_rpc_ends(context)
        try:
            return await fn(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            mark_finished()
            await fail(self, context, exc)
            raise AssertionError("unreachable") from exc  # abort always raises
        finally:
            mark_finished()

    return cast(F, unary)


async def start_rank_grpc_server(
    servicer: Any, config: RankServerConfig, on_refusal: Callable[[str, str], None] | None
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """Construct, bind and start the rank server's ``grpc.aio`` server (the one place).

    It serves ``servicer`` (:data:`SERVICE_NAME`), the standard health service and reflection,
    with TLS and token interceptors from ``config.security``, on ``config.host:config.port``.
    Health stays unset until the caller marks it SERVING.

    Args:
        servicer: the :class:`~paramserver.spmd.rank_server.rank_service.RankServicer`.
        config: the rank server's configuration.
        on_refusal: called with ``(method, code)`` of each refused token (the refusal counter).

    Returns:
        ``(server, health servicer, bound port)``.

    Raises:
        Unavailable: the port cannot be bound (UNAVAILABLE); nothing is left running.
    """
    sec = config.security
    server = grpc.aio.server(
        interceptors=sec.interceptors(on_refusal) if sec is not None else None,
        options=[*CHANNEL_OPTIONS, *SERVER_KEEPALIVE_OPTIONS],
    )
    try:
        spmd_pb2_grpc.add_RankServerServicer_to_server(servicer, server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        enable_reflection(server, SERVICE_NAME)
        port = bind(server, f"{config.host}:{config.port}", sec)
        await server.start()
    except BaseException:
        await server.stop(None)
        raise
    return server, health_servicer, port
