"""The suite's deadlines scale (tests/harness/timing.py): the knob is validated, and a test's
pytest-timeout limit is its written limit times the scale."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SESSION_ENV, XDIST_WORKER_ENV
from tests.harness.timing import TIME_SCALE_ENV, configured_scale, scaled

ROOT = Path(__file__).resolve().parents[2]


def test_the_knob_defaults_to_one_and_takes_numbers_from_one_up() -> None:
    assert configured_scale({}) == 1.0
    assert configured_scale({TIME_SCALE_ENV: " "}) == 1.0
    assert configured_scale({TIME_SCALE_ENV: "2.5"}) == 2.5


@pytest.mark.parametrize("bad", ["0.5", "0", "-3", "fast", "nan"])
def test_the_knob_refuses_what_is_not_a_number_from_one_up(bad: str) -> None:
    with pytest.raises(ValueError, match=TIME_SCALE_ENV):
        configured_scale({TIME_SCALE_ENV: bad})


def test_scaled_never_shortens_a_deadline() -> None:
    assert scaled(7.0) >= 7.0 * configured_scale()


INNER = """
import pytest

@pytest.mark.timeout(7)
def test_marked(request):
    print("LIMIT", request.node.get_closest_marker("timeout").args[0])

def test_ini_default(request):
    print("LIMIT", request.node.get_closest_marker("timeout").args[0])
"""


@pytest.mark.timeout(60)
def test_a_tests_limit_is_its_written_limit_times_the_knob(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {k: v for k, v in os.environ.items() if k not in (SESSION_ENV, XDIST_WORKER_ENV)}
    env[TIME_SCALE_ENV] = "5"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "tests.conftest",
         "-p", "no:cacheprovider", "-o", "timeout=120", str(tmp_path / "test_inner.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=50,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    limits = [float(line.split()[1]) for line in run.stdout.splitlines() if "LIMIT" in line]
    assert len(limits) == 2
    assert limits[0] >= 7 * 5 and limits[1] >= 120 * 5
    # at most the load's cap above the knob
    assert limits[0] <= 7 * 5 * 12 and limits[1] <= 120 * 5 * 12
