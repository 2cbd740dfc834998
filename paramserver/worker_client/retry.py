"""The one retry funnel of the clients: backoff with full jitter up to a deadline, then the
error mapped to :mod:`paramserver.errors` (raised ``from`` the original RPC error).

Retrying is a wait a person can see: from the first retryable failure on, the funnel is a
:class:`~paramserver.waiting.Wait` for its target (``waiting for 127.0.0.1:50051 (connection
refused; retrying until 18:22:03, 25 s left)``), logged once at INFO when it lasts and handed to
the wait hook (the command line prints it every few seconds).

Source: AWS Architecture Blog, "Exponential Backoff And Jitter" (2015), full-jitter variant.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import TypeVar

import grpc

from paramserver.errors import error_class_of, from_rpc_error
from paramserver.waiting import Wait

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Retried by default. CANCELLED comes from the server's side (a restart cancelling calls in
#: flight); a cancellation by this process raises asyncio.CancelledError instead. Every call the
#: clients retry is idempotent: pushes by request id, clocks by clock value, reads trivially.
RETRYABLE: frozenset[grpc.StatusCode] = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}
)


#: What grpc.aio reports for a stream write that C-core refused because the server had just
#: ended the stream (a restart or graceful stop): INTERNAL with this text, overwriting the
#: status the server sent (grpc/grpc#36066). The link broke; retried like UNAVAILABLE.
CORE_WRITE_REFUSED = "Internal error from Core"


#: The RESOURCE_EXHAUSTED refusals that are back-pressure (retry after a backoff), by the
#: class the server names in the ``paramserver-error-class`` trailer. A RESOURCE_EXHAUSTED
#: without it comes from gRPC itself (a message over a receive limit: the same message fails
#: again) and one naming ``StorageFull`` needs an operator; neither is retried.
BACKPRESSURE_CLASSES = frozenset({"ResourceExhausted"})


def is_retryable(err: grpc.aio.AioRpcError, retryable: Collection[grpc.StatusCode]) -> bool:
    """``err``'s code is in ``retryable`` (RESOURCE_EXHAUSTED only as back-pressure, see
    :data:`BACKPRESSURE_CLASSES`), or it is a write refused by C-core (see
    :data:`CORE_WRITE_REFUSED`) where UNAVAILABLE is retryable."""
    code = err.code()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and code in retryable:
        return error_class_of(err.trailing_metadata()) in BACKPRESSURE_CLASSES
    if code in retryable:
        return True
    return (
        code == grpc.StatusCode.INTERNAL
        and err.details() == CORE_WRITE_REFUSED
        and grpc.StatusCode.UNAVAILABLE in retryable
    )


#: What a person reads for a failed attempt: (lower-cased text in the details, the reason).
_REASONS = (
    ("connection refused", "connection refused"),
    ("dns resolution failed", "host name not resolved"),
    ("name or service not known", "host name not resolved"),
    ("no route to host", "no route to host"),
    ("network is unreachable", "network unreachable"),
    ("timed out", "connection timed out"),
    ("handshake", "TLS handshake failed"),
    ("socket closed", "connection closed"),
    ("connection reset", "connection reset"),
    ("shutting down", "server shutting down"),
)


def failure_reason(err: grpc.aio.AioRpcError | None) -> str:
    """A few words on why an attempt failed (``connection refused``, ``server shutting down``,
    ``server busy``...), for wait reports; None: the transport cancelled the call."""
    if err is None:
        return "call cancelled by the transport"
    details = str(err.details() or "").lower()
    for needle, reason in _REASONS:
        if needle in details:
            return reason
    if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return "server busy (back-pressure)"
    return f"{err.code().name.lower().replace('_', ' ')}"


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter for retryable status codes.

    Attributes:
        initial_backoff_s: First backoff ceiling in seconds.
        max_backoff_s: Largest backoff ceiling in seconds.
        multiplier: Growth of the ceiling per attempt.
        deadline_s: Give up (re-raising the last error) after this many seconds.
    """

    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    deadline_s: float = 30.0


async def call_with_retry(
    attempt: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    what: str,
    retryable: Collection[grpc.StatusCode] = RETRYABLE,
    *,
    target: str | None = None,
) -> T:
    """Run ``attempt`` until it succeeds, retrying ``retryable`` codes up to the deadline.

    ``attempt`` builds a fresh call each time (a stream's request iterator too). A
    CancelledError that is not this task's own cancellation (grpc.aio cancelling the call when
    the server dies mid-stream) is retried like UNAVAILABLE, and so is a stream write C-core
    refused because the server had just ended the stream (:func:`is_retryable`).

    From the first retryable failure the call is a :class:`~paramserver.waiting.Wait` for
    ``target`` (the server's address; ``what`` without one), reported when it lasts.

    Raises:
        ParamServerError: the mapped error of a non-retryable failure, or of the last attempt
            once the deadline passed (UNAVAILABLE -> Unavailable, ...).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + policy.deadline_s
    ceiling = policy.initial_backoff_s
    waiting: Wait | None = None  # opened at the first retryable failure
    try:
        while True:
            failed: grpc.aio.AioRpcError | None = None
            try:
                return await attempt()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling() or loop.time() >= deadline:
                    raise
            except grpc.aio.AioRpcError as err:
                if not is_retryable(err, retryable) or loop.time() >= deadline:
                    raise from_rpc_error(err) from err
                failed = err
            reason = failure_reason(failed)
            if waiting is None:
                now = time.monotonic()
                waiting = Wait(
                    target or what,
                    address=target,
                    deadline=now + (deadline - loop.time()),
                    until="retrying until",
                    began=now - (loop.time() - (deadline - policy.deadline_s)),
                    logger=logger,
                ).__enter__()
            waiting.update(detail=reason)
            delay = min(random.uniform(0, ceiling), max(0.0, deadline - loop.time()))
            logger.debug("%s: %s; retrying in %.3f s", what, reason, delay)
            await asyncio.sleep(delay)
            ceiling = min(ceiling * policy.multiplier, policy.max_backoff_s)
    finally:
        if waiting is not None:
            waiting.close()
