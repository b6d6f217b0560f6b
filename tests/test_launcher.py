"""The launcher stops every process it started: after a normal end, a killed task, SIGINT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import loadclock
import psutil
import pytest
from conftest import SCRIPTS, alive, metrics, run_distsgd, task_pids, wait_for

from distsgd.launcher.lifeline import PARENT_ENV

pytestmark = [pytest.mark.slow, pytest.mark.own_fork_server]  # they judge the launcher's tree
BLOBS = str(SCRIPTS / "blobs.py")


def _descendants(proc: psutil.Process) -> list[int]:
    try:
        return [c.pid for c in proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def test_normal_end_leaves_no_process(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = run_distsgd(
        [
            "run",
            "--workers",
            "2",
            "--scheme",
            "hogwild",
            "--run-dir",
            str(run_dir),
            BLOBS,
            "--steps",
            "20",
        ]
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("test accuracy: ")
    pids = task_pids(run_dir)
    assert set(pids) == {"ps0", "worker0", "worker1"}
    assert alive(list(pids.values())) == []
    # Every task line is relayed with its role.
    assert "[worker1]" in done.stdout and "[ps0]" in done.stdout


def _start_slow_run(spawn, run_dir: Path, scheme: str = "sync", *flags: str):  # type: ignore[no-untyped-def]
    proc = spawn(
        [
            "run",
            "--workers",
            "2",
            "--scheme",
            scheme,
            "--run-dir",
            str(run_dir),
            *flags,
            BLOBS,
            "--steps",
            "2000",
            "--slow",
            "0.02",
        ]
    )
    assert wait_for(
        lambda: (run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= 2, 90
    ), "no progress"
    tree = _descendants(proc)
    pids = task_pids(run_dir)
    assert set(pids.values()) <= set(tree)
    return proc, tree, pids


def test_killed_worker_stops_the_run_and_every_process(spawn, tmp_path: Path) -> None:
    """With restarts turned off (they are on by default), a dead task ends the run."""
    run_dir = tmp_path / "run"
    proc, tree, pids = _start_slow_run(spawn, run_dir, "sync", "--max-restarts", "0")
    os.kill(pids["worker1"], signal.SIGKILL)
    out, _ = loadclock.communicate(proc, 60)
    assert proc.returncode == 1, out
    last = out.strip().splitlines()
    assert any("task worker1 failed" in line for line in last), out[-2000:]
    assert alive(tree) == []


def test_sigint_stops_every_process_and_after_a_checkpoint_says_how_to_resume(
    spawn, tmp_path: Path
) -> None:
    """Ctrl-C (once a checkpoint exists) stops every process of the run with exit code 130
    and says "interrupted"; the launcher names the command that continues the run, and keeps
    what it said (not the tasks' lines) in the run folder's launcher.log. (One run for both
    claims: a Ctrl-C before the first checkpoint stops the tasks the same way.)"""
    run_dir = tmp_path / "run"
    proc, tree, _ = _start_slow_run(spawn, run_dir, "allreduce", "--checkpoint-every", "5")
    checkpoints = run_dir / "checkpoints"
    assert wait_for(lambda: any(checkpoints.glob("ckpt-*/MANIFEST.json")), 90), "no checkpoint"
    proc.send_signal(signal.SIGINT)
    out, _ = loadclock.communicate(proc, 60)
    assert proc.returncode == 130, out[-2000:]
    assert "interrupted" in out
    assert f"continue it with: distsgd run --resume {run_dir}" in out
    kept = (run_dir / "launcher.log").read_text()
    assert f"[distsgd] run {run_dir}: scheme allreduce" in kept
    assert "interrupted" in kept and "--resume" in kept
    assert "[worker0]" not in kept  # the tasks' own lines are in logs/
    assert alive(tree) == []


def test_a_second_ctrl_c_stops_at_once_and_says_the_periodic_checkpoint_stands(
    spawn, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The first Ctrl-C of a parameter-server run asks the workers to stop and save; the chief
    waits for worker1 (held with SIGSTOP here), and a second Ctrl-C stops at once, in one line
    that says no new checkpoint was saved."""
    run_dir = tmp_path / "run"
    proc, tree, pids = _start_slow_run(spawn, run_dir, "hogwild")
    os.kill(pids["worker1"], signal.SIGSTOP)  # the launcher's SIGKILL ends it all the same
    proc.send_signal(signal.SIGINT)
    said = run_dir / "launcher.log"
    assert wait_for(lambda: "distsgd: stopping" in said.read_text(), 30), said.read_text()
    proc.send_signal(signal.SIGINT)
    out, _ = loadclock.communicate(proc, 60)
    assert proc.returncode == 130, out[-2000:]
    assert "stopped at once; the last periodic checkpoint stands (" in out, out[-2000:]
    assert "saved at step" not in out
    assert wait_for(lambda: alive(tree) == [], 15), f"left behind: {alive(tree)}"


def test_sigkill_of_launcher_takes_tasks_down(spawn, tmp_path: Path) -> None:
    """Even a launcher killed with SIGKILL (no chance to clean up) leaves no task behind."""
    run_dir = tmp_path / "run"
    proc, tree, _ = _start_slow_run(spawn, run_dir, scheme="hogwild")
    proc.kill()
    proc.wait(timeout=10)
    assert wait_for(lambda: alive(tree) == [], 15), f"left behind: {alive(tree)}"


def test_the_reaper_removes_the_scratch_folder_of_a_group_that_ended_with_its_launcher(
    tmp_path: Path,
) -> None:
    """The Ray instance's processes may all end by themselves once the launcher is killed,
    before the reaper's next look: the scratch folder must go all the same (it was left in
    /tmp once)."""
    group = subprocess.Popen(["sleep", "0"], start_new_session=True)
    group.wait()  # the group is gone before the reaper starts
    launcher = subprocess.Popen(["sleep", "0"])
    launcher.wait()  # so is the launcher (its pid is no longer the reaper's parent)
    scratch = tmp_path / "dray-test"
    (scratch / "session").mkdir(parents=True)
    (scratch / "session" / "log").write_text("x")
    reaper = loadclock.run(
        [sys.executable, "-m", "distsgd.launcher.reaper", str(group.pid), str(scratch)],
        env={**os.environ, PARENT_ENV: str(launcher.pid)},
        timeout=60,
    )
    assert reaper.returncode == 0 and not scratch.exists()


def test_a_signal_handler_sets_its_event_even_while_the_main_thread_holds_its_lock() -> None:
    """The handler may run while the main thread is inside ``event.wait()`` holding the
    event's lock (a plain ``event.set()`` there deadlocked a reaper): it returns at once and
    the event is set once the lock is free."""
    import threading

    from distsgd.util.signals import setter

    event = threading.Event()
    handle = setter(event)
    with event._cond:  # type: ignore[attr-defined]  # as inside wait()
        handle(signal.SIGTERM, None)  # a plain event.set() would block here forever
        assert not event.is_set()
    assert event.wait(5)
