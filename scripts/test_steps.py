"""`make test`: the suite's steps, each run only when what it needs is installed.

Steps, in order:

1. ``suite``: every test not marked ``ray``, in ``--workers`` pytest-xdist processes
   (``--dist loadfile``: a test file runs whole in one process).
2. ``ray``: the tests marked ``ray`` (a real multi-node Ray cluster on this machine), alone, so
   the cluster has the machine to itself. Needs the ``ray`` extra.

A step whose extra is not installed is skipped with a line saying so (``make test`` still exits
0): the README's set-up installs only the ``demo`` and ``dev`` extras. A step whose extra is
installed and that still selects no test fails, as pytest's exit status 5 says.

``--collect-only`` runs every step's selection without running a test (how CI checks, in a
fresh clone with only the default extras, that ``make test`` would pass its steps). ``--without
MODULE`` treats an installed module as missing (how the suite tests the skip line on a machine
that has every extra). Exit status: the first failing step's pytest status, else 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    name: str
    #: pytest's marker expression (``-m``).
    markers: str
    #: Modules the step needs, and the extra that installs them.
    needs: tuple[str, ...] = ()
    extra: str = ""
    #: Runs in the xdist processes (``-n``), or alone in this one.
    parallel: bool = False
    why: str = ""


STEPS = (
    Step("suite", "not ray", parallel=True, why="unit, integration and fault tests"),
    Step(
        "ray",
        "ray",
        needs=("ray",),
        extra="ray",
        why="a real multi-node Ray cluster: alone, not beside other tests",
    ),
)

#: pytest's exit status when a selection holds no test.
NO_TESTS_COLLECTED = 5


def missing_modules(step: Step, without: Sequence[str]) -> list[str]:
    """The modules of ``step.needs`` that cannot be imported here (or that ``without`` names)."""
    return [m for m in step.needs if m in without or importlib.util.find_spec(m) is None]


def pytest_command(step: Step, workers: int, collect_only: bool, extra: Sequence[str]) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", step.markers]
    if collect_only:
        cmd.append("--collect-only")
    elif step.parallel and workers > 1:
        cmd += ["-n", str(workers), "--dist", "loadfile"]
    return cmd + list(extra)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist processes (-n)")
    parser.add_argument(
        "--collect-only", action="store_true", help="select each step's tests, run none"
    )
    parser.add_argument(
        "--without", action="append", default=[], metavar="MODULE", help="treat as not installed"
    )
    args, pytest_args = parser.parse_known_args(argv)  # the rest goes to every step's pytest
    for step in STEPS:
        missing = missing_modules(step, args.without)
        if missing:
            print(
                f"make test: skipping the {step.name} step (pytest -m {step.markers!r}): "
                f"{', '.join(missing)} is not installed; `make install EXTRAS={step.extra}` "
                "adds it",
                flush=True,
            )
            continue
        cmd = pytest_command(step, args.workers, args.collect_only, pytest_args)
        print(f"make test: {step.name} step ({step.why}): {shlex.join(cmd[1:])}", flush=True)
        code = subprocess.call(cmd)
        if code == NO_TESTS_COLLECTED:
            print(f"make test: the {step.name} step selected no test (exit status 5)", flush=True)
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
