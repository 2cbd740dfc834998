"""Deadlines that scale with how busy the machine is: the suite's one knob for slow machines.

Every hang guard of the suite (``eventually``, the harness's waits for processes to start, print
or exit, and pytest-timeout's per-test limit) is written as the time it allows on an idle
machine and passed through :func:`scaled`, which multiplies it by

* ``PARAMSERVER_TEST_TIME_SCALE`` (a number >= 1, default 1): raise it on a machine known to be
  slow (``PARAMSERVER_TEST_TIME_SCALE=3 make test``), and
* the machine's load when the deadline is set: the 1-minute load average per core, when above 1
  (at load 20 on 2 cores a 30 s guard allows 300 s), at most :data:`MAX_LOAD_FACTOR`.

A test's verdict never depends on a deadline being met quickly: deadlines only bound how long a
broken test hangs, so scaling them changes no outcome on an idle machine.
"""

from __future__ import annotations

import os

TIME_SCALE_ENV = "PARAMSERVER_TEST_TIME_SCALE"
#: The largest factor the load alone can add (a hang still ends within this many idle limits).
MAX_LOAD_FACTOR = 12.0


def configured_scale(environ: dict[str, str] | None = None) -> float:
    """The knob's value (1 when unset). Raises ValueError naming the variable when it is not
    a number >= 1."""
    raw = (os.environ if environ is None else environ).get(TIME_SCALE_ENV, "").strip()
    if not raw:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 1.0:  # NaN too
        raise ValueError(f"{TIME_SCALE_ENV}={raw!r}: give a number >= 1 (1 = an idle machine)")
    return value


def load_factor() -> float:
    """The 1-minute load average per core, clamped to [1, MAX_LOAD_FACTOR]."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover - not on Linux
        return 1.0
    return min(MAX_LOAD_FACTOR, max(1.0, load / (os.cpu_count() or 1)))


def time_scale() -> float:
    """The factor every deadline of the suite is multiplied by, now."""
    return configured_scale() * load_factor()


def scaled(seconds: float) -> float:
    """``seconds`` (what an idle machine needs, with room) as a deadline for this machine now."""
    return seconds * time_scale()
