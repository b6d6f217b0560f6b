"""``compare.png``: the curves of ``distsgd compare``, drawn with matplotlib.

matplotlib is the optional ``compare`` extra (``pip install 'distsgd[compare]'``), imported
only here and only when a figure is drawn; :func:`missing_figure_reason` tells beforehand
whether it can be.

Six panels: accuracy (or test loss), training loss and bytes sent, each against seconds and
samples. An entry of several runs (``--repeats``) is drawn as its mean curve, the i-th
evaluation of each run averaged, with a shaded band from the min to the max over its runs;
its training-loss and bytes curves are drawn thin, one per run. One legend under the panels
names each entry's effective settings (``*`` = tuned) and the target line.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distsgd.compare.report import Context, groups, ps_text, settings_text
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


def legend_label(group: Sequence[SchemeRun], workers: int | None = None) -> str:
    """``label (status): settings [, n runs]`` for one entry's runs."""
    run = group[0]
    bad = sorted({r.status for r in group if r.status != "ok"})
    label = run.label if not bad else f"{run.label} ({', '.join(bad)})"
    settings = settings_text(run, workers)
    more = f", mean of {len(group)} runs" if len(group) > 1 else ""
    return f"{label}: {settings}{more}" if settings else f"{label}{more}"


def band(
    series: Sequence[Sequence[tuple[float, float]]],
) -> tuple[list[float], list[float], list[float], list[float]]:
    """(x, mean y, min y, max y) over several runs' points, the i-th point of each together
    (as many points as the shortest run has)."""
    n = min((len(s) for s in series), default=0)
    xs, mean, low, high = [], [], [], []
    for i in range(n):
        points = [s[i] for s in series]
        ys = [y for _, y in points]
        xs.append(sum(x for x, _ in points) / len(points))
        mean.append(sum(ys) / len(ys))
        low.append(min(ys))
        high.append(max(ys))
    return xs, mean, low, high


def _eval_points(run: SchemeRun, accuracy: bool, by_samples: bool) -> list[tuple[float, float]]:
    c = run.curves
    xs: Sequence[float] = c.eval_samples if by_samples else c.eval_seconds
    if accuracy:
        return [(x, a) for x, a in zip(xs, c.accuracy, strict=True) if a is not None]
    return list(zip(xs, c.test_loss, strict=True))


def write_figure(path: Path, context: Context, runs: Sequence[SchemeRun]) -> None:
    """``compare.png``: accuracy (or test loss), training loss and bytes sent, against seconds
    and samples; mean and min-max band for repeated entries."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # the `compare` extra
    from matplotlib.figure import Figure

    with_accuracy = any(r.curves.has_accuracy for r in runs)
    fig = Figure(figsize=(14, 13), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 2)
    top = "test accuracy" if with_accuracy else "test loss (the script reports no accuracy)"
    for index, group in enumerate(groups(runs)):
        style: dict[str, Any] = {"color": f"C{index % 10}"}
        if group[0].baseline:
            style["linestyle"] = "--"
        _plot_group(axes, group, legend_label(group, context.workers), style, with_accuracy)
    if with_accuracy and context.target is not None:
        for ax in axes[0]:
            ax.axhline(
                context.target,
                color="grey",
                linestyle=":",
                linewidth=1,
                label=f"target {context.target:.2f}",
            )
    _label_panels(axes, top)
    _legend_and_title(fig, axes, context, runs)
    fig.savefig(path, dpi=100)
    log.debug("wrote %s", path)


def _plot_group(
    axes: Any,
    group: Sequence[SchemeRun],
    label: str,
    style: dict[str, Any],
    with_accuracy: bool,
) -> None:
    """One entry's curves (its repeats: their mean and band on top, each run below)."""
    for column, by_samples in ((0, False), (1, True)):
        ax = axes[0][column]
        series = [_eval_points(r, with_accuracy, by_samples) for r in group]
        series = [s for s in series if s]
        if len(series) == 1:
            xs, ys = zip(*series[0], strict=True)
            ax.plot(xs, ys, marker="o", markersize=3, label=label, **style)
        elif series:
            xs_, mean, low, high = band(series)
            ax.plot(xs_, mean, marker="o", markersize=3, label=label, **style)
            ax.fill_between(xs_, low, high, color=style["color"], alpha=0.2, linewidth=0)
    for n, run in enumerate(group):
        c = run.curves
        alpha = 1.0 if len(group) == 1 else 0.5
        one = label if n == 0 else None
        axes[1][0].plot(c.loss_seconds, c.train_loss, label=one, alpha=alpha, **style)
        axes[1][1].plot(c.loss_samples, c.train_loss, label=one, alpha=alpha, **style)
        megabytes = [b / 1e6 for b in c.bytes_sent]
        axes[2][0].plot(c.bytes_seconds, megabytes, label=one, alpha=alpha, **style)
        axes[2][1].plot(c.bytes_samples, megabytes, label=one, alpha=alpha, **style)


def _label_panels(axes: Any, top: str) -> None:
    sent = "MB sent (all workers)"
    titles = (
        (axes[0][0], f"{top} vs time", "seconds of training", top),
        (axes[0][1], f"{top} vs samples", "samples seen (all workers)", top),
        (axes[1][0], "training loss vs time", "seconds of training", "training loss"),
        (axes[1][1], "training loss vs samples", "samples seen (all workers)", "training loss"),
        (axes[2][0], "bytes sent vs time", "seconds of training", sent),
        (axes[2][1], "bytes sent vs samples", "samples seen (all workers)", sent),
    )
    for ax, title, xlabel, ylabel in titles:
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)


def _legend_and_title(fig: Any, axes: Any, context: Context, runs: Sequence[SchemeRun]) -> None:
    handles: dict[str, Any] = {}  # one legend for all panels, below them (labels are long)
    for ax in (axes[0][0], axes[1][0], axes[0][1]):
        for handle, text in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(text, handle)
    if handles:
        fig.legend(
            list(handles.values()), list(handles), loc="outside lower center", fontsize="small"
        )
    fair = []
    if context.repeats > 1:
        fair.append(f"mean of {context.repeats} seeds, band = min-max")
    if context.tune:
        fair.append(f"* tuned on a {context.validation:g} validation split")
    fig.suptitle(
        f"{context.label}: {context.workers} workers, {ps_text(context, runs)} "
        f"({context.machine.get('cores')} cores)" + (f"; {'; '.join(fair)}" if fair else "")
    )
