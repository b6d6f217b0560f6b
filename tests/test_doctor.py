"""``distsgd doctor``: the wait-for graph and its culprit (control/waitfor.py, pure: reports made
up here), the probe every task holds (util/probe.py: a real socket in this process), and one
real run whose worker is stopped (SIGSTOP) and named, with its launcher's own doctor."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import run_distsgd

from distsgd.control.waitfor import TaskSeen, diagnose
from distsgd.launcher.doctor import examine, pointers, process_state
from distsgd.util.probe import MAX_REQUEST, Probe, ask

SERVERS = ["127.0.0.1:5000", "127.0.0.1:5001"]


def _worker(
    index: int,
    *,
    since: float = 0.1,
    phase: str = "compute",
    calls: list[dict[str, Any]] | None = None,
    collective: bool = False,
    frames: list[dict[str, Any]] | None = None,
) -> TaskSeen:
    state = {
        "step": 40,
        "since_step_s": since,
        "phase": phase,
        "collective": collective,
        "servers": [] if collective else SERVERS,
        "calls": calls or [],
    }
    main = {"thread": "MainThread", "main": True, "frames": frames or []}
    report = {"task": f"worker{index}", "threads": [main], "state": {"worker": state}}
    return TaskSeen(task=f"worker{index}", pid=100 + index, report=report)


def _server(
    index: int,
    *,
    missing: list[int] = (),  # type: ignore[assignment]
    pushed: list[int] = (),  # type: ignore[assignment]
    serving: list[dict[str, Any]] = (),  # type: ignore[assignment]
    waiting: list[dict[str, Any]] = (),  # type: ignore[assignment]
) -> TaskSeen:
    held = {"step": 41, "open_s": 8.0 if pushed else None, "pushed": pushed, "missing": missing}
    state = {
        "address": SERVERS[index],
        "waits_for": held,
        "serving": list(serving),
        "waiting_pulls": list(waiting),
    }
    report = {"task": f"ps{index}", "threads": [], "state": {"server": state}}
    return TaskSeen(task=f"ps{index}", pid=200 + index, report=report)


def _call(server: int, method: str = "Pull", age: float = 8.0, **more: Any) -> dict[str, Any]:
    return {"address": SERVERS[server], "method": method, "age_s": age, **more}


def test_a_stopped_worker_of_a_sync_run_is_the_culprit() -> None:
    seen = [
        _worker(0, since=8.0, phase="pull", calls=[_call(0)]),
        TaskSeen(task="worker1", pid=101, process="stopped"),
        _server(0, pushed=[0], missing=[1], waiting=[{"worker": 0, "for_version": 42}]),
    ]
    found = diagnose(seen)
    assert found.culprit == "worker1" and "SIGSTOP" in found.cause
    assert "install py-spy" in found.frame  # nothing sampled from outside
    assert any(w.task == "ps0" and w.on == "worker1" for w in found.waits)
    assert found.lines()[0].startswith("culprit: worker1")


def test_a_stopped_server_is_the_culprit_with_its_sampled_frame() -> None:
    frames = [{"file": "/x/ps/server.py", "line": 9, "function": "serve", "code": ""}]
    seen = [
        _worker(0, since=8.0, calls=[_call(1, "Push")]),
        _worker(1, since=8.0, calls=[_call(1, "Push")]),
        _server(0),
        TaskSeen(task="ps1", pid=201, process="stopped", sampled=frames),
    ]
    found = diagnose(seen)
    assert found.culprit == "ps1"
    assert found.frame == "/x/ps/server.py:9 in serve"


def test_a_worker_whose_calls_its_server_never_sees_is_cut_off() -> None:
    """A partition: worker1's push in flight, ps0 answers and serves only worker0."""
    seen = [
        _worker(0, since=8.0, phase="pull", calls=[_call(0)]),
        _worker(1, since=8.0, phase="push", calls=[_call(0, "Push")]),
        _server(0, pushed=[0], missing=[1], waiting=[{"worker": 0, "for_version": 42}]),
    ]
    found = diagnose(seen)
    assert found.culprit == "worker1" and "cut off" in found.cause, found


def test_failing_calls_name_the_worker_or_the_server_every_worker_fails_on() -> None:
    one = [
        _worker(0, since=8.0, calls=[_call(0)]),
        _worker(1, since=8.0, calls=[_call(0, attempts=4, last_error="UNAVAILABLE")]),
        _server(0, waiting=[{"worker": 0}]),
    ]
    assert diagnose(one).culprit == "worker1"
    failing = _call(1, attempts=3, last_error="DEADLINE_EXCEEDED")
    both = [_worker(0, since=8.0, calls=[failing]), _worker(1, since=8.0, calls=[failing])]
    assert diagnose([*both, _server(0), _server(1)]).culprit == "ps1"


def test_a_loop_blocked_on_its_own_lock_is_named_at_its_line() -> None:
    frames = [
        {"file": "/home/u/train.py", "line": 41, "function": "<module>", "code": "with held:"},
        {"file": threading.__file__, "line": 327, "function": "wait", "code": "acquire()"},
    ]
    seen = [
        _worker(0, since=9.0, phase="pull", calls=[_call(0)]),
        _worker(1, since=9.0, frames=frames),
        _server(0, pushed=[0], missing=[1], waiting=[{"worker": 0}]),
    ]
    found = diagnose(seen)
    assert found.culprit == "worker1" and "its own code" in found.cause
    assert found.frame == "/home/u/train.py:41 in <module>: with held:"


def test_a_stopped_peer_of_an_all_reduce_is_the_culprit() -> None:
    seen = [
        _worker(0, since=7.0, phase="allreduce", collective=True),
        TaskSeen(task="worker1", pid=101, process="stopped"),
    ]
    found = diagnose(seen)
    assert found.culprit == "worker1"
    assert any(w.task == "worker0" and w.on == "worker1" for w in found.waits)


def test_no_culprit_while_every_worker_steps() -> None:
    """A slow call of a worker that steps is no hang; a stall is measured against the
    worker's own stall time."""
    seen = [_worker(0, calls=[_call(0, "Push", age=3.0)]), _worker(1), _server(0)]
    found = diagnose(seen)
    assert found.culprit is None and found.stuck == ()
    assert diagnose([_worker(0, since=3.0), _server(0)], stall_s=5.0).culprit is None


# --------------------------------------------------------------------------- the probe


def test_a_probe_answers_its_stacks_and_state_and_cleans_up(tmp_path: Path) -> None:
    probe = Probe("worker7", tmp_path / "doctor")
    try:
        probe.add("worker", lambda: {"step": 3})
        probe.add("broken", lambda: 1 / 0)
        pointer = json.loads((tmp_path / "doctor" / "worker7.json").read_text())
        assert pointer["pid"] == os.getpid() and pointers(tmp_path)[0]["task"] == "worker7"
        report = ask(pointer["socket"])
        assert report["state"]["worker"] == {"step": 3}
        assert "ZeroDivisionError" in report["state"]["broken"]["error"]
        main = next(t for t in report["threads"] if t["main"])
        assert any(
            f["function"] == "test_a_probe_answers_its_stacks_and_state_and_cleans_up"
            for f in main["frames"]
        )
        assert oct((tmp_path / "doctor").stat().st_mode & 0o777) == "0o700"
    finally:
        probe.close()
    assert not Path(pointer["socket"]).exists() and not (tmp_path / "doctor/worker7.json").exists()


def test_a_probe_refuses_what_is_not_a_request(tmp_path: Path) -> None:
    probe = Probe("ps0", tmp_path)
    try:
        for request in (b"x" * (MAX_REQUEST + 10), b'{"ask": "run", "code": "1"}\n'):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(5)
                conn.connect(str(probe.path))
                conn.sendall(request)
                try:
                    answer = conn.recv(100)
                except ConnectionResetError:  # closed with the request unread
                    answer = b""
                assert answer == b""  # nothing answered
        assert ask(str(probe.path))["task"] == "ps0"  # and it answers on
    finally:
        probe.close()


def test_process_state_reads_proc() -> None:
    assert process_state(os.getpid()) in ("running", "sleeping")
    assert process_state(2**22 + 12345) == "gone"


# --------------------------------------------------------------------------- a real run


@pytest.mark.slow
def test_doctor_names_a_stopped_worker_of_a_real_run(spawn, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A sync run, worker1 stopped: ``distsgd doctor`` names it within seconds; the
    launcher's own doctor (``--doctor-after 3``) does too, in an event; every task takes its
    pointer away when the run ends."""
    run_dir = tmp_path / "run"
    args = ["demo", "--scheme", "sync", "--workers", "2", "--ps", "1", "--steps", "100000"]
    launcher = spawn([*args, "--quiet", "--run-dir", str(run_dir), "--doctor-after", "3"])
    stopped = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not _stepped(run_dir):
            time.sleep(0.2)
        stopped = next(int(p["pid"]) for p in pointers(run_dir) if p["task"] == "worker1")
        os.kill(stopped, signal.SIGSTOP)
        began = time.monotonic()
        done = run_distsgd(["doctor", str(run_dir)], timeout=60)
        assert done.returncode == 0, done.stderr
        assert "culprit: worker1: stopped" in done.stdout, done.stdout
        assert time.monotonic() - began < 10
        assert examine(run_dir, write=False).diagnosis.culprit == "worker1"
        while time.monotonic() < deadline and not _events(run_dir, "doctor"):
            time.sleep(0.2)
        event = _events(run_dir, "doctor")[0]
        assert event["culprit"] == "worker1" and Path(event["report"]).is_file()
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
    assert pointers(run_dir) == []  # every task took its pointer away


def _stepped(run_dir: Path) -> bool:
    return any(r.get("task") == "worker1" and r.get("step", 0) >= 5 for r in _lines(run_dir))


def _events(run_dir: Path, name: str) -> list[dict[str, Any]]:
    return [r for r in _lines(run_dir) if r.get("event") == name]


def _lines(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_a_run_whose_tasks_are_gone_is_not_examined(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pointers a killed run left behind: the doctor says no task runs, and reads its
    checkpoint instead (none here: a one-line error)."""
    from distsgd.cli.main import main

    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / "doctor").mkdir()
    pointer = {"task": "worker0", "pid": gone.pid, "socket": str(tmp_path / "x.sock")}
    (tmp_path / "doctor" / "worker0.json").write_text(json.dumps(pointer))
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["doctor", str(tmp_path)]) == 2  # a bad input: exit 2
    captured = capsys.readouterr()
    assert "no task of it is running" in captured.out
    assert "no checkpoints" in captured.err or "neither a run folder" in captured.err


def test_a_stopped_server_is_named_before_the_workers_count_as_stuck() -> None:
    seen = [_worker(0, since=1.0, calls=[_call(1, "Push", age=1.5)]), _server(0)]
    stopped = TaskSeen(task="ps1", pid=201, process="stopped")
    assert diagnose([*seen, stopped]).culprit == "ps1"
    assert diagnose([*seen, TaskSeen(task="ps1", pid=201, process="sleeping")]).culprit is None


def test_a_socket_folder_others_may_enter_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user's (or an open) folder where the probes' sockets go: no probe, no socket."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    folder = tmp_path / f"distsgd-doctor-{os.getuid()}"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    with pytest.raises(PermissionError, match="alone"):
        Probe("worker0", tmp_path / "doctor")
    from distsgd.util.probe import start_probe

    assert start_probe("worker0", tmp_path / "doctor") is None  # the task runs without
