"""``paramserver demo --plot``: one cluster per consistency model, one curve each in a PNG."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def color_pixels(image: np.ndarray, color: str, tol: float = 0.03) -> int:
    """Pixels of ``image`` (H, W, 3|4 floats in [0, 1]) within ``tol`` of ``color``."""
    from matplotlib.colors import to_rgb

    return int((np.abs(image[..., :3] - np.array(to_rgb(color))).max(axis=-1) < tol).sum())


def test_demo_plot_writes_one_curve_per_consistency_model(tmp_path: Path) -> None:
    """bsp, ssp and asp (2 workers, 2 epochs each) each reach the bar; the PNG has the PNG
    signature, reads back with matplotlib and shows a line in each of the first three colors
    of the cycle and none in the fourth."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    out = tmp_path / "acc.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "paramserver",
            "demo",
            "--workers",
            "2",
            "--consistency",
            "bsp,ssp,asp",
            "--epochs",
            "2",
            "--min-accuracy",
            "0.9",
            "--timeout-s",
            "60",
            "--plot",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("final test accuracy") == 3
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    image = plt.imread(out)
    assert image.ndim == 3 and min(image.shape[:2]) > 100
    drawn = [color_pixels(image, f"C{i}") for i in range(4)]
    assert min(drawn[:3]) > 150 and drawn[3] == 0, drawn


def test_demo_plot_refused_for_unknown_model(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "paramserver", "demo", "--consistency", "bsp,xsp"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown consistency model(s) 'xsp'" in proc.stderr
