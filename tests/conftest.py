"""Shared fixtures: every async test runs on the default asyncio loop and on uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a runtime dependency on POSIX
    uvloop = None


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop
    }
    if "conformance" in item.nodeid.split("::")[0].split("/"):
        return factories  # the server is under test there, not the client's event loop
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories
