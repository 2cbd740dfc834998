"""``paramserver worker`` progress: readable lines by default, JSON lines on request."""

from __future__ import annotations

import json

import pytest

from paramserver.cli.demos.digits import _emit, progress_format, progress_line
from paramserver.cli.main import build_parser

EPOCH = {
    "event": "epoch",
    "worker": 1,
    "epoch": 3,
    "epochs": 10,
    "loss": 0.21204,
    "clock": 33,
    "elapsed_s": 2.5,
    "test_accuracy": 0.95,
    "train_elapsed_s": 1.234,
}


def test_readable_lines_of_every_event() -> None:
    assert progress_line(EPOCH) == (
        "worker 1: epoch 3/10  loss 0.2120  test accuracy 0.9500  clock 33  [1.2 s]"
    )
    start = {"event": "start", "worker": 0, "test_accuracy": 0.1}
    assert progress_line(start) == (
        "worker 0: every worker registered, training starts  test accuracy 0.1000"
    )
    done = {"event": "done", "worker": 2, "test_accuracy": 0.96, "steps": 440, "elapsed_s": 9.87}
    assert progress_line(done) == "worker 2: done after 440 steps in 9.9 s, test accuracy 0.9600"


def test_json_progress_is_one_object_per_line(capsys: pytest.CaptureFixture[str]) -> None:
    _emit(EPOCH, "json")
    _emit(EPOCH, "text")
    json_line, text_line = capsys.readouterr().out.splitlines()
    assert json.loads(json_line) == EPOCH
    assert text_line == progress_line(EPOCH)


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {}, "text"),
        (["--log-format", "json"], {}, "json"),
        ([], {"PARAMSERVER_LOG_FORMAT": "json"}, "json"),
        (["--log-format", "json", "--progress", "text"], {}, "text"),
        (["--progress", "json"], {}, "json"),
    ],
)
def test_the_progress_format_follows_the_log_format_unless_given(
    argv: list[str], env: dict[str, str], expected: str
) -> None:
    base = ["worker", "--server", "127.0.0.1:1", "--worker-index", "0", "--num-workers", "1"]
    args = build_parser().parse_args([*base, *argv])
    assert progress_format(args, env) == expected


def test_readable_lines_say_how_many_steps_a_resumed_worker_skipped() -> None:
    start = {"event": "start", "worker": 1, "resumed_steps": 33, "planned_steps": 88}
    assert progress_line(start) == (
        "worker 1: resuming: 33 of 88 steps done before, training the rest"
    )
    done = {
        "event": "done",
        "worker": 1,
        "test_accuracy": 0.9,
        "steps": 88,
        "resumed_steps": 33,
        "trained_steps": 55,
        "elapsed_s": 2.0,
    }
    assert progress_line(done) == (
        "worker 1: done after 88 steps (33 done before this process) in 2.0 s, test accuracy 0.9000"
    )
