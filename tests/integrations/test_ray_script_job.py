"""``ScriptJob`` (what ``paramserver ray-launch --script`` runs in each worker task) without a
Ray cluster: the script's environment, its prefixed output, its exit status, and the command
line that builds it."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the Ray integration needs Ray: pip install 'paramserver[ray]'")

from paramserver.cli.main import build_parser
from paramserver.cli.ray_launch import script_job
from paramserver.errors import InvalidArgument
from paramserver.integrations.ray import ScriptFailed, ScriptJob

pytestmark = pytest.mark.timeout(60)

SCRIPT = """\
import os, sys
for name in ("PARAMSERVER_ADDRESS", "PARAMSERVER_SHARD_ADDRESSES", "WORKER_INDEX",
             "NUM_WORKERS", "WORKER_NAME", "PARAMSERVER_REPLACE", "EXTRA"):
    print(name, os.environ.get(name))
print("args", sys.argv[1:])
sys.exit(int(os.environ.get("EXIT", "0")))
"""
ADDRESSES = ["127.0.0.2:7001", "127.0.0.3:7002"]


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def test_the_script_gets_the_launcher_environment_and_its_arguments(
    script: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = ScriptJob(str(script), ("--lr", "0.1"), env={"EXTRA": "x", "WORKER_INDEX": "9"})
    result = job.run(ADDRESSES, 1, 3, "job-worker-1")
    expected = [
        "PARAMSERVER_ADDRESS 127.0.0.2:7001",
        "PARAMSERVER_SHARD_ADDRESSES 127.0.0.2:7001,127.0.0.3:7002",
        "WORKER_INDEX 1",  # the launcher's value wins over env=
        "NUM_WORKERS 3",
        "WORKER_NAME job-worker-1",
        "PARAMSERVER_REPLACE 1",
        "EXTRA x",
        "args ['--lr', '0.1']",
    ]
    assert result == {"exit_code": 0, "output": expected}
    assert capsys.readouterr().out.splitlines() == [f"[worker 1] {line}" for line in expected]
    assert job.argv()[:2] == [sys.executable, "-u"]


def test_a_failing_script_fails_the_task_with_its_status_and_last_lines(script: Path) -> None:
    job = ScriptJob(str(script), env={"EXIT": "3"}, output_lines=2)
    with pytest.raises(ScriptFailed) as caught:
        job.run(ADDRESSES, 0, 1, "w")
    assert caught.value.exit_code == 3
    message = str(caught.value)
    assert "exited with status 3" in message and "EXTRA None\nargs []" in message, message
    again = pickle.loads(pickle.dumps(caught.value))  # it travels to the driver
    assert (str(again), again.exit_code) == (message, 3)


def test_the_command_line_passes_the_scripts_flags_through(script: Path) -> None:
    argv = ["ray-launch", "--workers", "2", "--env", "A=b=c", "--script", str(script)]
    args = build_parser(["ray-launch"]).parse_args([*argv, "--b", "--epochs", "3", "-x"])
    job = script_job(args)
    assert (job.script, job.args, dict(job.env)) == (
        str(script.resolve()), ("--b", "--epochs", "3", "-x"), {"A": "b=c"},
    )  # fmt: skip
    assert args.workers == 2 and args.epochs == 10  # ray-launch's own --epochs untouched


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--script"], "--script needs the script"),
        (["--train", "m:f", "--script", "x.py"], "give the job once"),
        (["--script", "no-such-file.py"], "no such script"),
        (["--env", "NOVALUE", "--script", "{script}"], "give NAME=VALUE"),
    ],
)
def test_the_command_line_refuses_a_bad_script_job(
    script: Path, argv: list[str], message: str
) -> None:
    argv = [a.format(script=script) for a in argv]
    args = build_parser(["ray-launch"]).parse_args(["ray-launch", *argv])
    with pytest.raises(InvalidArgument, match=message):
        script_job(args)
