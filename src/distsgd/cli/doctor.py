"""``distsgd doctor PATH``: look inside a run.

- A running run's folder: every task is asked what it is doing; the culprit that holds the
  run up, what it waits on and its blocking frame, in a few lines
  (:mod:`distsgd.launcher.doctor`; the whole report goes to ``RUN/doctor/``).
- ``--watch``: a live view of the run's tasks instead, redrawn every second until Ctrl-C
  (:func:`distsgd.control.run_top.watch`: rate, phase split, staleness, servers' load,
  stragglers), over a run's ``metrics.jsonl``, running or finished.
- A run folder no task runs in any more, a checkpoint folder or one of its files: what the
  checkpoint holds (:mod:`distsgd.cli.inspect`), read without running anything.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from distsgd.cli.inspect import inspect
from distsgd.control.folder import METRICS_FILE
from distsgd.control.run_top import watch as watch_run
from distsgd.control.waitfor import STALL_S
from distsgd.launcher.doctor import examine, pointers, process_state


def doctor(path: Path, *, watch: bool = False, stall: float = STALL_S) -> int:
    """See the module docstring; a path that is none of these is one line of ValueError."""
    if not path.exists():
        raise ValueError(f"{path}: no such file or folder; give a run folder or a checkpoint")
    if stall <= 0:
        raise ValueError(f"--stall must be a positive number of seconds, got {stall}")
    if watch:
        if not (path / METRICS_FILE).is_file():
            raise ValueError(f"{path}: no {METRICS_FILE} to watch; give a run folder")
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends the view
            watch_run(path, sys.stdout)
        return 0
    running = pointers(path) if path.is_dir() else []  # a SIGKILLed task's stays behind
    if any(process_state(int(p["pid"])) not in ("gone", "zombie") for p in running):
        found = examine(path, stall_s=stall)
        for line in found.lines(path):
            print(line)
        return 0
    if path.is_dir() and (path / METRICS_FILE).is_file():
        print(f"{path}: no task of it is running; what its last checkpoint holds:")
    return inspect(path)
