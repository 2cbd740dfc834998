"""The demo's ``--consistency`` list and the accuracy-against-time figure (no cluster)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from paramserver.cli.training import consistency_list

pytestmark = pytest.mark.timeout(60)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_consistency_list_parses_one_or_several() -> None:
    assert consistency_list("ssp") == ["ssp"]
    assert consistency_list("BSP, ssp,asp") == ["bsp", "ssp", "asp"]
    with pytest.raises(argparse.ArgumentTypeError, match="'tsp'"):
        consistency_list("bsp,tsp")
    with pytest.raises(argparse.ArgumentTypeError, match="repeated"):
        consistency_list("bsp,bsp")


def color_pixels(image: np.ndarray, color: str, tol: float = 0.03) -> int:
    """Pixels of ``image`` (H, W, 3|4 floats in [0, 1]) within ``tol`` of ``color`` (any
    matplotlib color spec, e.g. ``"C0"``)."""
    from matplotlib.colors import to_rgb

    rgb = np.array(to_rgb(color))
    return int((np.abs(image[..., :3] - rgb).max(axis=-1) < tol).sum())


def test_plot_writes_a_png_with_one_line_per_curve(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from paramserver.cli.demos.plot import plot_accuracy_curves

    curves = {
        "bsp": [(0.0, 0.1), (1.0, 0.8), (2.0, 0.95)],
        "ssp (s=2)": [(0.0, 0.1), (0.7, 0.85), (1.4, 0.96)],
    }
    out = plot_accuracy_curves(curves, tmp_path / "sub" / "acc.png", title="t", bar=0.9)
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    image = plt.imread(out)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    drawn = [color_pixels(image, f"C{i}") for i in range(3)]
    assert drawn[0] > 300 and drawn[1] > 300, drawn  # two long lines
    assert drawn[2] == 0, drawn  # and no third


def test_plot_refuses_empty_input(tmp_path: Path) -> None:
    from paramserver.cli.demos.plot import plot_accuracy_curves

    with pytest.raises(ValueError, match="no curves"):
        plot_accuracy_curves({}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="no points for bsp"):
        plot_accuracy_curves({"bsp": []}, tmp_path / "x.png")
