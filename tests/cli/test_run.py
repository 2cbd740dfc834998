"""``paramserver run``: N processes of a user's script on a local cluster, with the
environment a worker reads, prefixed output, the worst exit code, and a killed worker
restarted under its name that resumes where its name left off (no step trained twice)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness import ScriptProcess
from tests.harness.processes import HERE

pytestmark = pytest.mark.timeout(120)

WORKER = HERE / "run_worker.py"


def run(tmp: Path, *argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    cmd = ["-m", "paramserver", "run", *argv]
    with ScriptProcess(tmp, "run", cmd, env=env, group=True) as proc:
        out, err = proc.communicate(timeout_s=90)
        return proc.proc.returncode, out, err


def test_workers_get_their_environment_and_prefixed_output(tmp_path: Path) -> None:
    code, out, err = run(
        tmp_path, "--workers", "3", "--consistency", "bsp", str(WORKER), "4", "-", "a", "--b"
    )
    assert code == 0, err
    for i in range(3):
        assert f"[worker {i}] done {i} 3 worker-{i} ['a', '--b']" in out.splitlines()
        assert f"[worker {i}] resumed 0" in out.splitlines()


def test_exit_code_is_the_worst_workers(tmp_path: Path) -> None:
    env = {"EXIT_CODE_0": "3", "EXIT_CODE_1": "5"}
    code, _, err = run(tmp_path, "--workers", "3", str(WORKER), "1", env=env)
    assert code == 5, err
    assert "worst worker exit code 5" in err


def test_a_killed_worker_is_restarted_and_trains_no_step_twice(tmp_path: Path) -> None:
    """Worker 1 dies by SIGKILL between its push and its clock of step 2; restarted under its
    name it replaces its dead registration (whose queued push leaves the BSP step), learns
    that its name completed 2 steps and trains its steps 2..5 once. Under BSP with sum
    aggregation every completed step of every worker adds exactly 1 to x."""
    steps, workers = 6, 2
    crash = tmp_path / "crashed"
    code, out, err = run(
        tmp_path,
        "--workers", str(workers), "--consistency", "bsp", "--aggregation", "sum",
        "--max-restarts", "1", str(WORKER), str(steps), str(crash),
    )  # fmt: skip
    assert code == 0, err
    assert crash.exists()
    lines = out.splitlines()
    assert "[worker 1] resumed 0" in lines and "[worker 1] resumed 2" in lines, out
    assert "worker 1 exited with 137; restarting it (1 of 1)" in err
    assert sum(1 for ln in lines if re.fullmatch(r"\[worker \d\] done .*", ln)) == workers
    # One applied update per worker per step, each exactly once. The replacement continues
    # at its predecessor's clock (it redoes step 2 in step 2), so both workers end on the
    # same last step and each one's final read sees every update.
    planned = steps * workers
    finals = [re.search(r"final x (\S+) applied (\d+)", ln) for ln in lines]
    got = [(float(m.group(1)), int(m.group(2))) for m in finals if m]
    assert got == [(planned, planned)] * workers, out


def test_the_scripts_flags_pass_through_even_when_they_abbreviate_ours() -> None:
    """``--s`` would abbreviate --shards, --staleness, --server...: after the script, every
    argument is the script's own, never taken for (or refused as) one of ``run``'s."""
    from paramserver.cli.main import build_parser

    argv = ["run", "--workers", "3", "train.py", "--s", "1", "--workers", "4", "--ser"]
    args = build_parser(["run"]).parse_args(argv)
    assert (args.workers, args.script, args.args) == (3, "train.py", argv[4:])
