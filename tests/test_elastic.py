"""Runs that change size while they train, scripted with ``distsgd elastic scale`` on a running
``distsgd demo``: the situations where torchrun, Horovod and torchft users report hangs and lost
progress (a scale-down that does not restart, a join below the minimum, long quorum waits)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from conftest import alive, metrics, run_distsgd, task_pids, wait_for

STEP_TIMEOUT = 90.0
"""Seconds any one stage of a scripted run may take before the test calls it a hang."""


def _progress(run_dir: Path) -> int:
    """The largest step any worker has logged."""
    return max((int(r.get("step", 0)) for r in metrics(run_dir) if "loss" in r), default=0)


def _events(run_dir: Path, name: str) -> list[dict]:
    return [r for r in metrics(run_dir) if r.get("event") == name]


def _scale(run_dir: Path, workers: int) -> None:
    done = run_distsgd(
        ["elastic", "scale", str(run_dir), "--workers", str(workers)], timeout=STEP_TIMEOUT
    )
    assert done.returncode == 0, done.stderr
    assert f"-> {workers} workers" in done.stdout, done.stdout


def _finish(launcher: psutil.Popen) -> str:
    try:
        out, _ = launcher.communicate(timeout=STEP_TIMEOUT * 2)
    except subprocess.TimeoutExpired:
        raise AssertionError("the run hung after its last change of size") from None
    assert launcher.returncode == 0, out[-4000:]
    return out


def _accuracy(out: str) -> float:
    last = out.strip().splitlines()[-1]
    assert last.startswith("test accuracy: "), last
    return float(last.split(":")[1])


def _checkpoint_at(run_dir: Path, workers: int) -> bool:
    """Whether a complete checkpoint saved by ``workers`` workers exists."""
    for manifest in (run_dir / "checkpoints").glob("ckpt-*/MANIFEST.json"):
        with contextlib.suppress(OSError, ValueError):
            if len(json.loads(manifest.read_text())["workers"]) == workers:
                return True
    return False


def test_collective_run_survives_2_4_1_3_by_restarts_from_its_checkpoints(
    spawn, tmp_path: Path
) -> None:
    """allreduce under the same sequence, by the documented route: each change a whole restart
    from the newest checkpoint (saved at the size before), every worker continuing from worker
    0's state; each change waits for a checkpoint at the size before it, so every stage
    trains. It finishes at 3 workers and reaches the demo's accuracy in 20 epochs (the demo's
    30 before, and 60 before that: each stage waits for one checkpoint, 20 steps after its
    start, and the run trains most of its epochs after the last change; paced by 30 ms, not 20,
    the run lasts as long as before)."""
    run_dir = tmp_path / "run"
    launcher = spawn(
        [
            *("demo", "--scheme", "allreduce", "--workers", "2", "--min-workers", "1"),
            *("--max-workers", "4", "--checkpoint-every", "20", "--epochs", "20", "--quiet"),
            # Paced: all-reduce waits for worker 0 at every step, so every stage lasts past
            # its first checkpoint (unpaced, 4 workers once finished the run's steps before
            # the launcher had their checkpoint to scale from).
            f"--inject-fault=delay:worker:0={COLLECTIVE_PACE}",
            *("--run-dir", str(run_dir)),
        ]
    )
    for before, after in ((2, 4), (4, 1), (1, 3)):
        assert wait_for(lambda n=before: _checkpoint_at(run_dir, n), STEP_TIMEOUT, POLL), before
        _scale(run_dir, after)
    out = _finish(launcher)
    assert _accuracy(out) >= 0.95
    restarts = [r for r in _events(run_dir, "fault") if r.get("action") == "restart_all"]
    assert len(restarts) == 3 and all(r["resumed_from"].startswith("ckpt-") for r in restarts)
    assert [r["workers"] for r in _events(run_dir, "scale")] == [4, 1, 3]
    assert {"worker0", "worker1", "worker2"} == set(task_pids(run_dir))
    assert alive(list(task_pids(run_dir).values())) == []


def test_scale_refuses_a_number_outside_the_bounds_of_a_running_run(spawn, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = spawn(
        [
            *("demo", "--scheme", "allreduce", "--workers", "2", "--max-workers", "3"),
            *("--epochs", "20", "--quiet", "--run-dir", str(run_dir)),
        ]
    )
    assert wait_for(lambda: (run_dir / "launcher.pid").exists(), STEP_TIMEOUT)
    done = run_distsgd(["elastic", "scale", str(run_dir), "--workers", "4"], timeout=30)
    assert done.returncode == 2 and "ask for a number in 2..3" in done.stderr, done.stderr
    assert not (run_dir / "scale.json").exists()
    launcher.send_signal(signal.SIGINT)  # the run stops (no need to wait for its end)
    launcher.communicate(timeout=STEP_TIMEOUT)
    assert launcher.returncode == 130
    assert not (run_dir / "launcher.pid").exists()
    done = run_distsgd(["elastic", "scale", str(run_dir), "--workers", "3"], timeout=30)
    assert done.returncode == 2 and "no launcher is running" in done.stderr, done.stderr


def _members_seen(run_dir: Path, count: int) -> bool:
    return any(len(r.get("members", [])) == count for r in _events(run_dir, "membership"))


EPOCHS = "20"
PACE = "60ms"
"""Every step of every worker (those that join later too) sleeps this long: a scripted run
must last while its changes of size happen, and sleeping costs no CPU, where the 100 epochs
these runs used to train for the same purpose cost a minute of it each (and 40 epochs paced by
50 ms, the same length, cost twice the CPU of these 20: measured 0.98 at 20 epochs, 0.975 at
40, for a fixed run of 3 hogwild workers). The changes take about 3 s from the first step on
an idle machine (scale to 4 at 1.5 s, the last at 2.5 s, in a sync run); paced by 60 ms a run
lasts about 20 s, so a loaded machine has several times that (100 ms until the run's end no
longer waited 5 s on a checkpoint a scale-down left incomplete)."""
COLLECTIVE_PACE = "30ms"
"""The all-reduce run's pace: worker 0's steps 30 ms longer, and so every worker's."""
SHORT_EPOCHS = "15"
SHORT_PACE = "80ms"
"""The runs of this module but the sync one (EPOCHS, PACE): 15 epochs paced by 80 ms
last as long as 20 paced by 60 ms and train a quarter fewer steps. Fixed runs of 3 hogwild
workers measured 0.947 to 0.972 at 12 epochs (too near the 0.95 bar), 0.967 to 0.981 at 20."""
POLL = 0.5
"""Seconds between two looks at a run's folder while a stage waits (each look reads and parses
all of metrics.jsonl; every 0.1 s made 5 times the reads for nothing: the stages take
seconds)."""


def _demo(scheme: str, run_dir: Path, *flags: str, paced: bool = True) -> list[str]:
    """A demo run of EPOCHS epochs; ``paced``: each worker it may have (up to --max-workers,
    else --workers) delayed by PACE."""
    counts = [int(flags[i + 1]) for i, f in enumerate(flags) if f in ("--workers", "--max-workers")]
    pace = [f"--inject-fault=delay:worker:{i}={PACE}" for i in range(max(counts, default=1))]
    return [
        *("demo", "--scheme", scheme, "--epochs", EPOCHS, "--quiet", "--run-dir", str(run_dir)),
        *(pace if paced else []),
        *flags,
    ]


def _short_demo(scheme: str, run_dir: Path, *flags: str, paced: bool = True) -> list[str]:
    """:func:`_demo` of SHORT_EPOCHS epochs paced by SHORT_PACE."""
    counts = [int(flags[i + 1]) for i, f in enumerate(flags) if f in ("--workers", "--max-workers")]
    pace = [f"--inject-fault=delay:worker:{i}={SHORT_PACE}" for i in range(max(counts, default=1))]
    return [
        *("demo", "--scheme", scheme, "--epochs", SHORT_EPOCHS, "--quiet"),
        *("--run-dir", str(run_dir), *(pace if paced else []), *flags),
    ]


# EASGD under changing membership: tests/test_work_units.py (test_elastic_sync_and_easgd_...)
@pytest.mark.parametrize("scheme", ["hogwild", "sync"])
def test_run_grows_and_shrinks_2_4_1_3_without_losing_a_sample(
    spawn, tmp_path: Path, scheme: str
) -> None:
    """The issue's sequence, scripted with distsgd elastic scale on a running demo: every change
    waits for the one before to have happened (the new workers in the servers' membership, the
    leaving ones gone), so a hang fails the stage's timeout; the run then reaches 0.95 and
    trained every unit of every epoch once, and (hogwild) matches a fixed run of 3 workers
    within 0.02. Hogwild trains SHORT_EPOCHS; sync EPOCHS (at 15 it ended at 0.939 and 0.961,
    too near the bar)."""
    run_dir = tmp_path / "elastic"
    elastic_flags = ("--workers", "2", "--min-workers", "1", "--max-workers", "4")
    # hogwild: the two fixed runs of 3 workers to compare with (their own spread shows on a busy
    # machine) run beside the elastic one, which mostly sleeps (PACE), not after it
    with ThreadPoolExecutor(max_workers=2) as pool:
        fixed_runs = [
            pool.submit(run_distsgd, _fixed(scheme, tmp_path / f"fixed{i}"), timeout=240)
            for i in range(2 if scheme == "hogwild" else 0)  # two more runs: hogwild alone
        ]
        demo, epochs = (_short_demo, SHORT_EPOCHS) if scheme == "hogwild" else (_demo, EPOCHS)
        launcher = spawn(demo(scheme, run_dir, *elastic_flags, "--world-size", "dynamic"))
        assert wait_for(
            lambda: _members_seen(run_dir, 2) and _progress(run_dir) > 0, STEP_TIMEOUT, POLL
        )
        _scale(run_dir, 4)
        assert wait_for(lambda: _members_seen(run_dir, 4), STEP_TIMEOUT, POLL), "no 4 members"
        _scale(run_dir, 1)
        assert wait_for(lambda: len(_events(run_dir, "worker_left")) == 3, STEP_TIMEOUT, POLL)
        _scale(run_dir, 3)
        assert wait_for(lambda: len(_events(run_dir, "membership")) > 0, STEP_TIMEOUT, POLL)
        out = _finish(launcher)
    elastic = _accuracy(out)
    assert [r["workers"] for r in _events(run_dir, "scale")] == [4, 1, 3]
    work = json.loads((run_dir / "result.json").read_text())["work"]
    assert work["finished"] and work["units_done"] == work["total_units"]
    assert work["trained_twice"] == 0 and work["never_trained"] == 0, work
    units = int(epochs) * work["units_per_epoch"]
    assert work["trained_once"] == work["total_units"] == units, work
    assert alive(list(task_pids(run_dir).values())) == []
    assert elastic >= 0.95, elastic
    if scheme != "hogwild":  # the comparison with fixed runs once: it costs two more runs
        return
    references = []
    for run in fixed_runs:
        fixed = run.result()
        assert fixed.returncode == 0, fixed.stderr[-3000:]
        references.append(_accuracy(fixed.stdout))
    assert elastic >= 0.95, (elastic, references)
    assert min(abs(elastic - r) for r in references) <= 0.02, (elastic, references)


def _fixed(scheme: str, run_dir: Path) -> list[str]:
    """A demo run of 3 workers all along, unpaced."""
    return _short_demo(scheme, run_dir, "--workers", "3", paced=False)


def test_a_worker_out_of_restarts_is_dropped_while_min_workers_remain(tmp_path: Path) -> None:
    """Killed with no restarts left, worker2 is dropped (not waited for, as Horovod waits below
    min_np): the launcher tells the servers it left, its held units go back at once, and the
    run finishes with 2 workers, every unit trained once."""
    run_dir = tmp_path / "run"
    done = run_distsgd(
        [
            *_short_demo("hogwild", run_dir, "--workers", "3", "--min-workers", "2", paced=False),
            *("--max-workers", "3", "--world-size", "dynamic", "--max-restarts", "0"),
            *("--inject-fault", "kill:worker:2@step=300"),
        ],
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _accuracy(done.stdout) >= 0.95
    drops = [r for r in _events(run_dir, "fault") if r.get("action") == "drop"]
    assert [(r["target"], r["workers"]) for r in drops] == [("worker2", 2)]
    work = json.loads((run_dir / "result.json").read_text())["work"]
    assert work["trained_twice"] == 0 and work["never_trained"] == 0, work
    assert alive(list(task_pids(run_dir).values())) == []


def test_join_adds_a_worker_in_its_own_process(spawn, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = spawn(
        _short_demo(
            "hogwild", run_dir, "--workers", "2", "--max-workers", "3", "--world-size", "dynamic"
        )
    )
    assert wait_for(
        lambda: _members_seen(run_dir, 2) and _progress(run_dir) > 0, STEP_TIMEOUT, POLL
    )
    joiner = spawn(["elastic", "join", str(run_dir)])
    joined = wait_for(lambda: _members_seen(run_dir, 3), STEP_TIMEOUT, POLL)
    assert joined, "the joiner never joined"
    out = _finish(launcher)
    assert _accuracy(out) >= 0.95
    joined, _ = joiner.communicate(timeout=STEP_TIMEOUT)
    assert joiner.returncode == 0, joined[-3000:]
    assert "joining" in joined and "as worker2" in joined
    trained = [r for r in _events(run_dir, "finished_steps") if r.get("task") == "worker2"]
    assert trained and trained[0]["local_step"] > 0
    work = json.loads((run_dir / "result.json").read_text())["work"]
    assert work["trained_twice"] == 0 and work["never_trained"] == 0, work
