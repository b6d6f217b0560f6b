"""The files of a run folder that the runtime writes and the launcher and the tools read."""

from __future__ import annotations

import os
import time
from pathlib import Path

CONFIG_FILE = "config.json"
"""The run's settings, a :class:`~distsgd.control.spec.RunSpec` (written when the run starts)."""
METRICS_FILE = "metrics.jsonl"
"""One JSON object per line from every task (``control.metrics.MetricsWriter``)."""
RESULT_FILE = "result.json"
"""The chief's ``TrainResult`` (runtime/loop.py) and the training config."""
FINAL_PARAMS_FILE = "final_model.pt"
"""The final parameters, a ``state_dict`` of tensors (``torch.load(weights_only=True)``)."""
TENSORBOARD_DIR = "tensorboard"
"""TensorBoard event files, a folder (one TensorBoard run) per task (``control.board``)."""

RUNS_ENV = "DISTSGD_RUNS"
"""Environment variable: the folder new run folders go in (default ``./distsgd-runs``); ``off``
keeps a script run alone (``python script.py``) from writing one."""


def runs_root() -> Path | None:
    """Where new run folders go, from :data:`RUNS_ENV`; None when it says ``off``."""
    value = os.environ.get(RUNS_ENV, "distsgd-runs")
    return None if value.strip().lower() == "off" else Path(value)


def new_run_folder(label: str, root: Path | None = None) -> Path:
    """``<root>/<time>-<label>``, with ``-2``, ``-3`` ... when that exists (not created)."""
    base = (root or Path("distsgd-runs")) / f"{time.strftime('%Y%m%d-%H%M%S')}-{label}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path
