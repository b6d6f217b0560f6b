"""``compare.png``: the curves of ``distsgd compare``, drawn with matplotlib.

matplotlib is the optional ``compare`` extra (``pip install 'distsgd[compare]'``), imported
only here and only when a figure is drawn; :func:`missing_figure_reason` tells beforehand
whether it can be.

Six panels: accuracy (or test loss), training loss and bytes sent, each against seconds and
samples. An entry of several runs (``--repeats``) is drawn as its mean curve, the i-th
evaluation of each run averaged, with a shaded band from the min to the max over its runs;
its training-loss and bytes curves are drawn thin, one per run. One legend under the panels
names each entry's effective settings (``*`` = tuned; the rate as applied, and only what the
scheme uses) and the target line. An entry that failed or diverged is dotted, says so in the
legend, and sets no axis (:func:`axis_limits`): its blown-up loss would flatten the others.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distsgd_compare.report import Context, groups, ps_text, settings_text
from distsgd_compare.summary import SchemeRun

log = logging.getLogger(__name__)

Points = tuple[list[float], list[float]]
"""One curve's x and y values as drawn."""

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


MARGIN = 0.05
"""The share of a panel's kept range added above and below it (and left and right)."""


def axis_limits(
    kept: Sequence[Sequence[float]], dropped: Sequence[Sequence[float]]
) -> tuple[float, float] | None:
    """One axis of a panel where entries failed or diverged: the range of the values of the
    entries that ended well (``kept``), with a :data:`MARGIN` either side, where the others'
    values (``dropped``: non-finite ones too) reach outside it, so that a diverged loss does
    not flatten every other curve; None where the axis may scale itself (nothing reaches out,
    or no entry ended well)."""
    good = [v for values in kept for v in values if math.isfinite(v)]
    if not good:
        return None
    low, high = min(good), max(good)
    if all(math.isfinite(v) and low <= v <= high for values in dropped for v in values):
        return None
    span = high - low or max(abs(high), 1.0)
    return low - MARGIN * span, high + MARGIN * span


def failed(group: Sequence[SchemeRun]) -> bool:
    """Whether an entry is drawn as failed (dotted, and its curves set no axis): one of its
    runs did not end ``ok`` (diverged, failed, interrupted)."""
    return any(r.status != "ok" for r in group)


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
    drawn: dict[tuple[int, int], tuple[list[Points], list[Points]]] = {}
    for index, group in enumerate(groups(runs)):
        style: dict[str, Any] = {"color": f"C{index % 10}"}
        if group[0].baseline:
            style["linestyle"] = "--"
        if failed(group):
            style.update(linestyle=":", linewidth=1.2)
        label = legend_label(group, context.workers)
        for panel, points in _plot_group(axes, group, label, style, with_accuracy):
            kept, dropped = drawn.setdefault(panel, ([], []))
            (dropped if failed(group) else kept).append(points)
    for (row, column), (kept, dropped) in drawn.items():
        _keep_in_view(axes[row][column], kept, dropped)
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


def _keep_in_view(ax: Any, kept: list[Points], dropped: list[Points]) -> None:
    """Limit the panel's axes to the entries that ended well where the others reach out."""
    for index, set_limits in ((0, ax.set_xlim), (1, ax.set_ylim)):
        limits = axis_limits([p[index] for p in kept], [p[index] for p in dropped])
        if limits is not None:
            set_limits(*limits)


def _plot_group(
    axes: Any,
    group: Sequence[SchemeRun],
    label: str,
    style: dict[str, Any],
    with_accuracy: bool,
) -> list[tuple[tuple[int, int], Points]]:
    """One entry's curves (its repeats: their mean and band on top, each run below); each
    panel's points drawn, by (row, column)."""
    drawn: list[tuple[tuple[int, int], Points]] = []
    for column, by_samples in ((0, False), (1, True)):
        ax = axes[0][column]
        series = [_eval_points(r, with_accuracy, by_samples) for r in group]
        series = [s for s in series if s]
        if len(series) == 1:
            xs0, ys0 = zip(*series[0], strict=True)
            ax.plot(xs0, ys0, marker="o", markersize=3, label=label, **style)
            drawn.append(((0, column), (list(xs0), list(ys0))))
        elif series:
            xs_, mean, low, high = band(series)
            ax.plot(xs_, mean, marker="o", markersize=3, label=label, **style)
            ax.fill_between(xs_, low, high, color=style["color"], alpha=0.2, linewidth=0)
            drawn.append(((0, column), (xs_, low + high)))
    for n, run in enumerate(group):
        c = run.curves
        alpha = 1.0 if len(group) == 1 else 0.5
        one = label if n == 0 else None
        megabytes = [b / 1e6 for b in c.bytes_sent]
        curves: tuple[tuple[tuple[int, int], Sequence[float], Sequence[float]], ...] = (
            ((1, 0), c.loss_seconds, c.train_loss),
            ((1, 1), c.loss_samples, c.train_loss),
            ((2, 0), c.bytes_seconds, megabytes),
            ((2, 1), c.bytes_samples, megabytes),
        )
        for panel, xs, ys in curves:
            axes[panel[0]][panel[1]].plot(xs, ys, label=one, alpha=alpha, **style)
            drawn.append((panel, (list(xs), list(ys))))
    return drawn


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
