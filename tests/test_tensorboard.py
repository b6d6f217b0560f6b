"""TensorBoard event files: what ``MetricsWriter`` logs reads back with TensorBoard's own reader.

The writer's series are checked against the ``metrics.jsonl`` lines of the same writer (read
from the file, not from what the test meant to log); one real demo run, with a worker killed
and restarted, checks a run folder end to end. TensorBoard scalars are float32, so a value
read back equals the line's value rounded to float32.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import metrics, run_distsgd
from hypothesis import given, settings
from hypothesis import strategies as st

from distsgd.control import board
from distsgd.control.folder import METRICS_FILE, TENSORBOARD_DIR
from distsgd.control.metrics import MetricsWriter


def f32(value: float) -> float:
    return float(np.float32(value))


class Clock:
    """``time.time`` for a writer: starts at T0, moved on by hand."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def accumulator(directory: Path) -> Any:
    """TensorBoard's reader over one run directory, everything kept (no sampling)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(
        str(directory), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0}
    )
    acc.Reload()
    return acc


def series(acc: Any, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def texts(acc: Any, tag: str = board.EVENTS_TAG) -> dict[int, str]:
    """The text of each step (the last one written there: what TensorBoard shows)."""
    out = {}
    for e in acc.Tensors(tag):
        out[e.step] = b"".join(e.tensor_proto.string_val).decode()
    return out


def lines(run_dir: Path, task: str) -> list[dict[str, Any]]:
    return [r for r in metrics(run_dir) if r["task"] == task]


def training_line(step: int, **extra: Any) -> dict[str, Any]:
    """A parameter-server worker's line at local step ``step`` (each step: 0.1 s compute,
    0.05 s pull, 0.02 s push, 0.03 s wait; 32 samples, 1000 bytes)."""
    return {
        "step": 2 * step,
        "local_step": step,
        "progress": step / 30,
        "loss": round(2.3 / (1 + step), 6),
        "samples": 32 * step,
        "epoch": 0,
        "bytes_sent": 1000 * step,
        "lost_pushes": 0,
        "nonfinite_skipped": 0,
        "mean_staleness": 0.25 * step,
        "dropped": step // 10,
        "compute_s": round(0.1 * step, 4),
        "pull_s": round(0.05 * step, 4),
        "push_s": round(0.02 * step, 4),
        "wait_s": round(0.03 * step, 4),
        **extra,
    }


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    pytest.importorskip("tensorboard")
    yield tmp_path


def log_worker(run_dir: Path, task: str = "worker0", clock: Clock | None = None) -> Clock:
    """What a chief logs in a short run: joins, 3 lines, a mid-run evaluation, the end."""
    clock = clock or Clock()
    writer = MetricsWriter(run_dir / METRICS_FILE, task, clock=clock)
    writer.log(step=0, local_step=0, event="membership", ps=0, epoch=0, members=[0, 1])
    for step in (10, 20, 30):
        clock.now += 2.0 if step > 10 else 0.5
        writer.log(**training_line(step))
        if step == 20:
            writer.log(step=40, local_step=20, test_loss=0.9, accuracy=0.71)
    clock.now += 0.25
    writer.log(
        step=60,
        local_step=30,
        event="finished_steps",
        seconds=4.5,
        compute_s=3.5,
        staleness={"0": 5, "1": 20, "3": 5},
    )
    writer.log(step=60, local_step=30, test_loss=0.4, accuracy=0.875, final=True)
    writer.close()
    return clock


def test_a_worker_run_holds_the_series_of_its_metrics_lines(run_dir: Path) -> None:
    log_worker(run_dir)
    acc = accumulator(run_dir / TENSORBOARD_DIR / "worker0")
    logged = lines(run_dir, "worker0")
    train = [r for r in logged if "loss" in r]
    final = next(r for r in logged if r.get("final"))
    # The final loss and accuracy are those of metrics.jsonl, over the worker's local steps.
    assert series(acc, "train/loss") == [(r["local_step"], f32(r["loss"])) for r in train]
    assert series(acc, "train/loss")[-1][1] == f32(train[-1]["loss"])
    assert series(acc, "eval/accuracy") == [(20, f32(0.71)), (30, f32(final["accuracy"]))]
    assert series(acc, "eval/test_loss")[-1] == (30, f32(final["test_loss"]))
    # samples/s and bytes/s: from each line and the one before (2 s apart after the first).
    assert series(acc, "train/samples_per_s") == [(20, f32(320 / 2.0)), (30, f32(320 / 2.0))]
    assert series(acc, "comm/bytes_per_s") == [(20, 5000.0), (30, 5000.0)]
    assert series(acc, "comm/bytes_sent")[-1] == (30, 30000.0)
    assert series(acc, "comm/mean_staleness") == [(s, 0.25 * s) for s in (10, 20, 30)]
    assert series(acc, "train/global_step") == [(s, 2.0 * s) for s in (10, 20, 30)]
    assert series(acc, "train/dropped") == [(10, 1.0), (20, 2.0), (30, 3.0)]  # a scheme's
    # The time split: cumulative seconds (the end's from finished_steps), shares per interval.
    assert series(acc, "time/pull_s")[-1] == (30, f32(1.5))
    assert series(acc, "time/compute_s")[-1] == (30, f32(3.5))
    for step in (10, 20, 30):
        shares = {p: dict(series(acc, f"time_share/{p}"))[step] for p in ("compute", "pull")}
        assert shares == {"compute": f32(0.5), "pull": f32(0.25)}
        assert dict(series(acc, "time_share/communication"))[step] == f32(0.5)
    # Events: counted, and each one's fields as text at its step.
    assert series(acc, "membership/ps0/workers") == [(0, 2.0)]
    assert series(acc, "events/membership") == [(0, 1.0)]
    assert series(acc, "events/finished_steps") == [(30, 1.0)]
    shown = texts(acc)
    assert "**membership**" in shown[0] and "members=`[0, 1]`" in shown[0]
    assert "**finished_steps**" in shown[30] and "seconds=`4.5`" in shown[30]
    # The staleness histogram of finished_steps: one bucket per value, at the last step.
    (histogram,) = acc.Histograms("comm/staleness")
    value = histogram.histogram_value
    assert histogram.step == 30 and (value.min, value.max, value.num) == (0.0, 3.0, 30.0)
    assert value.sum == 35.0 and value.sum_squares == 65.0
    assert list(value.bucket_limit) == [0.5, 1.5, 2.5, 3.5]
    assert list(value.bucket) == [5.0, 20.0, 0.0, 5.0]


def test_event_files_have_the_mode_of_metrics_jsonl(run_dir: Path) -> None:
    log_worker(run_dir)
    (event_file,) = (run_dir / TENSORBOARD_DIR / "worker0").iterdir()
    assert "tfevents" in event_file.name
    mode = stat.S_IMODE(os.stat(run_dir / METRICS_FILE).st_mode)
    assert stat.S_IMODE(event_file.stat().st_mode) == mode


def test_each_task_is_a_run_and_compared_schemes_overlay(tmp_path: Path) -> None:
    """``tensorboard --logdir OUT`` of a comparison: one run per scheme and worker, every one
    with the same tags (so each chart overlays them)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    out = tmp_path / "compare"
    for scheme in ("sync", "hogwild"):
        folder = out / "runs" / scheme
        folder.mkdir(parents=True)
        for task in ("worker0", "worker1"):
            log_worker(folder, task)
    mux = EventMultiplexer(size_guidance={"scalars": 0})
    mux.AddRunsFromDirectory(str(out))
    mux.Reload()
    runs = mux.Runs()
    assert sorted(runs) == sorted(
        f"runs/{s}/{TENSORBOARD_DIR}/{t}"
        for s in ("sync", "hogwild")
        for t in ("worker0", "worker1")
    )
    for run, tags in runs.items():
        assert {"train/loss", "time_share/communication", "eval/accuracy"} <= set(tags["scalars"])
        assert mux.Scalars(run, "train/loss")[-1].value == f32(round(2.3 / 31, 6))


def test_the_launcher_run_has_faults_and_scaling_over_the_global_step(run_dir: Path) -> None:
    writer = MetricsWriter(run_dir / METRICS_FILE, "launcher", clock=Clock())
    writer.log(step=53, event="fault_injected", fault="kill", target="worker1")
    writer.log(step=66, event="fault", target="worker1", exit_code=-9, action="restart")
    writer.log(step=66, event="fault", target="ps0", exit_code=-9, action="restart")
    writer.log(step=90, event="scale", seq=1, workers_before=2, workers=3)
    writer.close()
    acc = accumulator(run_dir / TENSORBOARD_DIR / "launcher")
    assert series(acc, "events/fault_injected") == [(53, 1.0)]
    assert series(acc, "events/fault") == [(66, 1.0), (66, 2.0)]
    assert series(acc, "membership/workers") == [(90, 3.0)]
    shown = texts(acc)  # two faults at one step: the step's text holds both
    assert "target=`worker1`" in shown[66] and "target=`ps0`" in shown[66]
    assert shown[66].count("**fault**") == 2


def test_a_restarted_worker_replaces_the_steps_it_does_again(run_dir: Path) -> None:
    """A worker killed after step 40 and resumed from its checkpoint at step 20: its new
    process writes a second file beside the first, and the points from step 30 on are the new
    process's (as metrics.jsonl's last line per step says)."""
    clock = Clock()
    first = MetricsWriter(run_dir / METRICS_FILE, "worker1", clock=clock)
    for step in (10, 20, 30, 40):
        clock.now += 1.0
        first.log(**training_line(step))
    # SIGKILL: no close. Restarted from the checkpoint at 20, with other losses after it.
    clock.now += 5.0
    second = MetricsWriter(run_dir / METRICS_FILE, "worker1", clock=clock)
    # As run_worker logs them: the join (before the resume: at local step 0), the resume.
    second.log(step=40, local_step=0, event="membership", ps=0, epoch=3, members=[0, 1])
    second.log(step=40, local_step=20, event="resumed", file="ckpt-20")
    for step in (30, 40, 50):
        clock.now += 1.0
        second.log(**training_line(step, loss=0.5 + step / 1000))
    second.close()
    directory = run_dir / TENSORBOARD_DIR / "worker1"
    assert len(list(directory.iterdir())) == 2
    last: dict[int, float] = {}
    for record in lines(run_dir, "worker1"):
        if "loss" in record:
            last[record["local_step"]] = f32(record["loss"])
    acc = accumulator(directory)
    assert series(acc, "train/loss") == sorted(last.items())
    assert series(acc, "train/loss")[-1] == (50, f32(0.55))
    assert [s for s, _ in series(acc, "train/samples")] == [10, 20, 30, 40, 50]
    assert series(acc, "membership/ps0/epoch") == [(0, 3.0)]  # the new process's join


def test_a_failing_event_file_never_costs_a_metrics_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("tensorboard")
    (tmp_path / TENSORBOARD_DIR).write_text("a file where the folder goes\n")
    writer = MetricsWriter(tmp_path / METRICS_FILE, "worker0")
    with caplog.at_level(logging.WARNING, logger="distsgd.control.metrics"):
        for step in (10, 20, 30):
            writer.log(**training_line(step))
    writer.close()
    assert [r["local_step"] for r in lines(tmp_path, "worker0")] == [10, 20, 30]
    warnings = [r for r in caplog.records if "TensorBoard" in r.getMessage()]
    assert len(warnings) == 1 and writer.board is None


def _hide_tensorboard(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import tensorboard...`` raises ImportError, as where it is not installed."""
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith("tensorboard.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboard.compat.proto", None)


def test_without_tensorboard_nothing_is_written_and_nothing_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _hide_tensorboard(monkeypatch)
    monkeypatch.setattr(board, "_missing_noted", False)
    with caplog.at_level(logging.INFO, logger="distsgd.control.board"):
        for task in ("worker0", "worker1"):
            writer = MetricsWriter(tmp_path / METRICS_FILE, task)
            assert writer.board is None
            writer.log(**training_line(10))
            writer.log(step=20, local_step=10, event="finished_steps")
            writer.close()
    assert len(metrics(tmp_path)) == 4
    assert not (tmp_path / TENSORBOARD_DIR).exists()
    notes = [r for r in caplog.records if r.name == "distsgd.control.board"]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO  # once a process
    assert "not installed" in notes[0].getMessage()


@pytest.mark.parametrize("value", ["0", "off"])
def test_distsgd_tensorboard_0_turns_it_off(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(board.ENV_VAR, value)
    writer = MetricsWriter(run_dir / METRICS_FILE, "worker0")
    writer.log(**training_line(10))
    writer.close()
    assert writer.board is None and not (run_dir / TENSORBOARD_DIR).exists()
    assert len(metrics(run_dir)) == 1


def test_a_task_name_that_is_no_plain_name_gets_no_events(run_dir: Path) -> None:
    assert board.open_board(run_dir, "../escape") is None
    assert board.open_board(run_dir, "..") is None
    assert board.open_board(run_dir, "worker3") is not None


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=3000))
def test_masked_crc32c_is_tensorboards(data: bytes) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    assert board.masked_crc32c(data) == masked_crc32c(data)


@pytest.mark.parametrize("size", [0, 3, 4, 63, 64, 1023, 1024, 1025, 1027, 1028, 2051, 4096])
def test_masked_crc32c_at_the_block_edges(size: int) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert board.masked_crc32c(data) == masked_crc32c(data)


@pytest.mark.slow
def test_a_demo_run_folder_reads_back_like_its_metrics(tmp_path: Path) -> None:
    """A real run, a worker killed and restarted: every worker's final loss, the chief's final
    accuracy and the launcher's fault events read back as metrics.jsonl has them."""
    run = tmp_path / "run"
    args = ["demo", "--scheme", "sync", "--workers", "2", "--steps", "200", "--quiet"]
    # Synchronous: step 20 needs both workers' pushes, so worker1 has joined and logged by the
    # kill (its process has an event file of its own), and 180 steps left to be killed in (the
    # launcher sees the step within a quarter second).
    args += ["--inject-fault", "kill:worker:1@step=20", "--run-dir", str(run)]
    done = run_distsgd(args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    root = run / TENSORBOARD_DIR
    assert sorted(p.name for p in root.iterdir()) == ["launcher", "worker0", "worker1"]
    assert len(list((root / "worker1").iterdir())) == 2  # the killed process's and its restart's
    for task in ("worker0", "worker1"):
        acc = accumulator(root / task)
        train = [r for r in lines(run, task) if "loss" in r]
        assert series(acc, "train/loss")[-1] == (train[-1]["local_step"], f32(train[-1]["loss"]))
        last = {r["local_step"]: f32(r["loss"]) for r in train}  # a step's newest line
        assert series(acc, "train/loss") == sorted(last.items())  # worker1's from both files
        assert series(acc, "train/samples_per_s")[-1][1] > 0
        assert series(acc, "time/compute_s")[-1][1] > 0
        assert series(acc, "membership/ps0/workers")[0][1] >= 1
    acc = accumulator(root / "worker0")
    final = next(r for r in lines(run, "worker0") if r.get("final"))
    assert series(acc, "eval/accuracy")[-1][1] == f32(final["accuracy"])
    result = json.loads((run / "result.json").read_text())
    assert series(acc, "eval/accuracy")[-1][1] == pytest.approx(result["test_accuracy"], abs=1e-6)
    # Each worker's staleness histogram: sync's pushes are never stale
    assert sorted(result["staleness"]) == ["worker0", "worker1"]
    assert set(result["staleness"]["worker0"]) == {"0"}
    (histogram,) = acc.Histograms("comm/staleness")
    assert histogram.histogram_value.num == result["staleness"]["worker0"]["0"]
    launcher = accumulator(root / "launcher")
    assert series(launcher, "events/fault_injected")[-1][1] == 1.0
    assert series(launcher, "events/fault")[-1][1] == 1.0
    assert any("target=`worker1`" in text for text in texts(launcher).values())


def test_user_values_become_user_series(tmp_path: Path) -> None:
    """worker.log(...) and train(metrics=...) values, {"user": {...}} in metrics.jsonl."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from distsgd.control.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path / "metrics.jsonl", "worker0")
    writer.log(step=1, local_step=1, loss=0.5, samples=32)
    writer.log(step=2, local_step=2, user={"grad_norm": 1.25})
    writer.log(step=3, local_step=3, test_loss=0.4, accuracy=0.9, user={"f1": 0.8})
    writer.close()
    events = EventAccumulator(str(tmp_path / "tensorboard" / "worker0"))
    events.Reload()
    assert [e.value for e in events.Scalars("user/grad_norm")] == [1.25]
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("user/f1")] == [(3, 0.8)]
