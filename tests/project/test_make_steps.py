"""`make test`'s steps (scripts/test_steps.py): a step whose extra is missing is skipped with a
line saying so and exit status 0; a step that selects nothing although it could fails."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SESSION_ENV, XDIST_WORKER_ENV

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "test_steps.py"
RAY_TESTS = "tests/integrations/test_ray_engine.py"
#: One small file for the suite step, and the Ray tests for the ray step.
BOTH = ("tests/project/test_public_api.py", RAY_TESTS)

pytestmark = pytest.mark.timeout(120)


def steps(*args: str) -> subprocess.CompletedProcess[str]:
    """The steps with ``--collect-only``, in a pytest session of their own (its leak check
    must not take this one's processes, nor this one its processes, for its own)."""
    env = {k: v for k, v in os.environ.items() if k not in (SESSION_ENV, XDIST_WORKER_ENV)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--collect-only", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )


def test_makefile_test_target_runs_the_steps() -> None:
    recipe = (ROOT / "Makefile").read_text().split("\ntest: ", 1)[1].split("\n\n", 1)[0]
    assert "scripts/test_steps.py" in recipe and "pytest" not in recipe.split("\n", 1)[1]


def test_a_step_whose_extra_is_missing_is_skipped_not_failed() -> None:
    run = steps("--without", "ray", *BOTH)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "skipping the ray step" in run.stdout and "make install EXTRAS=ray" in run.stdout
    assert "suite step" in run.stdout and "test_public_api.py::" in run.stdout


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the ray extra")
def test_the_ray_step_runs_when_ray_is_installed() -> None:
    run = steps(*BOTH)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ray step" in run.stdout and "skipping" not in run.stdout
    assert "test_ray_engine.py::" in run.stdout


def test_a_step_that_selects_nothing_fails_with_pytests_status() -> None:
    run = steps("--without", "ray", "tests/project/test_public_api.py", "-k", "no_test_has_this")
    assert run.returncode == 5, run.stdout + run.stderr
    assert "the suite step selected no test" in run.stdout
