"""Training survives SIGKILLed workers and parameter servers, and resumes after a crash.

Every scheme: the demo's training (its seed, model, data and config, 4 workers), written as a
loop of the user's own (tests/scripts/own_loop.py, ``distsgd.Worker``), with worker 1 and ps 0
SIGKILLed mid-run (collective schemes have no ps: worker 1 only). So every scheme trains a plain
PyTorch loop on 4 workers, with its faults. The run must finish, log each fault and its restart,
write its run folder as documented, and reach :data:`BAR`. Measured undisturbed at the demo's 30
epochs (``distsgd demo --workers 4``, one run each; a run of this test once also made an
undisturbed run per scheme, dropped to keep CI short): 0.9667 to 0.9833. A fault that lost the
servers' or a worker's state costs far more: it ends near chance or below 0.9.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SCRIPTS, final_accuracy, metrics, run_distsgd

from distsgd import schemes
from distsgd.control.outcome import EXIT_DIVERGED

pytestmark = pytest.mark.slow

FOUR_WORKERS: dict[str, list[str]] = {}
"""Run options for 4 workers: none. Hogwild and EAMSGD once needed ``--lr 0.15`` here (at the
demo's lr 0.3 each fell below 0.95 in 1 of 3 runs with 4 workers, Hogwild to chance); their
default ``--lr-rule inverse-sqrt`` now applies 0.3 / sqrt(4) = 0.15 by itself
(docs/schemes/defaults.md)."""

GLOBAL_STEPS = {
    "hogwild": 1320,
    "dynsgd": 1320,
    "downpour": 264,
    "sagn": 83,
    "asyncdiloco": 132,
}
"""The demo's global steps on 4 workers (330 local steps each: 30 epochs of 1,437 samples in
batches of 32 per worker), as its undisturbed runs counted them (docs/schemes/results/): every
worker's update under hogwild and dynsgd, a push of 5 steps under downpour, one of 10 under
asyncdiloco, one of all workers' sums under sagn, and about one per local step for the others.
The kills land at 30% and 60%."""

EPOCHS = 20
"""The runs here train 20 epochs, not the demo's 30 (a third less CPU: the suite's 12 minutes),
the kills at the same fractions of the run."""

BAR = 0.94
"""The accuracy a run with its kills must reach: 0.95 (an undisturbed demo run's bar) until a
CI run of dynsgd scored 0.9472 (2026-12-07; six runs of it beside each other just after:
0.9806 to 0.9861; earlier 0.9583 to 0.9833 over the schemes). 0.94 still tells a run that
lost state (near chance, or below 0.9) from one that did not."""


@pytest.mark.xdist_group("demo-runs")  # one xdist worker runs these in turn: 5 processes each
@pytest.mark.parametrize("scheme", schemes.names())
def test_a_plain_loop_keeps_its_accuracy_on_4_workers_with_a_worker_and_a_ps_killed(
    scheme: str, tmp_path: Path
) -> None:
    flags = ["--scheme", scheme, "--workers", "4", "--quiet", *FOUR_WORKERS.get(scheme, [])]
    flags += ["--epochs", str(EPOCHS)]
    total = GLOBAL_STEPS.get(scheme, 330) * EPOCHS // 30
    kills = ["--inject-fault", f"kill:worker:1@step={int(0.3 * total)}"]
    uses_ps = schemes.get(scheme).uses_parameter_servers
    if uses_ps:
        kills += ["--inject-fault", f"kill:ps:0@step={int(0.6 * total)}"]
    run_dir = tmp_path / "hit"
    hit = final_accuracy(
        run_distsgd(
            [
                "run",
                *flags,
                "--checkpoint-every",
                "20",
                "--max-restarts",
                "3",
                *kills,
                "--run-dir",
                str(run_dir),
                str(SCRIPTS / "own_loop.py"),  # the demo's training in a loop of its own
            ]
        )
    )
    records = metrics(run_dir)
    events = [r for r in records if r.get("task") == "launcher"]
    injected = {e["target"] for e in events if e.get("event") == "fault_injected"}
    restarted = {
        e["target"]
        for e in events
        if e.get("event") == "fault" and e["action"].startswith("restart")
    }
    expected = {"worker1", "ps0"} if uses_ps else {"worker1"}
    assert injected == expected and restarted == expected, events
    print(f"{scheme}: with kills {hit:.4f}")
    assert hit >= BAR, f"{scheme}: with kills {hit:.4f}"
    # The run folder as documented: metrics.jsonl's final line, result.json, the model.
    final = [r for r in records if r.get("final")]
    assert final and abs(final[0]["accuracy"] - hit) < 1e-4
    assert all({"time", "task"} <= set(r) for r in records)
    assert all("step" in r for r in records if "loss" in r)
    assert (run_dir / "final_model.pt").exists()
    result = json.loads((run_dir / "result.json").read_text())
    assert result["scheme"] == scheme and result["test_accuracy"] == pytest.approx(hit, abs=1e-4)
    # the kills came mid-run: the run's length is the one they were timed for
    assert 0.9 * total <= result["global_step"] <= 1.2 * total, (result["global_step"], total)


def test_kill_during_checkpoint_writes_then_resume(tmp_path: Path) -> None:
    """Checkpoints are written every step, so the kill lands while files are being written;
    with no restarts allowed the run stops, says how to resume, and --resume finishes it (40
    steps, the kill at 20: 80 and 40 before wrote twice the checkpoints for the same claim)."""
    run_dir = tmp_path / "run"
    args = [
        "run",
        "--scheme",
        "sync",
        "--checkpoint-every",
        "1",
        "--quiet",
        "--run-dir",
        str(run_dir),
    ]
    args += ["--max-restarts", "0", "--inject-fault", "kill:worker:0@step=20"]
    args += [str(SCRIPTS / "blobs.py"), "--steps", "40", "--slow", "0.02"]
    done = run_distsgd(args)
    assert done.returncode == 1
    assert "task worker0 failed" in done.stderr and f"distsgd run --resume {run_dir}" in done.stderr
    resumed = run_distsgd(["run", "--resume", str(run_dir), "--quiet"])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert resumed.stdout.strip().splitlines()[-1].startswith("test accuracy: ")
    result = json.loads((run_dir / "result.json").read_text())
    assert result["local_steps"] == 40
    resumes = [r for r in metrics(run_dir) if r.get("event") == "resumed"]
    assert {r["task"] for r in resumes} == {"worker0", "worker1"}
    assert all(10 <= r["local_step"] < 40 for r in resumes), resumes
    inspected = run_distsgd(["doctor", str(run_dir)])
    assert inspected.returncode == 0 and "MANIFEST.json verified" in inspected.stdout


def test_resume_names_a_damaged_checkpoint_and_uses_the_previous(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        "run",
        "--scheme",
        "hogwild",
        "--checkpoint-every",
        "10",
        "--quiet",
        "--run-dir",
        str(run_dir),
    ]
    done = run_distsgd([*args, str(SCRIPTS / "blobs.py"), "--steps", "40"])
    assert done.returncode == 0
    folders = sorted((run_dir / "checkpoints").glob("ckpt-*"))
    newest = folders[-1]
    shard = newest / "ps0.npz"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    finished = run_distsgd(["run", "--resume", str(run_dir)])
    assert finished.returncode == 2 and "already finished" in finished.stderr, finished.stderr
    (run_dir / "result.json").unlink()  # as a run stopped before its end: one to resume
    resumed = run_distsgd(["run", "--resume", str(run_dir)])
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"{shard}: damaged" in resumed.stdout
    assert f"using the previous complete checkpoint {folders[-2].name}" in resumed.stdout


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_nonfinite_gradient_policy(policy: str, tmp_path: Path) -> None:
    """Worker 1 computes a NaN gradient (with a finite loss) at its step 10."""
    run_dir = tmp_path / policy
    args = [
        "run",
        "--scheme",
        "hogwild",
        "--quiet",
        "--nonfinite",
        policy,
        "--run-dir",
        str(run_dir),
    ]
    done = run_distsgd([*args, str(SCRIPTS / "blobs.py"), "--steps", "30", "--poison-step", "10"])
    if policy == "stop":  # a divergence: the run stops at once, no restart
        assert done.returncode == EXIT_DIVERGED, done.stdout[-2000:] + done.stderr[-2000:]
        assert "the run diverged" in done.stderr and "NaN or Inf in z#0" in done.stderr
        assert not [r for r in metrics(run_dir) if r.get("action") == "restart"]
        return
    assert done.returncode == 0, done.stdout[-2000:]
    last = {r["task"]: r for r in metrics(run_dir) if "nonfinite_skipped" in r}
    assert sorted(r["nonfinite_skipped"] for r in last.values()) == [1, 1]  # each worker once
    assert json.loads((run_dir / "result.json").read_text())["test_accuracy"] > 0.9


# A server killed before any checkpoint comes back from its write-ahead log, and a worker
# killed goes on where it died, with no flags: tests/test_safe_defaults.py (one run for both).
