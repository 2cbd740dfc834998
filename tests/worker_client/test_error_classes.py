"""The client's reading of refusals: the ``paramserver-error-class`` trailer picks the class,
RESOURCE_EXHAUSTED is retried only as back-pressure, and I/O failures map to their classes."""

from __future__ import annotations

import asyncio
import errno

import grpc
import pytest

from paramserver.errors import (
    ERROR_CLASS_METADATA_KEY,
    MessageTooLarge,
    ResourceExhausted,
    StorageError,
    StorageFull,
    from_rpc_error,
    storage_error,
)
from paramserver.worker_client.retry import RETRYABLE, RetryPolicy, call_with_retry, is_retryable


def _error(code: grpc.StatusCode, cls: str | None, details: str = "x") -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata()
    if cls is not None:
        trailing.add(ERROR_CLASS_METADATA_KEY, cls)
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


@pytest.mark.parametrize(
    ("cls", "expected", "retried"),
    [
        ("ResourceExhausted", ResourceExhausted, True),  # back-pressure
        (None, MessageTooLarge, False),  # gRPC's own: a message over the receive limit
        ("StorageFull", StorageFull, False),  # the server's disk: an operator must act
    ],
)
def test_resource_exhausted_is_retried_only_as_back_pressure(
    cls: str | None, expected: type, retried: bool
) -> None:
    err = _error(grpc.StatusCode.RESOURCE_EXHAUSTED, cls)
    assert is_retryable(err, RETRYABLE) is retried
    mapped = from_rpc_error(err)
    assert type(mapped) is expected
    assert mapped.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_message_too_large_fails_at_once_instead_of_retrying_to_the_deadline() -> None:
    attempts = 0

    async def attempt() -> None:
        nonlocal attempts
        attempts += 1
        raise _error(grpc.StatusCode.RESOURCE_EXHAUSTED, None, "Received message larger")

    with pytest.raises(MessageTooLarge):
        asyncio.run(call_with_retry(attempt, RetryPolicy(deadline_s=30.0), "push"))
    assert attempts == 1


def test_storage_error_is_unavailable_and_retried() -> None:
    err = _error(grpc.StatusCode.UNAVAILABLE, "StorageError")
    assert is_retryable(err, RETRYABLE)
    assert type(from_rpc_error(err)) is StorageError


@pytest.mark.parametrize(
    ("code", "cls", "status"),
    [
        (errno.ENOSPC, StorageFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errno.EDQUOT, StorageFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errno.EIO, StorageError, grpc.StatusCode.UNAVAILABLE),
        (errno.EROFS, StorageError, grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_io_failures_map_to_a_code_a_client_can_act_on(
    code: int, cls: type, status: grpc.StatusCode
) -> None:
    exc = storage_error(OSError(code, "boom"), "write-ahead log /data/wal")
    assert type(exc) is cls and exc.code == status
    assert "/data/wal" in exc.message and errno.errorcode[code] in exc.message
