"""The fork server ends at once when the launcher closes it, whatever its interpreter's
finalization would cost (it was killed, with a warning, at the end of normal runs under load)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

import distsgd
from distsgd.launcher.forked import ForkServer
from distsgd.launcher.lifeline import PARENT_ENV

SRC = str(Path(distsgd.__file__).resolve().parents[1])  # the distsgd this test imports
SLOW_EXIT = """\
import atexit, time
atexit.register(time.sleep, 3600)  # an interpreter exit that would never end
"""

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only"),
    pytest.mark.own_fork_server,
]


def test_a_closed_fork_server_exits_without_finalizing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_EXIT)  # the server's interpreter loads it
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(hook), SRC]),
        PARENT_ENV: str(os.getpid()),
    }
    server = ForkServer.spawn(env, tmp_path / "fs.log", preload_optimizer=False)
    try:
        assert server.wait_ready(600), (tmp_path / "fs.log").read_text()
        with caplog.at_level(logging.WARNING, logger="distsgd.launcher.forked"):
            server.close(grace=120.0)  # generous: only a hang reaches it
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()
    assert server.process.returncode == 0, (tmp_path / "fs.log").read_text()
    assert not [r for r in caplog.records if "did not exit" in r.getMessage()]
