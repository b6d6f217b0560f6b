"""What ``distsgd compare`` reads from each run folder and writes for the whole comparison.

Everything here is a pure function of a run folder's ``metrics.jsonl`` and ``result.json``:

* **Seconds** count from the start of training, estimated per worker as the time of its first
  metrics line minus the local steps before that line at the rate of its first two lines
  (process start-up, parameter registration and rendezvous do not count); the earliest worker
  sets the origin of the run.
* **Samples seen** at time *t* are the sum over workers of each worker's ``samples`` at *t*,
  interpolated linearly between its metrics lines (which come every ``log_every`` steps, often
  less often than the evaluations; 0 at the worker's start, held after its last line).
* **Test accuracy / test loss** come from the chief's evaluation lines (every ``eval_every``
  local steps, and the final one).
* **Training loss** at each worker metrics line is the mean over workers of each worker's
  latest mini-batch loss, then a trailing moving average over a few lines.

:func:`write_figure`, :func:`write_markdown` and :func:`write_json` turn the summaries into
``compare.png``, ``compare.md`` and ``compare.json``.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from distsgd.runtime.run_folder import METRICS_FILE, RESULT_FILE
from distsgd.util import write_atomic

log = logging.getLogger(__name__)

CHIEF = "worker0"
LOSS_POINTS = 200
"""At most this many training-loss points per scheme are kept (evenly thinned)."""


@dataclass(frozen=True, kw_only=True)
class Curves:
    """One run's curves; seconds from the start of training, samples of all workers together."""

    eval_seconds: list[float] = field(default_factory=list)
    eval_samples: list[int] = field(default_factory=list)
    accuracy: list[float | None] = field(default_factory=list)
    test_loss: list[float] = field(default_factory=list)
    loss_seconds: list[float] = field(default_factory=list)
    loss_samples: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)

    @property
    def has_accuracy(self) -> bool:
        return any(a is not None for a in self.accuracy)


@dataclass(frozen=True, kw_only=True)
class SchemeRun:
    """One entry's run as the reports show it. ``status`` is ok, diverged (finished, but see
    ``reason``), failed, interrupted or not run; numbers are None when the run did not produce
    them."""

    scheme: str
    """The scheme's name."""
    status: str
    label: str = ""
    """The entry of ``--schemes`` as written, e.g. ``downpour(server_lr=1)`` ('' = scheme)."""
    scheme_options: dict[str, Any] = field(default_factory=dict)
    """The scheme options of the run (global flags and the entry's own)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """The TrainConfig overrides of the run (global flags and the entry's own)."""
    reason: str = ""
    run_dir: str = ""
    parameter_servers: int = 0
    eval_every: int = 0
    final_accuracy: float | None = None
    final_test_loss: float | None = None
    seconds_to_target: float | None = None
    train_seconds: float | None = None
    wall_seconds: float | None = None
    bytes_sent: int | None = None
    mean_staleness: float | None = None
    global_step: int | None = None
    local_steps: int | None = None
    samples: int | None = None
    seed: int | None = None
    curves: Curves = field(default_factory=Curves)

    def __post_init__(self) -> None:
        if not self.label:
            object.__setattr__(self, "label", self.scheme)


@dataclass(frozen=True, kw_only=True)
class Context:
    """What the whole comparison was: shown above the table and in the figure's title."""

    command: str
    label: str
    workers: int
    ps: int | None
    seed: int | None
    """The seed of every run (None: unknown, or entries set their own)."""
    target: float | None
    target_source: str
    eval_every: int
    threads_per_worker: int
    machine: dict[str, Any]


# ------------------------------------------------------------------------------- reading


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """The lines of ``metrics.jsonl`` in time order (unreadable lines, e.g. a torn last line
    of a killed run, are skipped)."""
    path = run_dir / METRICS_FILE
    records: list[dict[str, Any]] = []
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return records
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("time"), (int, float)):
            records.append(record)
    records.sort(key=lambda r: float(r["time"]))
    return records


def read_result(run_dir: Path) -> dict[str, Any]:
    """The chief's ``result.json``, or {} when the run did not finish."""
    try:
        data = json.loads((run_dir / RESULT_FILE).read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _is_worker_line(record: dict[str, Any]) -> bool:
    return str(record.get("task", "")).startswith("worker") and "loss" in record


def _is_eval_line(record: dict[str, Any]) -> bool:
    return record.get("task") == CHIEF and "test_loss" in record


def worker_starts(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Unix time each worker began training: its first line minus the steps before it at the
    rate of its first two lines."""
    first: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        if _is_worker_line(record) and "local_step" in record:
            seen = first.setdefault(str(record["task"]), [])
            if len(seen) < 2:
                seen.append(record)
    starts = {}
    for task, lines in first.items():
        t1, s1 = float(lines[0]["time"]), int(lines[0]["local_step"])
        start = t1
        if len(lines) == 2:
            t2, s2 = float(lines[1]["time"]), int(lines[1]["local_step"])
            if s2 > s1 and t2 >= t1:
                start = t1 - s1 * (t2 - t1) / (s2 - s1)
        starts[task] = start
    return starts


def training_origin(records: Sequence[dict[str, Any]]) -> float | None:
    """Unix time training began: the earliest of :func:`worker_starts`; None without worker
    lines."""
    return min(worker_starts(records).values(), default=None)


class SampleClock:
    """Samples seen by all workers at any time: each worker's ``samples`` interpolated linearly
    between its metrics lines (from 0 at its start; they come every ``log_every`` steps, often
    less often than the evaluations), held after its last line, summed over workers."""

    def __init__(self, records: Sequence[dict[str, Any]]) -> None:
        self._series: dict[str, tuple[list[float], list[int]]] = {
            task: ([start], [0]) for task, start in worker_starts(records).items()
        }
        for record in records:
            if _is_worker_line(record) and "samples" in record:
                times, counts = self._series[str(record["task"])]
                times.append(max(times[-1], float(record["time"])))
                counts.append(int(record["samples"]))

    def at(self, t: float) -> int:
        total = 0.0
        for times, counts in self._series.values():
            i = bisect.bisect_right(times, t)
            if i == 0:
                continue
            if i == len(times) or times[i] == times[i - 1]:
                total += counts[i - 1]
            else:
                share = (t - times[i - 1]) / (times[i] - times[i - 1])
                total += counts[i - 1] + share * (counts[i] - counts[i - 1])
        return round(total)


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    out: list[float] = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _thin(indices: int, limit: int) -> list[int]:
    if indices <= limit:
        return list(range(indices))
    step = indices / limit
    return sorted({min(indices - 1, round(i * step)) for i in range(limit)} | {indices - 1})


def build_curves(records: Sequence[dict[str, Any]]) -> Curves:
    """The curves of one run from its metrics lines (see the module docstring)."""
    origin = training_origin(records)
    if origin is None:
        return Curves()
    clock = SampleClock(records)
    losses: dict[str, float] = {}
    curves = Curves()
    raw_loss: list[float] = []
    for record in records:
        t = float(record["time"])
        seconds = max(0.0, t - origin)
        if _is_worker_line(record):
            loss = float(record["loss"])
            if math.isfinite(loss):
                losses[str(record["task"])] = loss
            if losses:
                curves.loss_seconds.append(seconds)
                curves.loss_samples.append(clock.at(t))
                raw_loss.append(sum(losses.values()) / len(losses))
        elif _is_eval_line(record):
            curves.eval_seconds.append(seconds)
            curves.eval_samples.append(clock.at(t))
            accuracy = record.get("accuracy")
            curves.accuracy.append(None if accuracy is None else float(accuracy))
            curves.test_loss.append(float(record["test_loss"]))
    smooth = _moving_average(raw_loss, max(1, len(raw_loss) // 40))
    keep = _thin(len(smooth), LOSS_POINTS)
    return Curves(
        eval_seconds=curves.eval_seconds,
        eval_samples=curves.eval_samples,
        accuracy=curves.accuracy,
        test_loss=curves.test_loss,
        loss_seconds=[curves.loss_seconds[i] for i in keep],
        loss_samples=[curves.loss_samples[i] for i in keep],
        train_loss=[smooth[i] for i in keep],
    )


def _latest_by_worker(records: Iterable[dict[str, Any]], key: str) -> dict[str, Any]:
    latest: dict[str, Any] = {}
    for record in records:
        if _is_worker_line(record) and key in record:
            latest[str(record["task"])] = record
    return latest


def total_bytes_sent(records: Sequence[dict[str, Any]]) -> int | None:
    """Sum over workers of each worker's latest cumulative ``bytes_sent``."""
    latest = _latest_by_worker(records, "bytes_sent")
    return sum(int(r["bytes_sent"]) for r in latest.values()) if latest else None


def mean_staleness(records: Sequence[dict[str, Any]]) -> float | None:
    """Each worker's cumulative mean staleness, weighted by its local steps; None where no
    worker reports one (schemes without parameter servers)."""
    latest = _latest_by_worker(records, "mean_staleness")
    if not latest:
        return None
    weights = {task: max(1, int(r.get("local_step", 1))) for task, r in latest.items()}
    total = sum(float(r["mean_staleness"]) * weights[task] for task, r in latest.items())
    return total / sum(weights.values())


def seconds_to(curves: Curves, target: float | None) -> float | None:
    """Seconds until the first evaluation at or above ``target`` accuracy (None: never)."""
    if target is None:
        return None
    for seconds, accuracy in zip(curves.eval_seconds, curves.accuracy, strict=True):
        if accuracy is not None and accuracy >= target:
            return seconds
    return None


def summarize(
    scheme: str,
    run_dir: Path,
    *,
    label: str = "",
    scheme_options: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
    status: str,
    reason: str = "",
    parameter_servers: int,
    eval_every: int,
    wall_seconds: float | None,
) -> SchemeRun:
    """A :class:`SchemeRun` from a run folder (partial numbers for a failed run)."""
    records = read_records(run_dir)
    result = read_result(run_dir)
    curves = build_curves(records)
    origin = training_origin(records)
    finals = [r for r in records if _is_eval_line(r) and r.get("final")]
    final = finals[-1] if finals else {}
    accuracy = result.get("test_accuracy", final.get("accuracy"))
    test_loss = result.get("test_loss", final.get("test_loss"))
    train_seconds = None
    ends = [float(r["time"]) for r in records if _is_worker_line(r) or _is_eval_line(r)]
    if origin is not None and ends:
        train_seconds = max(ends) - origin
    config = result.get("config", {})
    return SchemeRun(
        scheme=scheme,
        label=label,
        scheme_options=dict(scheme_options or {}),
        overrides=dict(overrides or {}),
        status=status,
        reason=reason,
        run_dir=str(run_dir),
        parameter_servers=parameter_servers,
        eval_every=eval_every,
        final_accuracy=None if accuracy is None else float(accuracy),
        final_test_loss=None if test_loss is None else float(test_loss),
        train_seconds=train_seconds,
        wall_seconds=wall_seconds,
        bytes_sent=total_bytes_sent(records),
        mean_staleness=mean_staleness(records),
        global_step=result.get("global_step"),
        local_steps=result.get("local_steps"),
        samples=curves.loss_samples[-1] if curves.loss_samples else None,
        seed=config.get("seed") if isinstance(config, dict) else None,
        curves=curves,
    )


def with_target(run: SchemeRun, target: float | None) -> SchemeRun:
    """``run`` with its seconds to ``target`` accuracy filled in."""
    return replace(run, seconds_to_target=seconds_to(run.curves, target))


def default_target(runs: Sequence[SchemeRun]) -> float | None:
    """95% of the best final accuracy, rounded down to 0.01 (None without any accuracy)."""
    finals = [r.final_accuracy for r in runs if r.final_accuracy is not None]
    if not finals:
        return None
    return math.floor(0.95 * max(finals) * 100) / 100


# ------------------------------------------------------------------------------- writing


def _megabytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    mb = n / 1e6
    return f"{mb:.2f} MB" if mb < 10 else f"{mb:.1f} MB"


def _number(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _staleness(run: SchemeRun) -> str:
    if run.mean_staleness is not None:
        return f"{run.mean_staleness:.2f}"
    if run.parameter_servers == 0 and run.status == "ok":
        return "n/a (no parameter servers)"
    return "n/a"


def _steps(run: SchemeRun) -> str:
    if run.global_step is None or run.local_steps is None:
        return "n/a"
    return f"{run.global_step} / {run.local_steps}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _row(run: SchemeRun, target: float | None) -> str:
    if run.status not in ("ok", "diverged"):
        why = f"{run.status}: {run.reason}" if run.reason else run.status
        cells = [f"`{run.label}`", f"**{why}**", *["" for _ in range(7)]]
        return "| " + " | ".join(_cell(c) for c in cells) + " |"
    if target is None:
        reach = "n/a (no accuracy)"
    elif run.seconds_to_target is None:
        reach = "not reached"
    else:
        reach = f"{run.seconds_to_target:.1f}"
    cells = [
        f"`{run.label}`",
        "ok" if run.status == "ok" else f"**diverged**: {run.reason}",
        _number(run.final_accuracy),
        _number(run.final_test_loss),
        reach,
        _number(run.train_seconds, 1),
        _megabytes(run.bytes_sent),
        _staleness(run),
        _steps(run),
    ]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def _ps_text(context: Context, runs: Sequence[SchemeRun]) -> str:
    counts = sorted({r.parameter_servers for r in runs if r.parameter_servers})
    if not counts:
        return "no parameter servers"
    return f"{', '.join(map(str, counts))} ps (parameter-server schemes only)"


def _seed_text(context: Context, runs: Sequence[SchemeRun]) -> str:
    if context.seed is not None:
        return f"seed {context.seed}"
    seeds = sorted({r.seed for r in runs if r.seed is not None})
    if len(seeds) > 1:
        return f"seeds {', '.join(map(str, seeds))} (entries set their own)"
    return f"seed {seeds[0]}" if seeds else "seed n/a"


def markdown(context: Context, runs: Sequence[SchemeRun]) -> str:
    """``compare.md``: one row per entry of ``--schemes``, then how the numbers were made."""
    target = context.target
    target_head = "s to target" if target is None else f"s to {target:.2f}"
    head = [
        "scheme",
        "status",
        "final accuracy",
        "final test loss",
        target_head,
        "training s",
        "sent (all workers)",
        "mean staleness",
        "steps (global / per worker)",
    ]
    machine = context.machine
    lines = [
        f"# distsgd compare: {', '.join(r.label for r in runs)}",
        "",
        f"{context.label}; {context.workers} workers, {_ps_text(context, runs)}; "
        f"{_seed_text(context, runs)}.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + " --- |" * len(head),
        *[_row(r, target) for r in runs],
        "",
        f"- command: `{context.command}`",
        f"- machine: {machine.get('cores')} cores ({machine.get('platform')}), "
        f"{context.threads_per_worker} torch threads per worker, Python "
        f"{machine.get('python')}, torch {machine.get('torch')}",
        "- target accuracy: "
        + ("n/a (the script reports no accuracy)" if target is None else f"{target:.2f} ")
        + (f"({context.target_source})" if target is not None else ""),
        f"- the chief evaluated every {context.eval_every} local steps"
        if context.eval_every
        else "- the chief evaluated only at the end",
        "- seconds count from the start of training (start-up excluded); "
        "training s ends at the final evaluation; sent = bytes all workers sent; "
        "mean staleness = updates applied between a worker's pull and its push, "
        "averaged over pushes (parameter-server schemes only); steps = global updates / "
        "local steps of worker0",
        "",
        "![curves](compare.png)",
        "",
    ]
    return "\n".join(lines)


def write_markdown(path: Path, context: Context, runs: Sequence[SchemeRun]) -> None:
    write_atomic(path, markdown(context, runs))


def write_json(path: Path, context: Context, runs: Sequence[SchemeRun]) -> None:
    """``compare.json``: the context and, per entry, its label, scheme, scheme options and
    training overrides, the table's numbers and its curves."""
    data = {"version": 1, **asdict(context), "schemes": [asdict(r) for r in runs]}
    write_atomic(path, json.dumps(data, indent=1) + "\n")


def write_figure(path: Path, context: Context, runs: Sequence[SchemeRun]) -> None:
    """``compare.png``: accuracy (or test loss) and training loss, against seconds and samples."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
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
        f"{context.label}: {context.workers} workers, {_ps_text(context, runs)} "
        f"({context.machine.get('cores')} cores)"
    )
    fig.savefig(path, dpi=100)
    log.debug("wrote %s", path)
