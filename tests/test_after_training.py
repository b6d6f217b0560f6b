"""A script that fails after its training finished (after ``distsgd.train`` returned): the
error is the script's own, so the task is not restarted, the run fails in one line naming the
script's line, and the chief's ``result.json`` keeps the run's verdict (issue 36, item 1)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import metrics, run_distsgd
from test_recovery import CKPT, Store
from torch import nn

from distsgd import api
from distsgd.cluster import TaskId
from distsgd.control.config import LrScaling, TrainConfig
from distsgd.control.errors import AFTER_TRAINING_EXIT_CODE, SetupErrorRecord
from distsgd.control.folder import RESULT_FILE, LocalFiles
from distsgd.control.metrics import MetricsWriter
from distsgd.control.recovery import (
    Finished,
    Restart,
    RestartBudget,
    RunTopology,
    TaskFailure,
    failure_kind,
    first_cause,
    plan_restart,
)
from distsgd.control.task import ENV_VAR, TaskEnv
from distsgd.launcher.bootstrap import run_script
from distsgd.runtime.chief import Chief, save_result
from distsgd.runtime.result import TrainResult, recorded_result

SCRIPTS = Path(__file__).parent / "scripts"
WORKER0 = TaskId(job="worker", index=0)
PS_RUN = RunTopology(collective=False, workers=2, min_workers=2)
BUDGET = RestartBudget(used=0, max_restarts=3)


# -- the decision -----------------------------------------------------------------------------
def test_a_script_error_after_training_is_its_own_kind() -> None:
    assert failure_kind(AFTER_TRAINING_EXIT_CODE) == "after_training"
    # a crash beside it is the more telling cause (training itself failed)
    assert first_cause({"worker0": AFTER_TRAINING_EXIT_CODE, "worker1": 1}) == "worker1"


def test_a_worker_that_failed_after_training_is_not_restarted() -> None:
    failure = TaskFailure(
        task=WORKER0, exit_code=AFTER_TRAINING_EXIT_CODE, kind="after_training", reached=20
    )
    plan = plan_restart(failure, PS_RUN, Store(checkpoint=CKPT), BUDGET)
    assert plan == Finished(task=WORKER0, after_training=True)


@pytest.mark.parametrize("task", ["worker0", "worker1", "ps0"])
@pytest.mark.parametrize("code", [1, -9])
def test_nothing_is_restarted_once_the_result_is_recorded(task: str, code: int) -> None:
    failure = TaskFailure(task=TaskId.parse(task), exit_code=code, kind=failure_kind(code))
    recorded = RunTopology(collective=False, workers=2, min_workers=2, result_recorded=True)
    plan = plan_restart(failure, recorded, Store(), BUDGET)
    assert plan == Finished(task=TaskId.parse(task), after_training=False)
    # before the record, the same failure is restarted
    assert isinstance(plan_restart(failure, PS_RUN, Store(wal={0}), BUDGET), Restart)


def test_the_record_says_it_was_after_training(tmp_path: Path) -> None:
    record = SetupErrorRecord(task=WORKER0, message="x.py failed", kind="after_training")
    record.save(LocalFiles(tmp_path))
    assert SetupErrorRecord.load(tmp_path, WORKER0) == record
    path = SetupErrorRecord.path(tmp_path, WORKER0)
    path.write_text(json.dumps({"task": "worker0", "message": "m", "kind": "later"}))
    assert SetupErrorRecord.load(tmp_path, WORKER0) is None
    path.write_text("[1]")
    assert SetupErrorRecord.load(tmp_path, WORKER0) is None


# -- the worker -------------------------------------------------------------------------------
def _as_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, trained: bool) -> None:
    env = TaskEnv(
        cluster={"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]},
        task_index=0,
        scheme="hogwild",
        run_dir=str(tmp_path),
    )
    monkeypatch.setenv(ENV_VAR, env.to_json())
    monkeypatch.setattr("sys.argv", list(sys.argv))
    monkeypatch.setattr("sys.path", list(sys.path))
    monkeypatch.setattr(api, "calls", 1)
    monkeypatch.setattr(api, "trained", trained)


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("import math\nprint(math.exp(1e6))\n", "OverflowError at line 2: math range error"),
        ("import sys\n\nsys.exit(4)\n", "exit code 4"),
    ],
)
def test_the_bootstrap_names_the_line_and_exits_with_the_code_not_restarted(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    body: str,
    said: str,
) -> None:
    script = tmp_path / "after.py"
    script.write_text(body)
    _as_task(tmp_path, monkeypatch, trained=True)
    assert run_script(str(script), []) == AFTER_TRAINING_EXIT_CODE
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (
        f"distsgd: error: {script} failed after its training finished ({said}); fix the "
        "script (training is not run again)"
    )
    record = SetupErrorRecord.load(tmp_path, WORKER0)
    assert record is not None and record.kind == "after_training" and said in record.message


def test_an_error_while_training_is_still_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "during.py"
    script.write_text("raise RuntimeError('lost the servers')\n")
    _as_task(tmp_path, monkeypatch, trained=False)
    with pytest.raises(RuntimeError, match="lost the servers"):  # exit 1: restarted
        run_script(str(script), [])
    record = SetupErrorRecord.load(tmp_path, WORKER0)  # named if it happens again and again
    assert record == SetupErrorRecord(
        task=WORKER0, message="RuntimeError at line 1: lost the servers", kind="crash"
    )


# -- the chief's record -----------------------------------------------------------------------
def _chief(run_dir: Path) -> Chief:
    config = TrainConfig()
    return Chief(
        test_set=None,
        loss_fn=None,
        batch_fn=None,
        metric_fns={},
        config=config,
        given_config=config,
        lr_scaling=LrScaling.resolve(config, "none", 1),
        files=LocalFiles(run_dir),
        metrics=MetricsWriter(None, "worker0"),
    )


def test_a_restarted_chief_keeps_the_recorded_result(tmp_path: Path) -> None:
    model = nn.Linear(2, 1)
    first = TrainResult(
        scheme="hogwild",
        worker=0,
        local_steps=20,
        global_step=40,
        seconds=9.5,
        samples=320,
        bytes_sent=33600,
        test_loss=1.08e9,
        diverged=True,
        divergence="the final test accuracy is at chance",
    )
    config = TrainConfig()
    save_result(
        LocalFiles(tmp_path),
        first,
        model=model,
        config=config,
        lr_scaling=LrScaling.resolve(config, "none", 1),
    )
    written = (tmp_path / RESULT_FILE).read_text()
    assert recorded_result(LocalFiles(tmp_path)) == first
    again = dataclasses.replace(first, seconds=0.00025, bytes_sent=0, diverged=False)
    chief = _chief(tmp_path)
    chief.start(model, from_start=False)  # restarted: it continues at its last step
    kept = chief.finish(again, ctx=None, conn=None, scheme=None, on_evaluate=print)  # type: ignore[arg-type]
    assert kept == first
    assert (tmp_path / RESULT_FILE).read_text() == written
    # a new run's chief (from step 0) in that folder writes its own (a cluster started by hand)
    chief = _chief(tmp_path)
    chief.start(model, from_start=True)
    ctx, scheme = SimpleNamespace(model=model), SimpleNamespace(evaluate_on="replica")
    chief.finish(again, ctx=ctx, conn=None, scheme=scheme, on_evaluate=print)  # type: ignore[arg-type]
    assert recorded_result(LocalFiles(tmp_path)) == again


def test_a_record_that_is_not_the_chiefs_reads_as_none(tmp_path: Path) -> None:
    assert recorded_result(LocalFiles(tmp_path)) is None
    (tmp_path / RESULT_FILE).write_text('{"scheme": "sync", "diverged": true}')
    assert recorded_result(LocalFiles(tmp_path)) is None
    (tmp_path / RESULT_FILE).write_text(
        '{"scheme": "sync", "worker": "0", "local_steps": 1, '
        '"global_step": 1, "seconds": 1, "samples": 1, '
        '"bytes_sent": 1}'
    )
    assert recorded_result(LocalFiles(tmp_path)) is None
    (tmp_path / RESULT_FILE).write_text("[")
    assert recorded_result(LocalFiles(tmp_path)) is None


# -- a real run -------------------------------------------------------------------------------
AFTER = """\
import math, sys
sys.path.insert(0, {scripts!r})
import torch.nn.functional as F
from torch import nn
import distsgd
from blobs import make_data

model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
config = distsgd.TrainConfig(batch_size=16, steps=5, lr=0.05, log_every=1)
result = distsgd.train(model=model, loss_fn=F.cross_entropy, train_data=make_data(320, 1),
                       test_data=make_data(64, 2), config=config)
print(math.exp(1e6))
"""


def test_a_script_that_raises_after_train_stops_the_run_in_one_line(tmp_path: Path) -> None:
    """Every worker's script raises after train() returned (worker1's while the chief still
    waits and evaluates): one line naming the script's line, exit 1, no restart, and the
    chief's result.json as it wrote it."""
    script = tmp_path / "after.py"
    script.write_text(AFTER.format(scripts=str(SCRIPTS)))
    run_dir = tmp_path / "run"
    flags = ["--scheme", "hogwild", "--workers", "2", "--quiet", "--run-dir", str(run_dir)]
    done = run_distsgd(["run", *flags, str(script)])
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"distsgd: error: worker0: {script} failed after its training")
    assert "(OverflowError at line 12: math range error)" in last
    assert f"the run's result stands in {run_dir / RESULT_FILE}" in last
    assert "restart" not in (done.stdout + done.stderr).replace("not restarted", "")
    assert "--resume" not in done.stdout + done.stderr
    result = json.loads((run_dir / RESULT_FILE).read_text())
    assert (result["worker"], result["local_steps"]) == (0, 5)
    assert result["bytes_sent"] > 0 and result["test_loss"] is not None
    faults = [m for m in metrics(run_dir) if m.get("event") == "fault"]
    assert {m["target"] for m in faults} == {"worker0", "worker1"}
    assert {m["action"] for m in faults} == {"none"}
    assert all(m["after_training"] for m in faults)
