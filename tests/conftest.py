"""Shared helpers: run the real ``distsgd`` command in a child process and clean up after it."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"

# Scripts run alone (python script.py, doc blocks, distsgd.train in-process) write a run folder
# under $DISTSGD_RUNS: here a temporary one per test process, not the checkout's distsgd-runs/.
_RUNS = tempfile.mkdtemp(prefix="distsgd-test-runs-")
os.environ["DISTSGD_RUNS"] = _RUNS
atexit.register(shutil.rmtree, _RUNS, True)


def distsgd_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "distsgd", *args]


def run_distsgd(
    args: Sequence[str], *, timeout: float = 240.0, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``distsgd ARGS`` to the end; output captured as text."""
    return subprocess.run(
        distsgd_cmd(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


def run_scheme(
    scheme: str, run_dir: Path, script: str | Path, *script_args: str, workers: int = 2
) -> subprocess.CompletedProcess[str]:
    """``distsgd run`` of ``script`` under ``scheme``, quiet, into ``run_dir``."""
    args = ["run", "--workers", str(workers), "--scheme", scheme, "--quiet"]
    return run_distsgd([*args, "--run-dir", str(run_dir), str(script), *script_args])


def final_accuracy(done: subprocess.CompletedProcess[str]) -> float:
    """The ``test accuracy: X`` the launcher prints as its last line (asserts it is there)."""
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("test accuracy: "), last
    return float(last.split(":")[1])


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def task_pids(run_dir: Path) -> dict[str, int]:
    return json.loads((run_dir / "tasks.json").read_text())


def alive(pids: Sequence[int]) -> list[int]:
    """PIDs among ``pids`` that still run (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_for(predicate, timeout: float, interval: float = 0.1) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


@pytest.fixture
def spawn() -> Iterator:  # type: ignore[type-arg]
    """Start ``distsgd`` commands in the background; every one (and its tree) ends with the test."""
    started: list[psutil.Popen] = []

    def start(args: Sequence[str], **kw) -> psutil.Popen:  # type: ignore[no-untyped-def]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **kw.pop("env", {})}
        proc = psutil.Popen(
            distsgd_cmd(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            stdin=subprocess.DEVNULL,
            env=env,
            **kw,
        )
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            try:
                tree = [proc, *proc.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for p in reversed(tree):
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            proc.wait(timeout=10)
