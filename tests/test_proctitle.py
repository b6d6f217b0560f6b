"""Each task of a run names its role and run in ``ps`` and ``top`` (util/proctitle.py): not
``python3 -m distsgd.launcher.zygote 5`` for every forked task."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import distsgd
from distsgd.launcher.emulated import NoHosts
from distsgd.launcher.lifeline import PARENT_ENV
from distsgd.launcher.supervisor import Supervisor
from distsgd.launcher.tasks import TaskStarter
from distsgd.util.proctitle import TITLE_ENV, argument_area, short_name, task_title

SRC = str(Path(distsgd.__file__).resolve().parents[1])  # the distsgd this test imports
SCRIPT = """\
import sys, time
open(sys.argv[1], "w").close()
time.sleep(600)
"""


def test_the_short_name_fits_the_kernels_15_bytes() -> None:
    assert short_name("distsgd worker1 20261206-run") == "distsgd-worker1"
    assert short_name("distsgd ps0 r") == "distsgd-ps0"
    assert short_name("distsgd worker12 r") == "worker12"  # the index is kept, not the prefix
    assert short_name("distsgd fork-server r") == "fork-server"
    assert all(len(short_name(f"distsgd {'x' * n} r")) <= 15 for n in range(1, 30))


def test_the_argument_area_is_read_after_the_last_parenthesis() -> None:
    fields = [str(n) for n in range(3, 53)]  # fields 3.. as proc(5) numbers them
    stat = f"42 (a) b (c) {' '.join(fields)}\n"  # a command name with ") (" in it
    assert argument_area(stat) == (48, 49)


def test_the_launcher_gives_each_task_its_title(tmp_path: Path) -> None:
    seen: dict[str, dict[str, str]] = {}

    class Recorder:
        def start(self, name: str, argv: Any, env: dict[str, str]) -> None:
            seen[name] = env

    tasks = TaskStarter.__new__(TaskStarter)  # only what start_task reads
    tasks.state = SimpleNamespace(  # type: ignore[assignment]
        started_at={}, run_dir=tmp_path / "20261206-sync", supervisor=Recorder()
    )
    tasks.hosts = NoHosts()
    tasks.start_task("worker1", ["x"], {"A": "1"})
    assert seen["worker1"] == {"A": "1", TITLE_ENV: "distsgd worker1 20261206-sync"}


def _shown(pid: int) -> tuple[str, str]:
    comm = Path(f"/proc/{pid}/comm").read_text().strip()
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode()
    return comm, cmdline.replace("\0", " ")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
@pytest.mark.parametrize("forked", [True, False], ids=["forked", "process"])
def test_a_started_task_shows_its_title(tmp_path: Path, forked: bool) -> None:
    (tmp_path / "task.py").write_text(SCRIPT)
    run = tmp_path / "20261206-101010-sync"
    run.mkdir()
    supervisor = Supervisor(
        log_dir=run / "logs",
        echo=lambda line: None,
        fork_server_log=run / "fork-server.log" if forked else None,
        preload_optimizer=False,
    )
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin"),
        "PYTHONPATH": SRC,
        PARENT_ENV: str(os.getpid()),
        TITLE_ENV: task_title("worker1", run.name),
    }
    marker = tmp_path / "started"
    argv = [sys.executable, "-m", "distsgd.launcher.bootstrap", str(tmp_path / "task.py")]
    try:
        task = supervisor.start("worker1", [*argv, str(marker)], env)
        while not marker.exists():  # bounded by the task: it ends on any failure
            assert task.poll() is None, task.log_path.read_text()
            time.sleep(0.05)
        assert _shown(task.pid) == ("distsgd-worker1", "distsgd worker1 20261206-101010-sync")
        if forked:
            server = supervisor._server
            assert server is not None
            assert _shown(server.process.pid) == (
                "fork-server",
                "distsgd fork-server 20261206-101010-sync",
            )
    finally:
        supervisor.close()
