"""``RunOutcome``: how a launch ended, as data (control/outcome.py), and how compare reads it."""

from __future__ import annotations

import sys
from pathlib import Path

import loadclock
import pytest

from distsgd.control.outcome import (
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    RunOutcome,
    RunStatus,
)
from distsgd_compare.run import run_status


@pytest.mark.parametrize(
    ("status", "code", "row"),
    [
        (RunStatus.OK, EXIT_OK, "ok"),
        (RunStatus.FAILED, EXIT_FAILED, "failed"),
        (RunStatus.SETUP_ERROR, EXIT_FAILED, "failed"),
        (RunStatus.DIVERGED, EXIT_DIVERGED, "diverged"),
        (RunStatus.STALLED, EXIT_DIVERGED, "diverged"),
        (RunStatus.INTERRUPTED, EXIT_INTERRUPTED, "interrupted"),
    ],
)
def test_each_status_has_its_exit_code_and_compare_row(
    status: RunStatus, code: int, row: str, tmp_path: Path
) -> None:
    outcome = RunOutcome(status=status, run_dir=tmp_path)
    assert outcome.exit_code == code
    assert run_status(outcome) == row


def test_the_explanation_is_the_reason_and_the_last_non_blank_log_line(tmp_path: Path) -> None:
    bare = RunOutcome(status=RunStatus.SETUP_ERROR, run_dir=tmp_path, reason="worker0: no data")
    assert bare.explanation() == "worker0: no data"
    told = RunOutcome(
        status=RunStatus.FAILED,
        run_dir=tmp_path,
        reason="ps0 exited with code 1 before it was listening",
        log_tail=("Traceback (most recent call last):", "OSError: port in use", "   "),
    )
    assert told.explanation() == (
        "ps0 exited with code 1 before it was listening: OSError: port in use"
    )


def test_the_outcome_module_imports_no_torch() -> None:
    """control/ stays torch-free: the outcome module imports with torch blocked."""
    code = "import sys; sys.modules['torch'] = None; import distsgd.control.outcome"
    done = loadclock.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
