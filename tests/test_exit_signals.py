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

    from distsgd.launcher.progress import Console
    from distsgd_compare import run as compare_module
    from distsgd_compare.config import CompareConfig
    from distsgd_compare.run import compare

    def stopped(config: Any, console: Any) -> RunOutcome:  # SIGTERM reached the launch
        return interrupted_outcome(config.run_dir, [signal.SIGTERM])

    monkeypatch.setattr(compare_module, "launch", stopped)
    config = CompareConfig(
        schemes=("hogwild", "sync"), script=str(SCRIPTS / "blobs.py"), out=tmp_path / "out"
    )
    assert compare(config, Console(io.StringIO())) == 143


def test_k8s_local_stopped_by_sigterm_exits_143(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from distsgd.launcher.errors import Interrupted
    from distsgd.launcher.progress import Console
    from distsgd_emulate import k8s_local

    class Cluster:  # stands in for LocalCluster: SIGTERM reaches the process while it runs
        def __init__(self, out_dir: Path, local_dir: Path, console: Console) -> None:
            self.name, self.jobs = "digits", []
            self.supervisor = type("S", (), {"tasks": {}})()
            self.stop = threading.Event()

        def run(self) -> int:
            signal.raise_signal(signal.SIGTERM)  # its handler runs before the next line
            assert self.stop.wait(600)
            raise Interrupted

        def close(self) -> None:
            pass

    monkeypatch.setattr(k8s_local, "LocalCluster", Cluster)
    code = k8s_local.run_local(tmp_path, local_dir=tmp_path / "l", console=Console(io.StringIO()))
    assert code == 143
