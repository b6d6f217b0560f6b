"""``distsgd doctor RUN_DIR``: ask every task of a run what it is doing, and say who holds the
run up.

Each task (launcher, servers, workers) left a pointer in ``RUN/doctor/<task>.json`` naming its
probe's socket (:mod:`distsgd.util.probe`). The doctor asks them all at once, each with a
timeout; for one that does not answer it reads ``/proc/PID/stat`` (stopped, gone, running ...)
and, where ``py-spy`` is installed, reads its Python stack from outside (``py-spy dump
--nonblocking``: a stopped process too). :func:`distsgd.control.waitfor.diagnose` builds the
wait-for graph and names the culprit; the whole report (every task's stacks and state, the
waits, the verdict) is written to ``RUN/doctor/report-<time>.json`` and a few lines are
printed. It works on any run whose tasks run on this machine: a local run, one on emulated
hosts (the sockets are files, which every host sees), or a cluster started by hand with
``DISTSGD_DOCTOR_DIR`` set (or ``--run-dir``) for its tasks.

Asking costs the tasks nothing until it happens: no task polls, and the launcher runs the
doctor by itself only when the run has made no progress for a while (:class:`StallWatch`).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distsgd.control.waitfor import STALL_S, Diagnosis, TaskSeen, diagnose
from distsgd.util.atomic import write_atomic
from distsgd.util.probe import FOLDER, ask

log = logging.getLogger(__name__)

ASK_TIMEOUT = 3.0
"""Seconds each task has to answer."""
SAMPLE_TIMEOUT = 5.0
"""Seconds py-spy has to read a silent task's stack."""
_PROC_STATES = {"T": "stopped", "t": "stopped", "Z": "zombie", "X": "gone", "R": "running"}
_PROC_STATES.update({"S": "sleeping", "D": "disk", "I": "idle"})


@dataclass(frozen=True)
class Examination:
    """What one run of the doctor found."""

    diagnosis: Diagnosis
    seen: tuple[TaskSeen, ...]
    report_path: Path | None

    def lines(self, run_dir: Path) -> list[str]:
        answered = sum(1 for t in self.seen if t.report is not None)
        stuck = ", ".join(self.diagnosis.stuck) or "none"
        head = (
            f"distsgd doctor: {run_dir}: {len(self.seen)} task(s), {answered} answered; "
            f"stuck: {stuck}"
        )
        tail = [f"  full report: {self.report_path}"] if self.report_path else []
        return [head, *self.diagnosis.lines(), *tail]


def pointers(run_dir: Path) -> list[dict[str, Any]]:
    """The tasks' pointer files in ``run_dir`` (each: task, pid, socket)."""
    folder = run_dir / FOLDER
    found = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if path.name.startswith("report-"):
            continue
        try:
            pointer = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(pointer, dict) and {"task", "pid", "socket"} <= set(pointer):
            found.append(pointer)
    return found


def process_state(pid: int) -> str:
    """What ``/proc/PID/stat`` says of a process: stopped, running, sleeping, ... or gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    code = stat.rpartition(")")[2].split()[0]
    return _PROC_STATES.get(code, code)


def sample(pid: int) -> list[dict[str, Any]]:
    """The main thread's Python stack of ``pid`` read from outside by py-spy (innermost last;
    [] where py-spy is missing or fails)."""
    beside = Path(sys.executable).parent / "py-spy"  # installed in this environment
    spy = str(beside) if beside.is_file() else shutil.which("py-spy")
    if spy is None:
        return []
    try:
        done = subprocess.run(
            [spy, "dump", "--pid", str(pid), "--nonblocking", "--json"],
            capture_output=True,
            timeout=SAMPLE_TIMEOUT,
            check=False,
        )
        threads = json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return []
    main = next((t for t in threads if t.get("thread_name") == "MainThread"), None)
    frames = (main or (threads[0] if threads else {})).get("frames", [])
    return [
        {"file": f.get("filename"), "line": f.get("line"), "function": f.get("name"), "code": ""}
        for f in reversed(frames)
    ]


def _see(pointer: dict[str, Any]) -> TaskSeen:
    task, pid = str(pointer["task"]), int(pointer["pid"])
    try:
        return TaskSeen(task=task, pid=pid, report=ask(str(pointer["socket"]), ASK_TIMEOUT))
    except (OSError, ValueError) as exc:
        state = process_state(pid)
        sampled = sample(pid) if state not in ("gone", "zombie") else []
        return TaskSeen(task=task, pid=pid, process=state, sampled=sampled, error=str(exc)[:200])


def examine(run_dir: Path, *, stall_s: float = STALL_S, write: bool = True) -> Examination:
    """Ask every task of ``run_dir`` and diagnose (see the module docstring); the report goes
    to ``RUN/doctor/report-<time>.json`` unless ``write`` is False. ValueError where the run
    folder has no tasks to ask."""
    found = pointers(run_dir)
    if not found:
        raise ValueError(
            f"{run_dir}: no task of a running run to ask ({run_dir / FOLDER} has no pointers); "
            "give the folder of a run that is running (its tasks leave them there while they run)"
        )
    with ThreadPoolExecutor(max_workers=min(32, len(found))) as pool:
        seen = tuple(pool.map(_see, found))
    diagnosis = diagnose(seen, stall_s=stall_s)
    path = _write(run_dir, seen, diagnosis) if write else None
    return Examination(diagnosis=diagnosis, seen=seen, report_path=path)


def _write(run_dir: Path, seen: Sequence[TaskSeen], diagnosis: Diagnosis) -> Path | None:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = run_dir / FOLDER / f"report-{stamp}.json"
    record = {
        "time": time.time(),
        "diagnosis": {
            "culprit": diagnosis.culprit,
            "cause": diagnosis.cause,
            "frame": diagnosis.frame,
            "stuck": list(diagnosis.stuck),
            "waits": [w.__dict__ for w in diagnosis.waits],
            "blocked": diagnosis.blocked,
        },
        "tasks": [t.__dict__ for t in seen],
    }
    try:
        write_atomic(path, json.dumps(record, indent=1, default=str) + "\n")
    except OSError as exc:
        log.warning("could not write the doctor's report %s: %s", path, exc)
        return None
    return path
