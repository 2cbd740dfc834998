"""Waits a person can see, said out loud: what is waited for, why still, and until when.

A *wait* is a stretch in which a caller sits for a reason outside its own process: a server
that does not answer yet (the client's retry funnel, while connecting or through an outage),
workers still to register (the start barrier), a peer a BSP/SSP pull waits on (a slow one, or a
dead one whose lease has yet to lapse), a server process still starting, a health probe. Each
such place wraps itself in one :class:`Wait`::

    with Wait("4 workers to register", address=server, deadline=t) as w:
        ...
        w.update(detail="2 of 4 registered")

A wait that ends within its first ``report_after_s`` (:data:`FIRST_REPORT_S`) says nothing, so
the fast path of every call stays silent. One that lasts longer is *reported*, e.g.
``waiting for 127.0.0.1:50051 (connection refused; retrying until 18:22:03, 25 s left)``:

* the library logs the first report once, at INFO, on the waiting module's logger, with the
  fields ``wait_for``, ``wait_address``, ``wait_deadline`` (ISO 8601, local time) and
  ``wait_left_s`` for structured logs;
* every report (the first, then one every :data:`REPORT_EVERY_S`) goes to the hook installed
  with :func:`wait_hook`, if any. The library never prints; the command line installs a hook
  that does (``paramserver.cli.logs.wait_printer``).

Waits nest (a connect wait around its retries, a pull wait around an outage's retries): while an
inner wait is open, only the innermost one reports, so one line says what is going on.

Timing: inside a running event loop the reports are scheduled on the loop (``call_later``), so
the ``with`` block only has to ``await``; a blocking poll loop (no running loop) calls
:meth:`Wait.tick` on each turn. A wait may ``probe``: an async callable run (bounded by
:data:`PROBE_TIMEOUT_S`) just before each report to refresh what it says (a pull asks the
server whom it waits for).

This module imports nothing of the package: every layer may use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime as _dt
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Self

__all__ = [
    "FIRST_REPORT_S",
    "PROBE_TIMEOUT_S",
    "REPORT_EVERY_S",
    "WAIT_FIELD",
    "Wait",
    "WaitHook",
    "WaitReport",
    "current_wait",
    "wait_hook",
]

_log = logging.getLogger(__name__)

#: A wait that lasts this long (seconds) is reported for the first time.
FIRST_REPORT_S = 1.0
#: Later reports (to the hook only), one per this many seconds while the wait lasts.
REPORT_EVERY_S = 5.0
#: Longest a wait's probe may take before a report goes out without it (seconds).
PROBE_TIMEOUT_S = 2.0
#: The attribute that marks a log record as a wait's report (its value: what is waited for).
WAIT_FIELD = "wait_for"


@dataclass(frozen=True)
class WaitReport:
    """One report of a wait, as logged and as handed to the hook.

    Attributes:
        what: What is waited for (an address, ``4 workers to register``, a peer's name).
        detail: Why it still waits (``connection refused``, ``2 of 4 registered``); may be "".
        address: The server involved, when there is one.
        deadline: Wall-clock time (``time.time()`` seconds) the wait ends at, or None.
        until: How the deadline reads (``retrying until``, ``gives up at``, ``its lease lapses
            at``).
        elapsed_s: Seconds since the wait began.
        left_s: Seconds to the deadline (never negative), or None.
        first: The wait's first report (the one the library logs).
    """

    what: str
    detail: str
    address: str | None
    deadline: float | None
    until: str
    elapsed_s: float
    left_s: float | None
    first: bool

    @property
    def text(self) -> str:
        """``waiting for WHAT (DETAIL; UNTIL HH:MM:SS, N s left)``."""
        parts = [self.detail] if self.detail else []
        if self.deadline is not None and self.left_s is not None:
            at = time.strftime("%H:%M:%S", time.localtime(self.deadline))
            parts.append(f"{self.until} {at}, {self.left_s:.0f} s left")
        else:
            parts.append(f"{self.elapsed_s:.0f} s so far")
        return f"waiting for {self.what} ({'; '.join(parts)})"

    def fields(self) -> dict[str, str | float | None]:
        """The report as log-record fields (``extra=``): ``wait_for`` (:data:`WAIT_FIELD`),
        ``wait_address``, ``wait_deadline`` (ISO 8601 local time, or None), ``wait_left_s``."""
        deadline = (
            None
            if self.deadline is None
            else _dt.datetime.fromtimestamp(self.deadline).astimezone().isoformat("T", "seconds")
        )
        return {
            WAIT_FIELD: self.what,
            "wait_address": self.address,
            "wait_deadline": deadline,
            "wait_left_s": None if self.left_s is None else round(self.left_s, 1),
        }


#: Receives every report of every wait (see :func:`wait_hook`).
WaitHook = Callable[[WaitReport], None]

_hook: WaitHook | None = None
_current: contextvars.ContextVar[Wait | None] = contextvars.ContextVar(
    "paramserver_wait", default=None
)
#: Set while a wait's probe runs: waits the probe opens (its calls' retries) say nothing.
_quiet: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "paramserver_wait_quiet", default=False
)


@contextlib.contextmanager
def wait_hook(hook: WaitHook | None) -> Iterator[None]:
    """Hand every wait's reports to ``hook`` (process-wide) inside the block; the hook in place
    before is restored after it. A hook that raises is logged at DEBUG and otherwise ignored."""
    global _hook
    before, _hook = _hook, hook
    try:
        yield
    finally:
        _hook = before


def current_wait() -> Wait | None:
    """The innermost open wait of this task (or thread), if any."""
    return _current.get()


class Wait:
    """One wait a person can see (see the module docstring).

    Args:
        what: What is waited for.
        detail: Why it still waits (updated with :meth:`update`).
        address: The server involved, if any.
        deadline: When the wait ends, in ``time.monotonic()`` seconds; None: not known.
        until: How the deadline reads in the report.
        began: When the wait began (``time.monotonic()``; default: on entry).
        logger: Where the first report is logged (default: this module's logger).
        probe: Async callable run before each report, given the wait to :meth:`update`; a
            probe that returns False, raises or runs past :data:`PROBE_TIMEOUT_S` skips this
            report (nothing true to say now). Waits opened by the probe say nothing.
        report_after_s: The first report comes this long after ``began``.
    """

    def __init__(
        self,
        what: str,
        *,
        detail: str = "",
        address: str | None = None,
        deadline: float | None = None,
        until: str = "gives up at",
        began: float | None = None,
        logger: logging.Logger | None = None,
        probe: Callable[[Wait], Awaitable[bool | None]] | None = None,
        report_after_s: float = FIRST_REPORT_S,
    ) -> None:
        self.what = what
        self.detail = detail
        self.address = address
        self.deadline = deadline
        self.until = until
        self.began = time.monotonic() if began is None else began
        self.logger = logger or _log
        self.probe = probe
        self.reports = 0
        self._due = self.began + report_after_s
        self._parent: Wait | None = None
        self._inner = 0
        self._open = False
        self._token: contextvars.Token[Wait | None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._probing: asyncio.Task[None] | None = None

    def update(
        self,
        *,
        what: str | None = None,
        detail: str | None = None,
        address: str | None = None,
        deadline: float | None = None,
        until: str | None = None,
    ) -> None:
        """Change what the next report says (arguments left None stay as they are)."""
        if what is not None:
            self.what = what
        if detail is not None:
            self.detail = detail
        if address is not None:
            self.address = address
        if deadline is not None:
            self.deadline = deadline
        if until is not None:
            self.until = until

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Self:
        return self.open()

    def open(self, *, nest: bool = True) -> Self:
        """Begin reporting (what ``with`` does on entry). ``nest=False``: not the current wait
        of this task (a wait opened by a timer callback on behalf of calls in flight), so waits
        opened inside those calls do not count it as their outer wait."""
        if nest:
            self._parent = _current.get()
            if self._parent is not None:
                self._parent._inner += 1
            self._token = _current.set(self)
        self._open = True
        if _quiet.get():  # opened by a probe: its outer wait speaks
            self._due = float("inf")
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None  # a blocking caller: it calls tick()
        self._schedule()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """End the wait: no more reports (what ``with`` does on leaving the block)."""
        if not self._open:
            return
        self._open = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._probing is not None:
            self._probing.cancel()
            self._probing = None
        if self._token is not None:
            with contextlib.suppress(ValueError):  # closed from another context
                _current.reset(self._token)
            self._token = None
        if self._parent is not None:
            self._parent._inner -= 1
            self._parent = None

    # ------------------------------------------------------------------ reports
    def tick(self) -> None:
        """Report now if a report is due (blocking poll loops call this on every turn: they may
        run inside an event loop they block, whose timers then never fire)."""
        if self._open and time.monotonic() >= self._due:
            self._report()

    def _schedule(self) -> None:
        if self._loop is not None and self._open and self._due != float("inf"):
            self._timer = self._loop.call_later(max(0.0, self._due - time.monotonic()), self._fire)

    def _fire(self) -> None:
        self._timer = None
        if not self._open:
            return
        if time.monotonic() < self._due:  # tick() reported meanwhile
            self._schedule()
            return
        if self.probe is not None and self._inner == 0 and self._loop is not None:
            self._probing = self._loop.create_task(self._probe_then_report())
            return
        self._report()
        self._schedule()

    async def _probe_then_report(self) -> None:
        assert self.probe is not None
        _quiet.set(True)  # this task's own context: the waiting code is not affected
        say: bool | None
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                say = await self.probe(self)
        except Exception as exc:  # nothing known for sure: no report this time
            _log.debug("probe of the wait for %s failed: %r", self.what, exc)
            say = False
        self._probing = None
        if not self._open:
            return
        if say is False:
            self._due = time.monotonic() + min(REPORT_EVERY_S, FIRST_REPORT_S)
        else:
            self._report()
        self._schedule()

    def snapshot(self) -> WaitReport:
        """The report this wait would give now."""
        now = time.monotonic()
        left = None if self.deadline is None else max(0.0, self.deadline - now)
        return WaitReport(
            what=self.what,
            detail=self.detail,
            address=self.address,
            deadline=None if left is None else time.time() + left,
            until=self.until,
            elapsed_s=now - self.began,
            left_s=left,
            first=self.reports == 0,
        )

    def _report(self) -> None:
        self._due = time.monotonic() + REPORT_EVERY_S
        if self._inner > 0:
            return  # an inner wait says what is going on
        report = self.snapshot()
        self.reports += 1
        if report.first:
            self.logger.info("%s", report.text, extra=report.fields())
        hook = _hook
        if hook is not None:
            try:
                hook(report)
            except Exception as exc:
                _log.debug("wait hook failed: %r", exc)
