"""The examples in ``examples/``: ordinary PyTorch scripts trained by ``paramserver run`` under
BSP and SSP reach a final metric within 2% of the same script run alone in one process.

* ``digits_cnn.py``: a small CNN on scikit-learn's digits; metric: test accuracy.
* ``char_lm.py``: a char-RNN on the standard library's ``pydoc_data.topics`` text; metric:
  validation bits per character.

The single-process run (no launcher, plain ``torch.optim``) is the oracle. Two workers split
each step's batch, so under BSP with mean aggregation every step is the single-process step on
the same examples (the two runs agree to float rounding); under SSP(2) each worker's gradient is
applied on arrival, a different but converging algorithm. Every worker trains as many steps as
the single process (its share of each step), and under BSP both end on the same parameters.

A BSP run is deterministic up to float rounding, so one run is checked. An SSP run's final
metric is one draw of a random variable (the order in which the two workers' pushes arrive
decides the trajectory): measured on the 2-vCPU development host under load, 52 digits runs gave
0.9710-0.9903 against 0.9826 alone, and 12 char_lm runs 2.063-2.127 bits against 2.0875 (on
average 1% worse: stale gradients under Adam), while one CI run of digits ended at 0.9497. So
the SSP claim checked is that of the typical run: the median of five runs is within the
tolerance (three runs, more only while the count is open).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the examples need torch: pip install 'paramserver[torch]'")
pytest.importorskip("sklearn", reason="digits_cnn.py needs scikit-learn (the demo extra)")

from tests.harness import ScriptProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(720)]  # up to 5 runs of 120 s

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
WORKERS = 2
#: Relative distance allowed between a cluster run's final metric and the single process's.
TOLERANCE = 0.02


@dataclass(frozen=True)
class Example:
    script: str
    metric: str


CASES = [Example("digits_cnn.py", "test_accuracy"), Example("char_lm.py", "val_bits_per_char")]


def finals(example: Example, output: str) -> dict[str, tuple[float, int]]:
    """``{"worker I" or "": (metric, steps)}`` from the ``final METRIC X steps S`` lines."""
    pattern = rf"(?:\[(worker \d+)\] )?final {example.metric} (\S+) steps (\d+)"
    found = [re.fullmatch(pattern, line) for line in output.splitlines()]
    return {m.group(1) or "": (float(m.group(2)), int(m.group(3))) for m in found if m}


def run(tmp: Path, name: str, argv: list[str]) -> tuple[str, str, float]:
    """(stdout, stderr, wall seconds) of a script that must exit 0."""
    t0 = time.monotonic()
    with ScriptProcess(tmp, name, argv, group=True) as proc:
        out, err = proc.communicate(timeout_s=120)
        assert proc.proc.returncode == 0, f"{name} exited {proc.proc.returncode}: {err[-3000:]}"
    return out, err, time.monotonic() - t0


def cluster_run(
    example: Example, consistency: str, tmp: Path, steps: int
) -> tuple[float, str, float]:
    """One ``paramserver run`` of the example: (its final metric, a report of the run, wall s).

    Checks what holds for every run: each worker reports, trained ``steps`` steps, and all end
    on the same parameters (``ServerOptimizer.synchronize``: every worker's updates applied).
    """
    flags = ["--consistency", consistency] + (["--staleness", "2"] if consistency == "ssp" else [])
    argv = ["-m", "paramserver", "run", "--workers", str(WORKERS), *flags]
    out, err, wall_s = run(tmp, "run", [*argv, str(EXAMPLES / example.script)])
    got = finals(example, out)
    report = f"stdout:\n{out[-4000:]}\nstderr:\n{err[-2000:]}"
    assert set(got) == {f"worker {i}" for i in range(WORKERS)}, report
    for worker, (_, worker_steps) in got.items():
        assert worker_steps == steps, (worker, worker_steps, steps, report)  # its share of each
    assert len({metric for metric, _ in got.values()}) == 1, (got, report)
    return next(iter(got.values()))[0], report, wall_s


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[float, int]]]:
    """Each example's single-process (metric, steps), run once per module, on first use."""
    tmp = tmp_path_factory.mktemp("alone")

    class Lazy(dict[str, tuple[float, int]]):
        def __missing__(self, script: str) -> tuple[float, int]:
            example = next(e for e in CASES if e.script == script)
            out, _, wall_s = run(tmp, script, [str(EXAMPLES / script)])
            got = finals(example, out)
            assert set(got) == {""}, out
            print(f"\n[example] {script} alone: {example.metric} {got[''][0]} ({wall_s:.1f} s)")
            self[script] = got[""]
            return got[""]

    yield Lazy()


@pytest.mark.parametrize("consistency", ["bsp", "ssp"])
@pytest.mark.parametrize("example", CASES, ids=[e.script for e in CASES])
def test_example_under_paramserver_run_matches_one_process(
    example: Example, consistency: str, alone: dict[str, tuple[float, int]], tmp_path: Path
) -> None:
    want, steps = alone[example.script]
    runs: list[tuple[float, str, float]] = []
    needed = 1 if consistency == "bsp" else 3  # of at most 2 * needed - 1 runs: the median
    while (hits := sum(abs(m - want) <= TOLERANCE * want for m, _, _ in runs)) < needed:
        if len(runs) - hits >= needed:
            metrics = [m for m, _, _ in runs]
            reports = "\n\n".join(f"run {i}: {m}\n{r}" for i, (m, r, _) in enumerate(runs))
            pytest.fail(
                f"{example.script} {consistency}: {example.metric} {metrics} against "
                f"{TOLERANCE:.0%} of {want} alone: {hits} of {len(runs)} runs within, {needed} "
                f"needed\n{reports}"
            )
        runs.append(cluster_run(example, consistency, tmp_path, steps))
    print(
        f"\n[example] {example.script} {consistency}: {example.metric} "
        f"{[m for m, _, _ in runs]} vs {want} alone ({sum(w for _, _, w in runs):.1f} s)"
    )
