"""What ``distsgd compare`` reads from each run folder: a :class:`SchemeRun` per entry.

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

:mod:`distsgd_compare.report` and :mod:`distsgd_compare.figure` turn the summaries into
``compare.md``, ``compare.json`` and ``compare.png``.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from distsgd.cluster import Role, TaskId
from distsgd.control.folder import METRICS_FILE, RESULT_FILE
from distsgd.plan.simulate import histogram_quantile
from distsgd_compare.tune import Trial

log = logging.getLogger(__name__)

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
    bytes_seconds: list[float] = field(default_factory=list)
    bytes_samples: list[int] = field(default_factory=list)
    bytes_sent: list[int] = field(default_factory=list)
    """Bytes all workers sent so far (each worker's latest cumulative ``bytes_sent``, summed)
    at each worker metrics line that carries one."""

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
    staleness_p99: int | None = None
    """The 99th percentile of every push's staleness (``result.json``'s per-worker histograms)."""
    global_step: int | None = None
    local_steps: int | None = None
    samples: int | None = None
    seed: int | None = None
    train_config: dict[str, Any] = field(default_factory=dict)
    """The run's effective TrainConfig (the script's, then the flags), from ``result.json``."""
    lr_scaling: dict[str, Any] = field(default_factory=dict)
    """How its ``lr`` became the rate applied (``result.json``'s ``lr_scaling``: ``lr``,
    ``rule``, ``factor``, ``effective_lr`` ...); empty where it wrote none."""
    workers: int = 0
    """Worker tasks of the run (0 = unknown: the comparison's ``--workers``)."""
    baseline: bool = False
    """The one-worker baseline of ``--baseline``."""
    tuned: dict[str, Any] = field(default_factory=dict)
    """The setting ``--tune`` chose for its entry (and this run used)."""
    trials: list[Trial] = field(default_factory=list)
    """The entry's tuning runs and their validation scores."""
    repeat: int = 0
    """Which of the entry's ``--repeats`` runs this is (0 first)."""
    stalled: bool = False
    """A diverged run that ended at chance while its parameters barely moved: it did not
    learn."""
    rollbacks: int = 0
    """Times the run went back to its last good state at a lower rate after a divergence
    (``result.json``'s ``rollbacks``; docs/fault-tolerance.md)."""
    stragglers: list[str] = field(default_factory=list)
    """The stragglers the launcher named (its ``straggler`` events), each ``task (cause)`` once,
    in the order first named; empty: none named (or a run without the detector)."""
    curves: Curves = field(default_factory=Curves)

    def __post_init__(self) -> None:
        if not self.label:
            object.__setattr__(self, "label", self.scheme)


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


def _task_of(record: dict[str, Any]) -> TaskId | None:
    """The task that wrote a metrics line, or None (the launcher's, or no task named)."""
    try:
        return TaskId.parse(str(record.get("task", "")))
    except ValueError:
        return None


def _is_worker_line(record: dict[str, Any]) -> bool:
    task = _task_of(record)
    return task is not None and task.job == Role.WORKER and "loss" in record


def _is_eval_line(record: dict[str, Any]) -> bool:
    task = _task_of(record)
    return task is not None and task.is_chief and "test_loss" in record


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
    sent: dict[str, int] = {}
    curves = Curves()
    raw_loss: list[float] = []
    for record in records:
        t = float(record["time"])
        seconds = max(0.0, t - origin)
        if _is_worker_line(record):
            loss = float(record["loss"])
            if math.isfinite(loss):
                losses[str(record["task"])] = loss
            if "bytes_sent" in record:
                sent[str(record["task"])] = int(record["bytes_sent"])
                curves.bytes_seconds.append(seconds)
                curves.bytes_samples.append(clock.at(t))
                curves.bytes_sent.append(sum(sent.values()))
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
    thin_bytes = _thin(len(curves.bytes_sent), LOSS_POINTS)
    return replace(
        curves,
        loss_seconds=[curves.loss_seconds[i] for i in keep],
        loss_samples=[curves.loss_samples[i] for i in keep],
        train_loss=[smooth[i] for i in keep],
        bytes_seconds=[curves.bytes_seconds[i] for i in thin_bytes],
        bytes_samples=[curves.bytes_samples[i] for i in thin_bytes],
        bytes_sent=[curves.bytes_sent[i] for i in thin_bytes],
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


def staleness_quantile(result: dict[str, Any], q: float) -> int | None:
    """The ``q`` quantile of every worker's pushes' staleness, from ``result.json``'s
    ``staleness`` (worker -> {staleness: pushes}); None where there is none."""
    merged: dict[int, int] = {}
    workers = result.get("staleness")
    if not isinstance(workers, dict):
        return None
    for histogram in workers.values():
        if not isinstance(histogram, dict):
            continue
        for key, count in histogram.items():
            try:
                merged[int(key)] = merged.get(int(key), 0) + int(count)
            except (TypeError, ValueError):
                continue
    return histogram_quantile(merged, q)


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
        stalled=bool(result.get("stalled")),
        rollbacks=len(rolled) if isinstance(rolled := result.get("rollbacks"), list) else 0,
        run_dir=str(run_dir),
        parameter_servers=parameter_servers,
        eval_every=eval_every,
        final_accuracy=None if accuracy is None else float(accuracy),
        final_test_loss=None if test_loss is None else float(test_loss),
        train_seconds=train_seconds,
        wall_seconds=wall_seconds,
        bytes_sent=total_bytes_sent(records),
        mean_staleness=mean_staleness(records),
        staleness_p99=staleness_quantile(result, 0.99),
        global_step=result.get("global_step"),
        local_steps=result.get("local_steps"),
        samples=curves.loss_samples[-1] if curves.loss_samples else None,
        seed=config.get("seed") if isinstance(config, dict) else None,
        train_config=dict(config) if isinstance(config, dict) else {},
        lr_scaling=dict(scaling) if isinstance(scaling := result.get("lr_scaling"), dict) else {},
        stragglers=stragglers_named(records),
        curves=curves,
    )


def stragglers_named(records: Iterable[dict[str, Any]]) -> list[str]:
    """``["worker2 (compute)", ...]``: each task and cause a ``straggler`` event named, once."""
    named: dict[str, None] = {}
    for r in records:
        if r.get("event") == "straggler" and r.get("state") in ("named", "chronic"):
            named.setdefault(f"{r.get('target')} ({r.get('cause')})")
    return list(named)


def with_target(run: SchemeRun, target: float | None) -> SchemeRun:
    """``run`` with its seconds to ``target`` accuracy filled in."""
    return replace(run, seconds_to_target=seconds_to(run.curves, target))


def default_target(runs: Sequence[SchemeRun]) -> float | None:
    """95% of the best final accuracy, rounded down to 0.01 (None without any accuracy)."""
    finals = [r.final_accuracy for r in runs if r.final_accuracy is not None]
    if not finals:
        return None
    return math.floor(0.95 * max(finals) * 100) / 100
