"""Accuracy-against-time figures (``paramserver demo --plot out.png``).

Needs matplotlib (``pip install 'paramserver[plot]'``), imported only when a figure is drawn and
always with the non-interactive Agg backend, so no display is needed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

PLOT_EXTRA_HINT = "pip install 'paramserver[plot]'"


def require_matplotlib() -> ModuleType:
    """Import matplotlib with the Agg backend and return ``matplotlib.pyplot``.

    Raises:
        SystemExit: matplotlib is not installed (the message names the extra to install).
    """
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"--plot needs matplotlib: {PLOT_EXTRA_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy_curves(
    curves: Mapping[str, Sequence[tuple[float, float]]],
    path: str | Path,
    *,
    title: str = "",
    bar: float | None = None,
) -> Path:
    """Write test accuracy against wall time as a PNG, one line (with markers) per curve.

    Args:
        curves: label (e.g. ``"bsp"``, ``"ssp (s=2)"``) -> (seconds since training started,
            test accuracy in [0, 1]) points, in time order.
        path: Output file; its parent directory is created. The format follows the suffix
            (``.png``; matplotlib's others work too).
        title: Figure title.
        bar: Accuracy bar drawn as a dashed horizontal line (None: none).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        SystemExit: matplotlib is not installed.
        ValueError: no curves, or a curve without points.
    """
    if not curves:
        raise ValueError("plot_accuracy_curves: no curves to plot")
    empty = [label for label, points in curves.items() if not points]
    if empty:
        raise ValueError(f"plot_accuracy_curves: no points for {', '.join(empty)}")
    plt = require_matplotlib()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 5))
    try:
        for i, (label, points) in enumerate(curves.items()):
            t = [p[0] for p in points]
            acc = [p[1] for p in points]
            ax.plot(t, acc, "-o", color=f"C{i}", markersize=4, linewidth=2, label=label)
        if bar is not None:
            ax.axhline(bar, color="grey", linewidth=0.8, linestyle="--", label=f"bar {bar:g}")
        ax.set_xlabel("wall time since every worker registered (s)")
        ax.set_ylabel("test accuracy (digits)")
        ax.set_ylim(0.0, 1.0)
        ax.set_xlim(left=0.0)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        if title:
            ax.set_title(title)
        fig.tight_layout()
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)
    return out
