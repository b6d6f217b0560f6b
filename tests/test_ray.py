"""``distsgd run --ray``: the same cluster with each task started by a Ray actor, on a local Ray
instance of the launcher's own (127.0.0.1 only, a token of its own), with restarts, injected
faults and cleanup as under the local launcher."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import alive, metrics, run_distsgd, task_pids, wait_for

pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


def _scratch(run_dir: Path) -> Path:
    """The folder of the local Ray instance that this run started (the first line of its
    ``ray start`` log names it): what a test judges, not other runs' folders."""
    first = (run_dir / "logs" / "ray-start.log").read_text().splitlines()[0]
    scratch = Path(first.rsplit(" in ", 1)[1])
    assert scratch.parent == Path("/tmp") and scratch.name.startswith("dray-"), first
    return scratch


def _ray_processes(scratch: Path) -> list[psutil.Process]:
    """Running processes of the Ray instance in ``scratch`` (its --temp-dir), and its reaper."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(proc.info["cmdline"] or [])
        except psutil.Error:
            continue
        if f"{scratch}/" in cmdline or cmdline.endswith(str(scratch)):
            found.append(proc)
    return found


def _assert_nothing_left(run_dir: Path) -> None:
    scratch = _scratch(run_dir)
    assert wait_for(lambda: not alive(list(task_pids(run_dir).values())), 10)
    assert wait_for(lambda: not _ray_processes(scratch), 15), [
        p.info for p in _ray_processes(scratch)
    ]
    assert not scratch.exists()


PACE = "60ms"
"""Each worker's step sleeps this long (no CPU): the run lasts while its size changes."""


def _events(run_dir: Path, *names: str) -> list[dict]:
    return [r for r in metrics(run_dir) if r.get("event") in names]


def _members_seen(run_dir: Path, count: int) -> bool:
    return any(len(r.get("members", [])) == count for r in _events(run_dir, "membership"))


def _scale(run_dir: Path, workers: int) -> None:
    done = run_distsgd(["elastic", "scale", str(run_dir), "--workers", str(workers)], timeout=90)
    assert done.returncode == 0, done.stderr
    assert f"-> {workers} workers" in done.stdout, done.stdout


def test_a_run_on_ray_survives_a_killed_worker_grows_shrinks_and_leaves_nothing(
    spawn, tmp_path: Path
) -> None:
    """One local Ray instance (each costs about 50 CPU-seconds of the suite's 12 minutes) for
    what issue 10 and the elastic issue ask of ``--ray``, with two parameter servers as Ray
    actors: a worker SIGKILLed mid-run is restarted as an actor; ``distsgd elastic scale``
    grows the run into the reserved bundles (up to --max-workers) and shrinks it, the worker
    asked to leave handing its work back; the run reaches 0.95 with every sample trained once;
    the actors' output is in the run folder; nothing is left afterwards. (All-reduce's
    rendezvous between Ray actors: test_a_killed_launcher_leaves_no_ray_process_behind.)"""
    run_dir = tmp_path / "run"
    pace = [f"--inject-fault=delay:worker:{i}={PACE}" for i in range(3)]
    args = ["demo", "--ray", "--scheme", "hogwild", "--epochs", "20", "--quiet"]
    args += ["--workers", "2", "--max-workers", "3", "--ps", "2", "--world-size", "dynamic"]
    args += ["--inject-fault", "kill:worker:1@step=60", *pace, "--run-dir", str(run_dir)]
    launcher = spawn(args)
    assert wait_for(lambda: _events(run_dir, "fault"), 120), metrics(run_dir)[-5:]
    assert wait_for(lambda: _members_seen(run_dir, 2), 90)
    _scale(run_dir, 3)
    assert wait_for(lambda: _members_seen(run_dir, 3), 90)
    _scale(run_dir, 2)
    assert wait_for(lambda: len(_events(run_dir, "worker_left")) == 1, 90)
    try:
        out, _ = launcher.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        raise AssertionError("the run hung after its last change of size") from None
    assert launcher.returncode == 0, out[-4000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("test accuracy: ") and float(last.split(":")[1]) >= 0.95, last
    assert "tasks as Ray actors on a local Ray instance (127.0.0.1)" in out
    faults = _events(run_dir, "fault_injected", "fault")
    assert [(e["event"], e["target"]) for e in faults][:2] == [
        ("fault_injected", "worker1"),
        ("fault", "worker1"),
    ], faults
    assert faults[1]["action"] in ("restart", "restart_all"), faults
    result = json.loads((run_dir / "result.json").read_text())
    assert result["scheme"] == "hogwild"
    assert result["work"]["trained_twice"] == 0 and result["work"]["never_trained"] == 0, result
    assert {"ps0", "ps1"} <= set(task_pids(run_dir)), task_pids(run_dir)
    assert (run_dir / "logs" / "worker1.log").read_text()  # the actors' output
    _assert_nothing_left(run_dir)


def test_a_killed_launcher_leaves_no_ray_process_behind(tmp_path: Path, spawn) -> None:
    """SIGKILL reaches the launcher alone: its tasks follow their actors, and the reaper ends
    the local Ray instance's whole process group (Ray's agents outlive a killed driver). The
    run is all-reduce's: its workers, Ray actors, meet by torch.distributed's rendezvous and
    train (a step is logged) before the kill."""
    run_dir = tmp_path / "run"
    args = ["demo", "--ray", "--workers", "2", "--scheme", "allreduce", "--epochs", "1000"]
    launcher = spawn([*args, "--quiet", "--run-dir", str(run_dir)])
    assert wait_for(lambda: any(r.get("event") is None for r in metrics(run_dir)), 90)
    scratch = _scratch(run_dir)
    assert _ray_processes(scratch)
    _assert_private(scratch)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(timeout=10)
    assert wait_for(lambda: not _ray_processes(scratch), 20), [
        p.info for p in _ray_processes(scratch)
    ]
    assert not scratch.exists()


def _assert_private(scratch: Path) -> None:
    """While the instance is up, its folder is this user's alone (Ray makes its own temporary
    folder 0777 without the sticky bit): another user cannot reach, delete or replace the
    instance's address file or its token."""
    assert stat.S_IMODE(scratch.stat().st_mode) == 0o700
    assert stat.S_IMODE((scratch / "auth_token").stat().st_mode) == 0o600
    current = scratch / "r" / "ray_current_cluster"
    assert current.read_text().strip()
    if os.geteuid() != 0:
        return
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child, as another user (nobody)
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            for attempt in (lambda: current.unlink(), lambda: (scratch / "auth_token").unlink()):
                with contextlib.suppress(PermissionError):
                    attempt()
                    os._exit(3)  # it could
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "another user could change the Ray folder"
    assert current.read_text().strip()


def test_ray_missing_is_one_line_naming_the_extra(tmp_path: Path) -> None:
    """As when Ray is not installed: None in sys.modules makes ``find_spec`` find nothing and
    ``import ray`` fail, so no local Ray instance is started."""
    argv = ["demo", "--ray", "--run-dir", str(tmp_path / "run")]
    code = (
        "import sys; sys.modules['ray'] = None; "
        f"from distsgd.cli.main import main; sys.exit(main({argv!r}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2
    assert err == [err[-1]] and err[-1].startswith("distsgd: error: --ray needs Ray: pip install")
