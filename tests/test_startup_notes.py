"""The launcher's first line comes at once, and a wait of its start-up that lasts more than a
few seconds says what it waits for (launcher/waits.py): an all-reduce run on a loaded machine
said nothing for 70 s while the launcher and the fork server imported torch."""

from __future__ import annotations

import io
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import SCRIPTS

from distsgd.launcher.config import ClusterSize, LaunchConfig
from distsgd.launcher.emulated import NoHosts
from distsgd.launcher.errors import RunFailed
from distsgd.launcher.progress import Console
from distsgd.launcher.run import launch
from distsgd.launcher.supervisor import Supervisor
from distsgd.launcher.tasks import TaskStarter
from distsgd.launcher.waits import Reminder, said_while_slow

BOOTSTRAP = [sys.executable, "-m", "distsgd.launcher.bootstrap", str(SCRIPTS / "blobs.py")]


class Said:
    """A console's ``note``: the lines, and an event once one holds ``word``."""

    def __init__(self, word: str) -> None:
        self.lines: list[str] = []
        self.word = word
        self.seen = threading.Event()

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        if self.word in line:
            self.seen.set()


def test_a_slow_step_is_said_while_it_lasts() -> None:
    said = Said("waiting for")
    with said_while_slow(said, "the fork server to import torch", after=0.0):
        # the slow step itself: it ends only once the wait has been said
        assert said.seen.wait(600), "the wait was never said"
    assert said.lines[0] == "[distsgd] waiting for the fork server to import torch (0 s)"


def test_a_quick_step_says_nothing() -> None:
    said = Said("waiting for")
    with said_while_slow(said, "nothing slow", after=3600.0):
        pass
    assert said.lines == []


def test_a_reminder_says_the_wait_after_a_while_then_every_so_often() -> None:
    now = [0.0]
    said = Said("waiting for")
    reminder = Reminder(said, after=3.0, every=15.0, clock=lambda: now[0])
    for t in (0.0, 2.9, 3.0, 10.0, 18.0, 18.5):
        now[0] = t
        reminder.check("the first step of worker0")
    assert said.lines == [
        "[distsgd] waiting for the first step of worker0 (3 s)",
        "[distsgd] waiting for the first step of worker0 (18 s)",
    ]
    reminder.check(None)  # it came; a later wait starts anew
    now[0] = 20.0
    reminder.check("x")
    assert len(said.lines) == 2


def test_the_first_line_comes_before_the_cluster_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Starting the cluster is the slow part (torch imported to host the rendezvous, the fork
    server's imports): the run's line is out before it begins."""
    stream = io.StringIO()
    before: list[str] = []

    def slow_start(self: TaskStarter, checkpoint: Any, *, fresh_ports: bool) -> None:
        before.append(stream.getvalue())
        raise RunFailed("stopped by the test where the cluster would start")

    monkeypatch.setattr(TaskStarter, "start_cluster", slow_start)
    config = LaunchConfig(
        script=str(SCRIPTS / "blobs.py"),
        scheme="allreduce",
        run_dir=tmp_path / "r",
        size=ClusterSize(workers=2),
    )
    outcome = launch(config, Console(stream))
    assert outcome.reason.startswith("stopped by the test")
    assert before and "[distsgd] run " in before[0] and "scheme allreduce" in before[0]


def test_the_wait_for_the_fork_server_is_said(tmp_path: Path) -> None:
    said = Said("fork server")

    class Importing:  # a fork server still importing torch until the wait has been said
        def wait_ready(self, timeout: float | None) -> bool:
            return said.seen.wait(600) if timeout else False

        def fork(self, *args: Any, **kwargs: Any) -> int:
            return 424242

    supervisor = Supervisor(
        log_dir=tmp_path / "logs", echo=lambda line: None, note=said, fork_server_log=tmp_path
    )
    supervisor._server = Importing()  # type: ignore[assignment]
    task = supervisor._fork("worker0", BOOTSTRAP, {}, cwd=tmp_path, log_path=tmp_path / "w.log")
    assert task is not None and task.pid == 424242
    task.stream.close()
    assert said.lines[0].startswith(
        "[distsgd] waiting for the fork server to import torch before it starts worker0"
    )


def test_the_fork_server_starts_before_the_launcher_loads_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The two imports of an all-reduce run's start (the fork server's, the launcher's for the
    rendezvous store) go on side by side, not one after the other."""
    from distsgd.launcher import tasks as tasks_module

    order: list[str] = []

    class Recorder:
        control_host = node_host = None  # this machine's engine: the launcher's --host

        def prepare(self, env: Any) -> None:
            order.append("fork server")

    class Stop(Exception):
        pass

    def host_store(*args: Any, **kwargs: Any) -> Any:
        order.append("rendezvous store")
        raise Stop

    monkeypatch.setattr(tasks_module, "host_store", host_store)
    local = TaskStarter.__new__(TaskStarter)  # only what start_cluster reads up to the store
    config = LaunchConfig(
        script=str(SCRIPTS / "blobs.py"), scheme="allreduce", size=ClusterSize(workers=2)
    )
    local.state = SimpleNamespace(  # type: ignore[assignment]
        config=config,
        wal_root=tmp_path / "wal",
        num_ps=0,
        active={0, 1},
        collective=True,
        supervisor=Recorder(),
        console=Console(io.StringIO()),
    )
    local.hosts = NoHosts()
    local.replicas, local.worker_env = None, {}
    with pytest.raises(Stop):
        local.start_cluster(None, fresh_ports=True)
    assert order == ["fork server", "rendezvous store"]
