"""Waits a person can see say what they wait for (issue 28, item 3): the library logs one INFO
line per wait naming what it waits for, the address and the deadline, and hands every report
to the wait hook (the command line prints them); short waits say nothing. Also the
AlreadyExists hint, worded ``replace=True`` in Python and ``--replace`` on the command line
(issue 28, item 4)."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import pytest

from paramserver import waiting
from paramserver.cli.logs import WAIT_LOGGER, wait_printer
from paramserver.cli.main import error_line
from paramserver.errors import AlreadyExists, Unavailable, WaitTimeout
from paramserver.reduction import connect_reduction
from paramserver.waiting import WAIT_FIELD, Wait, WaitReport, wait_hook
from paramserver.worker_client import RetryPolicy, WorkerClient, connect
from tests.harness import free_port, running_cluster, running_server
from tests.harness.clusters import address_of

pytestmark = pytest.mark.timeout(120)


def wait_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The library's INFO records of waits (not the command line's)."""
    return [
        r
        for r in caplog.records
        if hasattr(r, WAIT_FIELD) and r.levelno == logging.INFO and r.name != WAIT_LOGGER
    ]


def test_a_short_wait_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    seen: list[WaitReport] = []
    with wait_hook(seen.append), Wait("something", report_after_s=60.0) as w:
        w.tick()
    assert seen == [] and wait_records(caplog) == []


def test_a_long_wait_is_logged_once_and_reported_every_time(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blocking poll loop (no event loop) drives the reports with tick()."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(waiting, "REPORT_EVERY_S", 0.05)
    seen: list[WaitReport] = []
    deadline = time.monotonic() + 30
    with (
        wait_hook(seen.append),
        Wait("h:1", address="h:1", deadline=deadline, report_after_s=0.0) as w,
    ):
        for n in range(3):
            w.update(detail=f"try {n}")
            w.tick()
            time.sleep(0.06)
    assert len(seen) == 3 and [r.first for r in seen] == [True, False, False]
    assert seen[-1].text.startswith("waiting for h:1 (try 2; gives up at ")
    (record,) = wait_records(caplog)
    assert record.getMessage().startswith("waiting for h:1 (try 0; gives up at ")
    assert record.wait_address == "h:1"  # type: ignore[attr-defined]
    assert record.wait_deadline and 25 < record.wait_left_s <= 30  # type: ignore[attr-defined]


async def test_an_unanswered_connect_is_one_info_line_naming_address_and_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing listens: the connect's retries are one wait, logged once (the outer connect
    wait stays silent while its retries speak)."""
    caplog.set_level(logging.INFO)
    address = f"127.0.0.1:{free_port()}"
    seen: list[WaitReport] = []
    with wait_hook(seen.append), pytest.raises(Unavailable):
        async with connect(address, "w", retry=RetryPolicy(deadline_s=2.5)):
            pass
    (record,) = wait_records(caplog)
    text = record.getMessage()
    assert text.startswith(f"waiting for {address} (connection refused; retrying until "), text
    assert record.wait_address == address  # type: ignore[attr-defined]
    assert 0 <= record.wait_left_s <= 2.5  # type: ignore[attr-defined]
    assert seen and seen[0].first and seen[0].address == address


async def test_the_start_barrier_says_how_many_registered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    async with running_server(consistency="asp") as daemon:
        address = address_of(daemon)
        async with WorkerClient(address, "alone", heartbeat=False) as ps:
            with pytest.raises(WaitTimeout):
                await ps.wait_for_workers(2, timeout_s=2.5)
    (record,) = wait_records(caplog)
    text = record.getMessage()
    assert text.startswith(f"waiting for 2 workers to register at {address} (1 of 2 registered; ")
    assert "gives up at" in text and record.wait_deadline  # type: ignore[attr-defined]


async def test_a_held_bsp_pull_names_the_silent_peer_and_when_its_lease_lapses(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed peer (here: one that stopped heartbeating) holds a BSP pull until its lease
    lapses; the waiting worker says whom it waits for, and, once the peer is silent, when its
    lease lapses. One INFO line for the whole wait."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(waiting, "REPORT_EVERY_S", 1.0)
    seen: list[WaitReport] = []
    async with running_server(consistency="bsp", lease_ms=6000) as daemon:
        address = address_of(daemon)
        async with (
            connect(address, "dead-peer", heartbeat=False),
            connect(address, "survivor") as ps,
        ):
            await ps.init({"w": np.zeros(4, np.float32)})
            await ps.push({"w": np.ones(4, np.float32)})
            await ps.clock()
            with wait_hook(seen.append):
                await ps.pull(["w"], timeout_s=60)  # admitted once the peer is evicted
    records = [r for r in wait_records(caplog) if r.name.endswith("pull_waits")]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].getMessage().startswith("waiting for dead-peer (at clock 0, this worker at 1")
    assert seen and all(r.what == "dead-peer" for r in seen), [r.text for r in seen]
    lapsing = [r for r in seen if "its lease lapses at" in r.text]
    assert lapsing and "silent for" in lapsing[-1].text, [r.text for r in seen]


async def test_a_fast_pull_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with running_server(consistency="bsp") as daemon:
        async with connect(address_of(daemon), "only") as ps:
            await ps.init({"w": np.zeros(4, np.float32)})
            for _ in range(20):
                await ps.push({"w": np.ones(4, np.float32)})
                await ps.clock()
                await ps.pull(["w"])
            await asyncio.sleep(0)
    assert wait_records(caplog) == []


async def test_a_taken_name_names_replace_true_in_python_and_the_flag_on_the_cli() -> None:
    async with running_server(consistency="asp", lease_ms=60_000) as daemon:
        address = address_of(daemon)
        async with WorkerClient(address, "w0", heartbeat=False):
            with pytest.raises(AlreadyExists) as caught:
                async with connect(address, "w0", heartbeat=False):
                    pass
    exc = caught.value
    assert "already registered as 'w0#1', whose lease lapses in" in exc.message
    assert "pass replace=True to fence it now" in exc.message
    assert exc.hint is not None and exc.hint.cli().startswith("pass --replace to fence it now")
    line = error_line(exc)
    assert "pass --replace to fence it now" in line and "replace=True" not in line, line


async def test_the_reduction_client_words_the_hint_the_same_way() -> None:
    async with running_server(mode="reduce") as daemon:
        address = f"127.0.0.1:{daemon.port}"
        async with connect_reduction(address, "w0", heartbeat=False):
            with pytest.raises(AlreadyExists) as caught:
                async with connect_reduction(address, "w0", heartbeat=False):
                    pass
    assert "already registered as 'w0#1'; pass replace=True" in caught.value.message
    assert "pass --replace" in error_line(caught.value)


async def test_the_hint_survives_a_sharded_clusters_combined_error() -> None:
    async with running_cluster(2, consistency="asp", lease_ms=60_000) as daemons:
        address = daemons[0].address
        async with connect(address, "w0", heartbeat=False):
            with pytest.raises(AlreadyExists) as caught:
                async with connect(address, "w0", heartbeat=False):
                    pass
    line = error_line(caught.value)
    assert "--replace" in line and "replace=True" not in line, line


def test_the_cli_printer_prints_every_report_and_hides_the_librarys_duplicate(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.INFO)
    with (
        wait_printer("paramserver worker", "text"),
        Wait("h:1", detail="connection refused", report_after_s=0.0) as w,
    ):
        w.tick()
    err = capsys.readouterr().err
    assert err.startswith("paramserver worker: waiting for h:1 (connection refused; 0 s so far)")
    # the library's record is left out of the log handlers while the printer shows it
    assert [r for r in caplog.records if hasattr(r, WAIT_FIELD)] == []
    with (
        wait_printer("paramserver worker", "json"),
        Wait("h:1", address="h:1", report_after_s=0.0) as w,
    ):
        w.tick()
    (record,) = [r for r in caplog.records if hasattr(r, WAIT_FIELD)]
    assert record.name == WAIT_LOGGER and record.wait_address == "h:1"  # type: ignore[attr-defined]
