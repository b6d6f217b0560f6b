"""The fork server (launcher/zygote.py, launcher/forked.py): its protocol refuses what breaks it,
and a real server forks worker tasks that behave as processes started anew would."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import loadclock
import psutil
import pytest

from distsgd.control.errors import SETUP_EXIT_CODE
from distsgd.launcher.forked import ForkedTask, ForkRefused, forkable
from distsgd.launcher.lifeline import FORK_SERVER_ENV, PARENT_ENV
from distsgd.launcher.supervisor import Supervisor, Task
from distsgd.launcher.zygote import (
    ProtocolError,
    encode,
    parse_report,
    parse_request,
)

BOOTSTRAP = [sys.executable, "-m", "distsgd.launcher.bootstrap"]
SRC = str(Path(__file__).resolve().parents[1] / "src")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def _request(**changes: Any) -> dict[str, Any]:
    message: dict[str, Any] = {
        "op": "fork",
        "id": 1,
        "module": "distsgd.launcher.bootstrap",
        "args": ["train.py", "--epochs", "1"],
        "env": {"PATH": "/usr/bin", "X": ""},
        "cwd": "/tmp",
    }
    message.update(changes)
    return message


# -- the protocol, alone -------------------------------------------------------------------------
def test_a_good_request_is_read_whole() -> None:
    request = parse_request(encode(_request()), [9])
    assert (request.id, request.module, request.cwd, request.out_fd) == (
        1,
        "distsgd.launcher.bootstrap",
        "/tmp",
        9,
    )
    assert request.args == ("train.py", "--epochs", "1")
    assert dict(request.env) == {"PATH": "/usr/bin", "X": ""}


@pytest.mark.parametrize(
    ("data", "fds", "says"),
    [
        (b"{not json", [3], "not JSON"),
        (b"\xff\xfe", [3], "not JSON"),
        (b"[1, 2]", [3], "not a JSON object"),
        (encode({k: v for k, v in _request().items() if k != "cwd"}), [3], "keys"),
        (encode({**_request(), "shell": True}), [3], "keys"),
        (encode(_request(op="exec")), [3], "unknown op"),
        (encode(_request(module="os")), [3], "not one this server runs"),
        (encode(_request(module=7)), [3], "module must be a string"),
        (encode(_request(id=True)), [3], "'id' must be an integer"),
        (encode(_request(id=-1)), [3], "'id' must be an integer"),
        (encode(_request(id="1")), [3], "'id' must be an integer"),
        (encode(_request(args="train.py")), [3], "'args' must be a list"),
        (encode(_request(args=["a", 1])), [3], "each argument must be a string"),
        (encode(_request(args=["a\0b"])), [3], "without NUL"),
        (encode(_request(env=["PATH"])), [3], "'env' must be an object"),
        (encode(_request(env={"A": 1})), [3], "environment variable A"),
        (encode(_request(env={"A=B": "c"})), [3], "holds '='"),
        (encode(_request(env={"": "c"})), [3], "is empty"),
        (encode(_request(cwd="relative/dir")), [3], "absolute path"),
        (encode(_request(cwd=None)), [3], "cwd must be a string"),
        (encode(_request()), [], "one descriptor, got 0"),
        (encode(_request()), [3, 4], "one descriptor, got 2"),
    ],
)
def test_a_bad_request_is_refused(data: bytes, fds: list[int], says: str) -> None:
    with pytest.raises(ProtocolError, match=says):
        parse_request(data, fds)


def test_reports_are_read_and_bad_ones_refused() -> None:
    assert parse_report(encode({"ready": True, "pid": 5})).ready
    forked = parse_report(encode({"id": 3, "pid": 77}))
    assert (forked.id, forked.pid, forked.error) == (3, 77, "")
    assert parse_report(encode({"id": 3, "error": "no"})).error == "no"
    ended = parse_report(encode({"pid": 77, "exit": -9}))
    assert (ended.pid, ended.exit, ended.id) == (77, -9, None)
    for bad in (
        {"ready": False, "pid": 5},
        {"pid": 0, "exit": 0},
        {"pid": 5, "exit": True},
        {"pid": 5, "exit": 300},
        {"pid": 5, "exit": "0"},
        {"id": 1},
        {"id": 1, "pid": 2, "exit": 0},
    ):
        with pytest.raises(ProtocolError):
            parse_report(encode(bad))
    with pytest.raises(ProtocolError, match="not JSON"):
        parse_report(b"")


def test_only_the_worker_bootstrap_is_forked() -> None:
    assert forkable([*BOOTSTRAP, "train.py", "--x"]) == (
        "distsgd.launcher.bootstrap",
        ["train.py", "--x"],
    )
    assert forkable([sys.executable, "-m", "distsgd", "server", "--job", "ps"]) is None
    assert forkable(["/other/python", "-m", "distsgd.launcher.bootstrap", "t.py"]) is None
    assert forkable([sys.executable, "train.py"]) is None


# -- a real fork server --------------------------------------------------------------------------
SCRIPT = """\
import json, os, signal, subprocess, sys, time
import torch
import distsgd.api
what = sys.argv[1]
if what not in ("plain", "early"):
    distsgd.api.calls += 1  # as a script that called distsgd.train: its exit code is its own
print(f"hello from {what}", flush=True)
if what == "early":
    raise RuntimeError("boom before training")
if what == "exit":
    sys.exit(int(sys.argv[2]))
if what == "signal":
    os.kill(os.getpid(), signal.SIGKILL)
if what == "report":
    seen = {
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "threads": torch.get_num_threads(),
        "argv": sys.argv,
        "main": __name__,
        "sid": os.getsid(0) == os.getpid(),
        "stdin": sys.stdin.read(),
    }
    with open(sys.argv[2], "w") as f:
        json.dump(seen, f)
if what == "group":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(sys.argv[2], "w") as f:
        f.write(str(child.pid))
    time.sleep(600)
if what == "sleep":
    open(sys.argv[2], "w").close()
    time.sleep(600)
if what == "raise":
    raise RuntimeError("boom in the script")
"""


class Lines:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self.lock:
            self.lines.append(line)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Supervisor, Lines, Path]]:
    folder = tmp_path_factory.mktemp("zygote")
    (folder / "task.py").write_text(SCRIPT)
    lines = Lines()
    supervisor = Supervisor(log_dir=folder / "logs", echo=lines, fork_server_log=folder / "fs.log")
    yield supervisor, lines, folder
    supervisor.close()


def _env(**extra: str) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin"),
        "PYTHONPATH": SRC,
        PARENT_ENV: str(os.getpid()),
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def _start(zygote: tuple[Supervisor, Lines, Path], name: str, *args: str, **env: str) -> Any:
    supervisor, _, folder = zygote
    return supervisor.start(name, [*BOOTSTRAP, str(folder / "task.py"), *args], _env(**env))


def _wait(task: Any, timeout: float = 60.0) -> int:
    code = task.wait(timeout)
    assert code is not None, f"{task.name} still runs after {timeout}s"
    assert task.reader is not None
    task.reader.join(timeout=10)
    return int(code)


def test_a_forked_task_relays_its_output_and_exit_code(zygote: Any) -> None:
    supervisor, lines, _ = zygote
    task = _start(zygote, "exit7", "exit", "7")
    assert isinstance(task, ForkedTask)
    assert psutil.Process(task.pid).ppid() == supervisor._server.process.pid
    assert _wait(task) == 7
    assert task.poll() == 7
    assert "[exit7] hello from exit" in lines.lines
    assert "hello from exit" in task.log_path.read_text()
    assert "RuntimeWarning" not in task.log_path.read_text()  # runpy's, on a preloaded module
    assert "threads after the imports" not in (zygote[2] / "fs.log").read_text()


def test_the_server_refuses_what_it_cannot_run(zygote: Any, tmp_path: Path) -> None:
    supervisor = zygote[0]
    _wait(_start(zygote, "first", "exit", "0"))  # the server is up
    server = supervisor._server
    read_end, write_end = os.pipe()
    plain = os.open(tmp_path / "file", os.O_WRONLY | os.O_CREAT)
    try:
        cases = [
            (("os", []), tmp_path, write_end, "not one this server runs"),
            (("distsgd.launcher.bootstrap", []), tmp_path / "missing", write_end, "not a folder"),
            (("distsgd.launcher.bootstrap", []), tmp_path, plain, "not the write end of a pipe"),
            (("distsgd.launcher.bootstrap", []), tmp_path, read_end, "not the write end"),
        ]
        for command, cwd, fd, says in cases:
            with pytest.raises(ForkRefused, match=says):
                server.fork(*command, env=_env(), cwd=cwd, out_fd=fd)
    finally:
        for fd in (read_end, write_end, plain):
            os.close(fd)
    assert not server.gone  # a refusal ends nothing
    assert _wait(_start(zygote, "after", "exit", "2")) == 2


def test_a_task_ended_by_a_signal_reads_minus_the_signal(zygote: Any) -> None:
    assert _wait(_start(zygote, "sig", "signal")) == -signal.SIGKILL


def test_a_script_error_prints_its_traceback_and_exits_1(zygote: Any) -> None:
    task = _start(zygote, "raise", "raise")
    assert _wait(task) == 1
    text = task.log_path.read_text()
    assert "RuntimeError: boom in the script" in text and "Traceback" in text


def test_a_script_without_train_is_a_setup_error(zygote: Any) -> None:
    task = _start(zygote, "plain", "plain")
    assert _wait(task) == SETUP_EXIT_CODE  # the launcher does not restart it
    assert "finished without calling distsgd.train()" in task.log_path.read_text()


def test_a_script_that_fails_before_training_is_a_setup_error_naming_its_line(zygote: Any) -> None:
    task = _start(zygote, "early", "early")
    assert _wait(task) == SETUP_EXIT_CODE
    text = task.log_path.read_text()
    line = SCRIPT.splitlines().index('    raise RuntimeError("boom before training")') + 1
    assert "Traceback" in text  # once, for whoever fixes the script
    assert (
        f"distsgd: error: {zygote[2] / 'task.py'} failed before it called distsgd "
        f"(RuntimeError at line {line}: boom before training); fix the script or its arguments"
    ) in text


def test_the_task_gets_its_env_cwd_session_and_thread_budget(zygote: Any, tmp_path: Path) -> None:
    supervisor, _, folder = zygote
    out = tmp_path / "seen.json"
    argv = [*BOOTSTRAP, str(folder / "task.py"), "report", str(out)]
    env = _env(ONLY_HERE="yes", DISTSGD_THREADS="2", OMP_NUM_THREADS="2")
    task = supervisor.start("report", argv, env, cwd=tmp_path)
    assert isinstance(task, ForkedTask)
    assert _wait(task) == 0, task.log_path.read_text()
    seen = json.loads(out.read_text())
    assert seen["cwd"] == str(tmp_path)
    assert seen["env"]["ONLY_HERE"] == "yes"
    assert seen["env"][FORK_SERVER_ENV] == str(supervisor._server.process.pid)
    assert {k for k in seen["env"] if k != FORK_SERVER_ENV} == set(env)  # whole, nothing else
    assert seen["threads"] == 2
    assert seen["argv"] == [str(folder / "task.py"), "report", str(out)]
    assert seen["main"] == "__main__" and seen["sid"] and seen["stdin"] == ""


def test_stop_kills_the_task_and_its_group(zygote: Any, tmp_path: Path) -> None:
    supervisor, _, _ = zygote
    pid_file = tmp_path / "child.pid"
    task = _start(zygote, "group", "group", str(pid_file))
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and task.poll() is None, task.log_path.read_text()
        time.sleep(0.05)
    grandchild = psutil.Process(int(pid_file.read_text()))
    supervisor.stop(["group"], grace=0.5)
    assert task.poll() == -signal.SIGTERM
    grandchild.wait(timeout=10)
    assert not grandchild.is_running()


def test_kill_ends_a_running_task(zygote: Any, tmp_path: Path) -> None:
    task = _start(zygote, "killed", "sleep", str(tmp_path / "started"))
    while not (tmp_path / "started").exists():
        time.sleep(0.05)
    task.kill()
    assert _wait(task) == -signal.SIGKILL
    task.kill()  # ended: nothing to signal, and no error


def test_without_a_server_when_it_is_gone(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "task.py").write_text(SCRIPT)
    lines = Lines()
    server_log = tmp_path / "fs.log"
    supervisor = Supervisor(log_dir=tmp_path / "logs", echo=lines, fork_server_log=server_log)
    zygote = (supervisor, lines, tmp_path)
    try:
        assert isinstance(_start(zygote, "first", "exit", "0"), ForkedTask)
        server = supervisor._server
        assert server is not None
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=10)
        with caplog.at_level(logging.WARNING, logger="distsgd.launcher.supervisor"):
            second = _start(zygote, "second", "exit", "5")
            third = _start(zygote, "third", "exit", "6")
        assert isinstance(second, Task) and isinstance(third, Task)
        assert (_wait(second), _wait(third)) == (5, 6)
        warned = [r for r in caplog.records if "new processes" in r.getMessage()]
        assert len(warned) == 1
    finally:
        supervisor.close()


def test_close_leaves_no_process(tmp_path: Path) -> None:
    (tmp_path / "task.py").write_text(SCRIPT)
    server_log = tmp_path / "fs.log"
    supervisor = Supervisor(log_dir=tmp_path / "logs", echo=Lines(), fork_server_log=server_log)
    zygote = (supervisor, Lines(), tmp_path)
    try:
        task = _start(zygote, "sleeper", "group", str(tmp_path / "pid"))
        while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text():
            assert task.poll() is None, task.log_path.read_text()
            time.sleep(0.05)
        assert supervisor._server is not None
        pids = [supervisor._server.process.pid, task.pid, int((tmp_path / "pid").read_text())]
    finally:
        supervisor.close()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if _alive(p)]
        time.sleep(0.05)


def test_off_starts_processes(tmp_path: Path) -> None:
    (tmp_path / "task.py").write_text(SCRIPT)
    supervisor = Supervisor(log_dir=tmp_path / "logs", echo=Lines())
    try:
        task = _start((supervisor, Lines(), tmp_path), "popen", "exit", "4")
        assert isinstance(task, Task) and _wait(task) == 4
        assert supervisor._server is None
    finally:
        supervisor.close()


LAUNCHER = """\
import os, sys, time
from pathlib import Path
from distsgd.launcher.supervisor import Supervisor
folder = Path(sys.argv[1])
supervisor = Supervisor(
    log_dir=folder / "logs", echo=lambda line: None, fork_server_log=folder / "fs.log"
)
env = {**os.environ, "DISTSGD_PARENT_PID": str(os.getpid())}
argv = [sys.executable, "-m", "distsgd.launcher.bootstrap", str(folder / "task.py")]
task = supervisor.start("w", [*argv, "group", str(folder / "pid")], env)
while not (folder / "pid").exists():
    time.sleep(0.05)
print(supervisor._server.process.pid, task.pid, (folder / "pid").read_text(), flush=True)
os._exit(0)  # the launcher dies without stopping anything
"""


def test_nothing_outlives_a_launcher_that_dies(tmp_path: Path) -> None:
    (tmp_path / "task.py").write_text(SCRIPT)
    (tmp_path / "launcher.py").write_text(textwrap.dedent(LAUNCHER))
    out = loadclock.run(
        [sys.executable, str(tmp_path / "launcher.py"), str(tmp_path)],
        env={**os.environ, "PYTHONPATH": SRC},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 3, out
    deadline = time.monotonic() + 15
    while any(psutil.pid_exists(p) and _alive(p) for p in pids[:2]):
        assert time.monotonic() < deadline, f"still running: {pids}"
        time.sleep(0.1)
    # the worker's own child is in the worker's group; its parent is gone, and so is the
    # lifeline of the tree: it is left to the worker's group kill, which a dead launcher
    # cannot do, so end it here (it is this test's process tree)
    if _alive(pids[2]):
        os.kill(pids[2], signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
