"""``distsgd run --resume`` of an elastic run, as a user runs it: without --min-workers or
--max-workers it comes back with the bounds it was started with (its saved RunSpec)."""

from __future__ import annotations

from pathlib import Path

from conftest import SCRIPTS, run_distsgd

from distsgd.control.spec import RunSpec


def test_a_resumed_elastic_run_stays_elastic(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["run", "--scheme", "allreduce", "--workers", "2", "--max-workers", "3"]
    args += ["--checkpoint-every", "1", "--quiet", "--run-dir", str(run_dir)]
    args += ["--max-restarts", "0", "--inject-fault", "kill:worker:0@step=5"]  # checkpoints 1-4
    args += [str(SCRIPTS / "blobs.py"), "--steps", "10", "--slow", "0.02"]
    done = run_distsgd(args)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"distsgd run --resume {run_dir}" in done.stderr
    resumed = run_distsgd(["run", "--resume", str(run_dir), "--quiet"])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    spec = RunSpec.load(run_dir)  # saved again by the resumed launch
    assert (spec.lowest_workers, spec.workers, spec.highest_workers) == (2, 2, 3)
    assert spec.elastic
