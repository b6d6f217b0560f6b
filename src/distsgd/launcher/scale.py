"""``distsgd elastic scale RUN_DIR --workers N``: ask the launcher of a running elastic run to
change its number of workers.

The request is a small JSON file in the run folder (``scale.json``: the number of workers and a
sequence number), written atomically; the launcher polls it four times a second, acts on a new
sequence number, and answers with a ``scale`` (or ``scale_refused``) event of that number in
``metrics.jsonl``. :func:`request_scale` writes the request and waits for that answer, so the
command says when the change was made, or why not.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from distsgd.control.folder import METRICS_FILE
from distsgd.control.spec import RunSpec
from distsgd.launcher.lifeline import alive
from distsgd.util import write_atomic

SCALE_FILE = "scale.json"
"""The request's file in the run folder."""
LAUNCHER_FILE = "launcher.pid"
"""The running launcher's PID, in the run folder (removed when it ends)."""


@dataclass(frozen=True, kw_only=True)
class ScaleRequest:
    """One request: the number of workers wanted, and its sequence number (1, 2, ...)."""

    workers: int
    seq: int

    def __post_init__(self) -> None:
        if type(self.workers) is not int or self.workers < 1:
            raise ValueError(f"workers must be a whole number, at least 1, got {self.workers!r}")
        if type(self.seq) is not int or self.seq < 1:
            raise ValueError(f"seq must be a whole number, at least 1, got {self.seq!r}")


def read_scale_request(run_dir: Path) -> ScaleRequest | None:
    """The current request in ``run_dir``, or None (none yet, or a file that is not one)."""
    try:
        data = json.loads((run_dir / SCALE_FILE).read_text())
        return ScaleRequest(workers=data["workers"], seq=data["seq"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _answer(run_dir: Path, seq: int) -> dict[str, object] | None:
    """The launcher's ``scale`` or ``scale_refused`` event for request ``seq``, if written."""
    try:
        lines = (run_dir / METRICS_FILE).read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") in ("scale", "scale_refused") and record.get("seq") == seq:
            return dict(record)
    return None


def launcher_alive(run_dir: Path) -> bool:
    """Whether the launcher that wrote ``launcher.pid`` in ``run_dir`` still runs."""
    try:
        pid = int((run_dir / LAUNCHER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return alive(pid, others=True)


def request_scale(run_dir: Path, workers: int, *, timeout: float = 60.0) -> dict[str, object]:
    """Ask the launcher running ``run_dir`` for ``workers`` workers and wait for its answer
    (the event it logged). ValueError (one line, cause and fix) when the folder is not a
    running elastic run, the number is out of its bounds, or no answer comes in ``timeout``."""
    spec = RunSpec.load(run_dir)
    low, high = spec.lowest_workers, spec.highest_workers
    if not spec.elastic:
        raise ValueError(
            f"{run_dir} was started with a fixed size of {high} workers; start a run with "
            "--min-workers and --max-workers (and --world-size dynamic) to scale it"
        )
    if not low <= workers <= high:
        raise ValueError(
            f"--workers {workers}: this run was started with --min-workers {low} "
            f"--max-workers {high}; ask for a number in {low}..{high}"
        )
    if not launcher_alive(run_dir):
        raise ValueError(
            f"no launcher is running {run_dir} (it finished, or was stopped); nothing to scale"
        )
    previous = read_scale_request(run_dir)
    seq = 1 if previous is None else previous.seq + 1
    write_atomic(run_dir / SCALE_FILE, json.dumps({"workers": workers, "seq": seq}) + "\n")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = _answer(run_dir, seq)
        if answer is not None:
            return answer
        if not launcher_alive(run_dir):
            raise ValueError(f"the launcher of {run_dir} ended before it answered the request")
        time.sleep(0.1)
    raise ValueError(
        f"the launcher of {run_dir} did not answer within {timeout:.0f}s; see its output"
    )
