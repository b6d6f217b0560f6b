"""``compare.png``: the curves of ``distsgd compare``, drawn with matplotlib.

matplotlib is the optional ``compare`` extra (``pip install 'distsgd[compare]'``), imported
only here and only when a figure is drawn; :func:`missing_figure_reason` tells beforehand
whether it can be.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from distsgd.compare.report import Context, ps_text
from distsgd.compare.summary import SchemeRun

log = logging.getLogger(__name__)

INSTALL = "pip install 'distsgd[compare]'"
"""The command that installs what :func:`write_figure` needs."""


def missing_figure_reason() -> str | None:
    """None when :func:`write_figure` can draw; otherwise one line: why not, and the fix."""
    try:
        import matplotlib.backends.backend_agg
        import matplotlib.figure  # noqa: F401 - these two are what write_figure imports
    except ImportError as exc:
        return (
            f"compare.png needs matplotlib ({exc}); {INSTALL} to draw it "
            "(compare.md and compare.json are written without it)"
        )
    return None


def write_figure(path: Path, context: Context, runs: Sequence[SchemeRun]) -> None:
    """``compare.png``: accuracy (or test loss) and training loss, against seconds and samples."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # the `compare` extra
    from matplotlib.figure import Figure

    with_accuracy = any(r.curves.has_accuracy for r in runs)
    fig = Figure(figsize=(13, 9), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    top = "test accuracy" if with_accuracy else "test loss (the script reports no accuracy)"
    for run in runs:
        c = run.curves
        label = run.label if run.status == "ok" else f"{run.label} ({run.status})"
        if with_accuracy:
            pairs = [
                (x, a) for x, a in zip(c.eval_seconds, c.accuracy, strict=True) if a is not None
            ]
            samples = [
                (x, a) for x, a in zip(c.eval_samples, c.accuracy, strict=True) if a is not None
            ]
        else:
            pairs = list(zip(c.eval_seconds, c.test_loss, strict=True))
            samples = list(zip(c.eval_samples, c.test_loss, strict=True))
        for ax, points in ((axes[0][0], pairs), (axes[0][1], samples)):
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", markersize=3, label=label)
        axes[1][0].plot(c.loss_seconds, c.train_loss, label=label)
        axes[1][1].plot(c.loss_samples, c.train_loss, label=label)
    if with_accuracy and context.target is not None:
        for ax in axes[0]:
            ax.axhline(context.target, color="grey", linestyle="--", linewidth=0.8)
    titles = (
        (axes[0][0], f"{top} vs time", "seconds of training", top),
        (axes[0][1], f"{top} vs samples", "samples seen (all workers)", top),
        (axes[1][0], "training loss vs time", "seconds of training", "training loss"),
        (axes[1][1], "training loss vs samples", "samples seen (all workers)", "training loss"),
    )
    for ax, title, xlabel, ylabel in titles:
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend()
    fig.suptitle(
        f"{context.label}: {context.workers} workers, {ps_text(context, runs)} "
        f"({context.machine.get('cores')} cores)"
    )
    fig.savefig(path, dpi=100)
    log.debug("wrote %s", path)
