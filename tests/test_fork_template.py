"""The fork-server template (:mod:`distsgd_emulate.fork_template`): a launcher that finds one
gets its fork server forked from it, that server ends with its launcher (a killed one too) and
takes its tasks with it, the template refuses what is not a request and serves on, and a
launcher that cannot reach it starts its own server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import fork_template
import loadclock
import psutil
import pytest
from conftest import SCRIPTS, alive, metrics, task_pids, wait_for

from distsgd.launcher.forked import TEMPLATE_ENV, Adopted, ForkServer

BLOBS = str(SCRIPTS / "blobs.py")


@pytest.fixture(scope="module")
def own_template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[psutil.Process]:
    """A template of this module's own (the suite's may be off): its process."""
    folder = tmp_path_factory.mktemp("own-template")
    with fork_template.running(folder) as proc:
        assert Path(proc.args[-1]).exists(), (folder / "template.log").read_text()
        yield psutil.Process(proc.pid)


def _path(owner: psutil.Process) -> str:
    """The template's socket (its command line shows its title instead of its arguments)."""
    return next(c.laddr for c in psutil.Process(owner.pid).net_connections("unix") if c.laddr)


@pytest.mark.slow
def test_a_run_gets_its_server_from_the_template_and_a_killed_launcher_takes_it_along(
    own_template: psutil.Process, spawn, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    env = {TEMPLATE_ENV: _path(own_template)}
    args = ["run", "--workers", "2", "--scheme", "sync", "--run-dir", str(run_dir), BLOBS]
    launcher = spawn([*args, "--steps", "2000", "--slow", "0.02"], env=env)
    assert wait_for(lambda: len(metrics(run_dir)) >= 2, 90), "no progress"
    log = (run_dir / "fork-server.log").read_text()
    servers = own_template.children()
    assert len(servers) == 1, (servers, log)  # this run's fork server, from the template
    assert f"fork server for launcher {launcher.pid}, forked from a template" in log
    workers = [pid for name, pid in task_pids(run_dir).items() if name.startswith("worker")]
    assert workers and all(psutil.Process(pid).ppid() == servers[0].pid for pid in workers)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(timeout=10)
    pids = [*task_pids(run_dir).values(), servers[0].pid]
    assert wait_for(lambda: alive(pids) == [], 30), alive(pids)
    assert own_template.is_running() and Path(_path(own_template)).exists()


def test_a_bad_request_is_refused_and_the_template_serves_on(
    own_template: psutil.Process,
) -> None:
    for message, fds in [(b"not json", 2), (b'{"launcher": 1}', 2), (b'{"x": 1}', 0)]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with ours, theirs, socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.settimeout(30)
            conn.connect(_path(own_template))
            if fds:
                socket.send_fds(conn, [message], [theirs.fileno()] * fds)
            else:
                conn.send(message)
            answer = json.loads(conn.recv(4096))
        assert set(answer) == {"error"}, answer
    assert own_template.children() == [] and own_template.is_running()


def test_a_launcher_that_cannot_reach_a_template_starts_its_own_server(tmp_path: Path) -> None:
    server = ForkServer.spawn(
        {**os.environ, TEMPLATE_ENV: str(tmp_path / "no-such.sock")}, tmp_path / "server.log"
    )
    try:
        assert isinstance(server.process, subprocess.Popen)
        assert server.process.pid in [p.pid for p in psutil.Process().children()]
    finally:
        server.close()
    assert server.process.poll() is not None


def test_a_server_from_a_template_is_waited_for_by_its_pid(tmp_path: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        adopted = Adopted(sleeper.pid)
        with pytest.raises(subprocess.TimeoutExpired):
            adopted.wait(timeout=0.2)
        sleeper.kill()
        assert adopted.wait(timeout=30) == 0
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_folder_others_may_enter_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "open"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    done = loadclock.run(
        [sys.executable, "-m", "distsgd_emulate.fork_template", str(folder / "t.sock")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "must be this user's and mode 0700" in done.stderr
    assert not (folder / "t.sock").exists()
