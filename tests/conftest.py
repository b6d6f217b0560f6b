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


SLOW_FIRST = (
    "test_elastic.py::test_run_grows_and_shrinks_2_4_1_3_without_losing_a_sample",
    "test_benchmarks.py::test_quick_suite_writes_every_row_and_cleans_up",
    "test_ddp_hooks.py::test_hooks_train_and_count_what_they_all_reduce",
    "test_elastic.py::test_collective_run_survives_2_4_1_3_by_restarts_from_its_checkpoints",
    "test_compare.py::test_compare_writes_figure_table_and_json_and_survives_a_failed_scheme",
    "test_ddp_hooks.py::test_a_model_whose_used_parameters_change_is_told_to_run_with_dynamic",
    "test_localsgd.py::test_period_one_equals_allreduce_sgd",
    "test_docs.py::test_python_block_runs[docs/large-data.md",
    "test_docs.py::test_python_block_runs[docs/own-loop.md",
    "test_collective_sockets.py::test_collective_run_listens_on_loopback_only",
    "test_streaming.py::test_data_twice_the_memory_limit_trains_to_the_in_memory_accuracy",
    "test_compare.py::test_a_real_tuned_repeated_comparison",
    "test_diloco.py::test_diloco_equals_the_reference",
    "test_safe_defaults.py::test_divergence_is_named_and_exits_nonzero",
    "test_no_code_in_files.py::test_a_real_run_folder_with_a_crafted_checkpoint",
    "test_fault_tolerance.py::test_kill_during_checkpoint_writes_then_resume",
    "test_docs.py::test_python_block_runs[README.md",
    "test_compare.py::test_sigint_stops_the_current_run_and_skips_the_rest",
    "test_cli.py::test_manual_cluster_with_server_and_worker_commands",
    "test_docs.py::test_python_block_runs[docs/tutorial/",
    "test_elastic.py::",
)
"""Tests outside the xdist groups that take 15 s or more in CI (pytest --durations), longest
first: started before the short ones, so that no long test starts last while the other test
process has run out of work (a group, the longest unit, starts first by itself)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests in SLOW_FIRST first, in its order; the rest as collected."""

    def rank(item: pytest.Item) -> int:
        path, _, name = item.nodeid.partition("::")
        key = f"{Path(path).name}::{name}"
        return next(
            (i for i, slow in enumerate(SLOW_FIRST) if key.startswith(slow)),
            len(SLOW_FIRST),
        )

    items.sort(key=rank)


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
