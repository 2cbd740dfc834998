"""Logging setup for the command-line entry points (only entry points configure handlers).

``--log-format text`` (the default) prints ``time level logger: message`` lines;
``--log-format json`` prints one JSON object per line with ``time`` (UTC, ISO 8601 with
milliseconds), ``level``, ``logger``, ``message``, ``exception`` (when one is logged) and every
field passed with ``extra={...}``, for log shippers (Loki, Elasticsearch, Cloud Logging).

Precedence: the flag, then ``PARAMSERVER_LOG_FORMAT``, then ``text``. A format given as a flag
is put back into the process environment so that the processes a command starts (the demo's
server and workers, the launcher's rank servers) log the same way.

While a command runs, :func:`wait_printer` shows every wait it sits in (a server that does not
answer, workers to register, a peer whose lease has to lapse: :mod:`paramserver.waiting`) as a
line on stderr, the first within 2 s and then one every ~5 s.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paramserver.waiting import WaitReport

__all__ = [
    "LOG_FORMATS",
    "LOG_FORMAT_ENV",
    "WAIT_LOGGER",
    "JsonFormatter",
    "configure_logging",
    "wait_printer",
]

LOG_FORMAT_ENV = "PARAMSERVER_LOG_FORMAT"
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__.keys() | {"message", "asctime"}
)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, exception, extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": _dt.datetime.fromtimestamp(record.created, _dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        for name, value in record.__dict__.items():
            if name not in _STANDARD and name not in out:
                out[name] = value
        return json.dumps(out, default=repr, ensure_ascii=False)


def resolve_log_format(flag: str | None, env: Mapping[str, str]) -> str:
    """The log format: ``flag``, then ``PARAMSERVER_LOG_FORMAT`` in ``env``, then ``text``.

    Raises:
        InvalidArgument: not one of ``text`` / ``json`` (INVALID_ARGUMENT).
    """
    value = flag if flag is not None else env.get(LOG_FORMAT_ENV) or "text"
    value = value.strip().lower()
    if value not in LOG_FORMATS:
        from paramserver.errors import InvalidArgument

        raise InvalidArgument(
            f"log format must be one of {', '.join(LOG_FORMATS)}, got {value!r} "
            f"(--log-format or {LOG_FORMAT_ENV})"
        )
    return value


#: Loggers of libraries kept at WARNING unless the level is DEBUG.
QUIET_LIBRARIES = ("matplotlib",)


def configure_logging(
    level: str,
    log_format: str | None = None,
    *,
    env: MutableMapping[str, str] | None = None,
) -> str:
    """Install one stderr handler on the root logger in the chosen format.

    Args:
        level: Level name (DEBUG, INFO, ...); an unknown name means INFO.
        log_format: ``text`` or ``json``; None reads ``PARAMSERVER_LOG_FORMAT``.
        env: Environment to read and to export the format into (default ``os.environ``).

    Returns:
        The format used.

    Raises:
        InvalidArgument: unknown format (INVALID_ARGUMENT).
    """
    environ = os.environ if env is None else env
    fmt = resolve_log_format(log_format, environ)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    chosen = getattr(logging, str(level).upper(), logging.INFO)
    logging.basicConfig(level=chosen, handlers=[handler])
    if chosen > logging.DEBUG:
        # Libraries' own progress notes (matplotlib's "generated new fontManager" on its
        # first run on a machine) are not the command's output: shown at DEBUG only.
        for name in QUIET_LIBRARIES:
            logging.getLogger(name).setLevel(max(chosen, logging.WARNING))
    if log_format is not None:
        environ[LOG_FORMAT_ENV] = fmt  # children started by this command log the same way
    return fmt


#: The logger of the command line's wait lines (under ``--log-format json``): this module's.
WAIT_LOGGER = __name__


class _LibraryWaitRecords(logging.Filter):
    """Leaves out the library's own record of a wait's first report: the wait printer shows
    the same words (and then more, every few seconds)."""

    def __init__(self) -> None:
        from paramserver.waiting import WAIT_FIELD

        super().__init__()
        self._field = WAIT_FIELD

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name == WAIT_LOGGER or not hasattr(record, self._field)


@contextlib.contextmanager
def wait_printer(prog: str, log_format: str) -> Iterator[None]:
    """Inside the block, every report of every wait (:mod:`paramserver.waiting`: the first
    about a second into the wait, then one every ~5 s) is shown on stderr: ``PROG: waiting for
    127.0.0.1:50051 (connection refused; retrying until 18:22:03, 25 s left)``, or under
    ``--log-format json`` that line as one record at INFO of the logger :data:`WAIT_LOGGER`, with
    the fields ``wait_for``, ``wait_address``, ``wait_deadline`` and ``wait_left_s``. Shown
    when the log level lets INFO through (``--log-level WARNING`` keeps a command quiet); the
    library's own INFO record of each wait is then left out of the log (the printer's line
    says it)."""
    from paramserver.waiting import wait_hook

    log = logging.getLogger(WAIT_LOGGER)

    def show(report: WaitReport) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        line = f"{prog}: {report.text}"
        if log_format == "json":
            log.info("%s", line, extra=report.fields())
        else:
            print(line, file=sys.stderr, flush=True)

    quiet = _LibraryWaitRecords()
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        with wait_hook(show):
            yield
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)
