"""Ctrl-C of a script run alone (``python train.py``, no launcher) while ``distsgd.train``
drives the loop: one line, no traceback, and the process ends as on Ctrl-C (SIGINT: 130 in the
shell), as under ``distsgd run``; a script's own ``except KeyboardInterrupt`` still catches it
(issue 36, item 12c)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import loadclock
import pytest
import torch.nn.functional as F
from conftest import SCRIPTS, wait_for
from torch import nn

import distsgd
from distsgd import api
from distsgd.control.task import ENV_VAR


def _interrupting(*args: Any, **kwargs: Any) -> Any:
    raise KeyboardInterrupt


def _train() -> None:
    x = nn.Linear(2, 2).weight.detach()
    distsgd.train(model=nn.Linear(2, 2), loss_fn=F.mse_loss, train_data=(x, x))


def test_a_script_alone_gets_a_keyboard_interrupt_it_may_catch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("DISTSGD_RUNS", str(tmp_path))
    monkeypatch.setattr(api, "run_worker", _interrupting)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    with pytest.raises(KeyboardInterrupt) as caught:  # the script's own handler sees it
        _train()
    assert type(caught.value) is KeyboardInterrupt  # as Python's: it ends the process by SIGINT
    (folder,) = tmp_path.iterdir()
    assert (
        str(caught.value)
        == f"distsgd: interrupted; training stopped; its files so far are in {folder}"
    )
    # left uncaught: its one line in place of the traceback; any other error as before
    sys.excepthook(type(caught.value), caught.value, caught.value.__traceback__)
    assert capsys.readouterr().err == f"{caught.value}\n"
    try:
        raise ValueError("the script's own")
    except ValueError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    said = capsys.readouterr().err
    assert said.startswith("Traceback") and said.endswith("ValueError: the script's own\n")


def test_under_a_launcher_the_interrupt_is_left_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    from distsgd.control.task import TaskEnv

    env = TaskEnv(cluster={"ps": [], "worker": ["127.0.0.1:1"]}, task_index=0, scheme="allreduce")
    monkeypatch.setenv(ENV_VAR, env.to_json())
    monkeypatch.setattr(api, "run_worker", _interrupting)
    with pytest.raises(KeyboardInterrupt) as caught:
        _train()
    assert str(caught.value) == ""  # the one that was raised


def test_ctrl_c_of_a_script_alone_is_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    env["DISTSGD_RUNS"] = str(tmp_path)
    cmd = [sys.executable, "-u", str(SCRIPTS / "blobs.py"), "--slow", "0.1", "--steps", "5000"]
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as proc:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr or []), daemon=True)
        reader.start()
        try:
            # training runs once its progress line shows (an event, not a fixed sleep)
            assert wait_for(lambda: any("[distsgd] step" in line for line in lines), 240)
            proc.send_signal(signal.SIGINT)
            code = loadclock.wait(proc, 120)
        finally:
            if proc.poll() is None:
                proc.kill()
        reader.join(timeout=30)
    said = [line.rstrip("\n") for line in lines if not line.startswith("[distsgd] step")]
    (folder,) = tmp_path.iterdir()
    assert said == [f"distsgd: interrupted; training stopped; its files so far are in {folder}"]
    assert code == -signal.SIGINT  # as Python ends on Ctrl-C: the shell shows 130
