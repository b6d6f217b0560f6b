"""A run folder's ``metrics.jsonl`` written by hand, for the tests of the live run view, the
metrics endpoint and Prometheus (no training)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def step_line(task: str, t: float, local: int, **extra: Any) -> dict[str, Any]:
    """A worker's step line as runtime/step_log.py writes it: ``local`` steps of 16 samples,
    each 0.1 s: 0.06 compute, 0.02 pull, 0.02 push."""
    return {
        "time": round(t, 3),
        "task": task,
        "step": 2 * local,
        "local_step": local,
        "progress": 0.5,
        "loss": round(1.0 / (1 + local), 6),
        "samples": 16 * local,
        "bytes_sent": 1000 * local,
        "bytes_received": 2000 * local,
        "lost_pushes": 0,
        "nonfinite_skipped": 0,
        "mean_staleness": 0.5,
        "compute_s": round(0.06 * local, 4),
        "pull_s": round(0.02 * local, 4),
        "push_s": round(0.02 * local, 4),
        "wait_s": 0.0,
        **extra,
    }


def lines(now: float | None = None, steps: int = 20) -> list[dict[str, Any]]:
    """Two workers, ``steps`` steps each over the last seconds before ``now`` (worker1 at half
    worker0's pace), a server's load reading, a restart of worker1 and an evaluation line."""
    now = time.time() if now is None else now
    out: list[dict[str, Any]] = [
        {"time": now - 30, "task": "worker0", "step": 0, "local_step": 0, "event": "membership"}
    ]
    for i in range(1, steps + 1):
        out.append(step_line("worker0", now - 0.1 * (steps - i), i))
        if i % 2 == 0:
            out.append(step_line("worker1", now - 0.1 * (steps - i) - 0.05, i // 2))
    out.append(
        {"time": now - 1, "task": "launcher", "step": 10, "event": "fault", "target": "worker1"}
    )
    out.append(
        {
            "time": now - 0.5,
            "task": "launcher",
            "step": 2 * steps,
            "event": "shard_load",
            "ps": 0,
            "seconds": 5.0,
            "pushes_per_s": 12.5,
            "pulls_per_s": 12.0,
            "push_mb_per_s": 0.25,
            "pull_mb_per_s": 0.5,
            "busy": 0.125,
        }
    )
    out.append({"time": now, "task": "worker0", "step": 2 * steps, "accuracy": 0.9, "final": False})
    return out


def write(run_dir: Path, records: list[dict[str, Any]], *, mode: str = "w") -> Path:
    """``records`` as ``run_dir/metrics.jsonl`` (``mode`` "a": appended); the file's path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.jsonl"
    with path.open(mode, encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path
