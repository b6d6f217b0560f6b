"""How a stopped launch exits: Ctrl-C (SIGINT) 130, SIGTERM 143 (the shell's 128 + 15)."""

from __future__ import annotations

import io
import signal
from pathlib import Path
from typing import Any

import pytest

from distsgd.control.outcome import EXIT_INTERRUPTED, RunOutcome, RunStatus
from distsgd.launcher.run import interrupted_outcome


def test_sigterm_exits_143_and_ctrl_c_130(tmp_path: Path) -> None:
    assert interrupted_outcome(tmp_path, [signal.SIGTERM]).exit_code == 143
    assert interrupted_outcome(tmp_path, [signal.SIGINT]).exit_code == EXIT_INTERRUPTED == 130
    assert interrupted_outcome(tmp_path, []).exit_code == 130  # a KeyboardInterrupt of its own
    # the first signal decides (a SIGTERM after a Ctrl-C does not change what stopped it)
    assert interrupted_outcome(tmp_path, [signal.SIGINT, signal.SIGTERM]).exit_code == 130
    assert interrupted_outcome(tmp_path, [signal.SIGTERM]).status is RunStatus.INTERRUPTED


def test_only_an_interrupted_run_exits_143(tmp_path: Path) -> None:
    ok = RunOutcome(status=RunStatus.OK, run_dir=tmp_path, terminated=True)
    assert ok.exit_code == 0


def test_compare_stopped_by_sigterm_exits_143(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conftest import SCRIPTS

    from distsgd.compare import run as compare_module
    from distsgd.compare.run import CompareConfig, compare
    from distsgd.launcher.progress import Console

    def stopped(config: Any, console: Any) -> RunOutcome:  # SIGTERM reached the launch
        return interrupted_outcome(config.run_dir, [signal.SIGTERM])

    monkeypatch.setattr(compare_module, "launch", stopped)
    config = CompareConfig(
        schemes=("hogwild", "sync"), script=str(SCRIPTS / "blobs.py"), out=tmp_path / "out"
    )
    assert compare(config, Console(io.StringIO())) == 143
