"""Every client implements the worker surface defined once in
:mod:`paramserver.worker_client.surface`: the same methods with the same parameters (an
option a client takes is in the options TypedDict every other client takes too), async on the
asyncio clients and blocking on the sync one. mypy checks the types; this checks the call
signatures as Python sees them, so an option added to one client alone fails here."""

from __future__ import annotations

import inspect
import typing
from typing import Any

import pytest

from paramserver.worker_client import ClusterWorkerClient, SyncWorkerClient, WorkerClient
from paramserver.worker_client import options as options_module
from paramserver.worker_client.sharded import ShardedWorkerClient
from paramserver.worker_client.surface import METHODS, ParameterClient, SyncParameterClient

pytestmark = pytest.mark.timeout(30)


def call_shape(fn: Any) -> list[tuple[str, str, bool]]:
    """(name, kind, has default) per parameter, ``**options: Unpack[TD]`` expanded into TD's
    keys as keyword-only parameters with defaults (sorted, so the order of options in a
    signature does not matter)."""
    sig = inspect.signature(fn)
    positional: list[tuple[str, str, bool]] = []
    keywords: list[tuple[str, str, bool]] = []
    for p in list(sig.parameters.values())[1:]:  # without self
        if p.kind is p.VAR_KEYWORD:
            text = str(p.annotation)
            name = text.removeprefix("Unpack[").removesuffix("]")
            typed = getattr(options_module, name)
            keywords += [(k, "KEYWORD_ONLY", True) for k in typing.get_type_hints(typed)]
        elif p.kind is p.KEYWORD_ONLY:
            keywords.append((p.name, p.kind.name, p.default is not p.empty))
        else:
            positional.append((p.name, p.kind.name, p.default is not p.empty))
    return positional + sorted(keywords)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("client", [WorkerClient, ShardedWorkerClient, ClusterWorkerClient])
def test_async_clients_implement_the_surface(client: type, method: str) -> None:
    impl = getattr(client, method)
    assert inspect.iscoroutinefunction(impl), f"{client.__name__}.{method} is not async"
    assert call_shape(impl) == call_shape(getattr(ParameterClient, method)), method


@pytest.mark.parametrize("method", METHODS)
def test_sync_client_implements_the_surface(method: str) -> None:
    impl = getattr(SyncWorkerClient, method)
    assert not inspect.iscoroutinefunction(impl)
    assert call_shape(impl) == call_shape(getattr(SyncParameterClient, method)), method
    assert call_shape(impl) == call_shape(getattr(ParameterClient, method)), method
