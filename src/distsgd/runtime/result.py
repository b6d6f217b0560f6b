"""What one worker's run produced (:class:`TrainResult`), and its form in ``result.json``."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from typing import Any

from distsgd.control.folder import RESULT_FILE, RunFiles


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """What one worker's run produced (evaluation fields on the chief only)."""

    scheme: str
    worker: int
    local_steps: int
    global_step: int
    seconds: float
    samples: int
    bytes_sent: int
    bytes_received: int = 0
    """Tensor bytes this worker's pulls received from the parameter servers (0 without)."""
    test_loss: float | None = None
    test_accuracy: float | None = None
    diverged: bool = False
    """True when training diverged (see :mod:`distsgd.control.divergence`)."""
    divergence: str | None = None
    """Why it counts as diverged, or None."""
    stalled: bool = False
    """(Chief) True when the run ended at chance while its parameters barely moved: it did not
    diverge but did not learn (steps too small or too few); ``diverged`` is True too (a failed
    run)."""
    unclear: bool = False
    """(Chief) True when the run ended at chance with its parameters moved between 10% and
    100% of their size: it may have blown up or not got going (``diverged`` is True too)."""
    time_split: dict[str, float] = dataclasses.field(default_factory=dict)
    """This worker's seconds per phase (see :mod:`distsgd.control.timing`): compute, pull, ..."""
    work: dict[str, Any] | None = None
    """(Chief of a run with work units) per epoch, the units trained once, twice, never."""
    left: bool = False
    """True when the worker was asked to stop (SIGTERM, ``stop``) and left the run early."""
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    """(Chief) the final evaluation's values of the ``metrics=`` functions given to train."""


def result_fields(result: TrainResult) -> dict[str, Any]:
    """result.json's fields: ``work`` and ``left`` only where they say something."""
    fields = asdict(result)
    for key in ("work", "left", "metrics", "stalled", "unclear"):
        if not fields[key]:  # None, False or {} (``work``, when given, is never empty)
            del fields[key]
    return fields


def recorded_result(files: RunFiles) -> TrainResult | None:
    """The run's result as the chief recorded it in the run folder (``result.json``); None when
    there is none, or its fields do not make a :class:`TrainResult` (the launcher's record of a
    run stopped on divergence, a damaged file)."""
    try:
        text = files.get(RESULT_FILE)
        data = None if text is None else json.loads(text)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    names = {f.name for f in dataclasses.fields(TrainResult)}
    try:
        result = TrainResult(**{k: v for k, v in data.items() if k in names})
    except TypeError:  # a field missing: not the chief's record
        return None
    counts = (result.worker, result.local_steps, result.global_step, result.samples)
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in counts):
        return None
    return result


def work_counts(status: Any) -> dict[str, Any]:
    """result.json's ``work``: the queue's per-epoch counts (a ``WorkStatus``) and their
    totals."""
    counts = ("epochs", "units_per_epoch", "unit_size", "samples", "total_units", "units_done")
    kinds = ("trained_once", "trained_twice", "never_trained")
    return {
        **{name: int(getattr(status, name)) for name in counts},
        "finished": bool(status.finished),
        **{kind: sum(getattr(status, kind)) for kind in kinds},
        "per_epoch": {kind: list(getattr(status, kind)) for kind in kinds},
    }
