"""The main job as users run it: ``paramserver demo`` (real server + worker subprocesses)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("consistency", "staleness"), [("bsp", 0), ("ssp", 2), ("asp", 0)])
def test_demo_trains_digits(consistency: str, staleness: int) -> None:
    """A short demo (3 epochs, 4 workers) trains on digits and exits 0 past its bar."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "paramserver",
            "demo",
            "--workers",
            "4",
            "--consistency",
            consistency,
            "--staleness",
            str(staleness),
            "--epochs",
            "3",
            "--min-accuracy",
            "0.9",
            "--timeout-s",
            "500",
        ],
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    epochs = re.findall(r"epoch\s+(\d+)/3\s+loss (\S+)\s+test accuracy (\S+)", proc.stdout)
    assert [int(e) for e, _, _ in epochs] == [1, 2, 3]
    losses = [float(loss) for _, loss, _ in epochs]
    assert losses[-1] < losses[0]
    final = float(re.search(r"final test accuracy (\S+)", proc.stdout).group(1))  # type: ignore[union-attr]
    assert final >= 0.9


@pytest.mark.timeout(300)
def test_worker_exits_nonzero_below_accuracy_bar(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`paramserver worker` against a real server: one epoch cannot pass a bar of 1.01."""
    from tests.harness import ServerProcess

    server = ServerProcess(tmp_path, "--consistency", "asp")
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "paramserver",
                "worker",
                "--server",
                server.address,
                "--worker-index",
                "0",
                "--num-workers",
                "1",
                "--epochs",
                "1",
                "--min-accuracy",
                "1.01",
            ],
            capture_output=True,
            text=True,
            timeout=280,
        )
    finally:
        assert server.stop() == 0, server.log()
    assert proc.returncode == 1, proc.stderr
    # readable progress by default (JSON lines with --log-format json or --progress json)
    assert re.search(
        r"^worker 0: epoch 1/1  loss \S+  test accuracy \S+  clock \d+", proc.stdout, re.M
    )
    assert re.search(
        r"^worker 0: done after \d+ steps in \S+ s, test accuracy \S+$", proc.stdout, re.M
    )
    assert "{" not in proc.stdout
