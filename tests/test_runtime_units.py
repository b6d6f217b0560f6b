"""Runtime pieces on their own: data sharding, typed config, the task environment, metrics."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import loadclock
import pytest
import torch
from torch.utils.data import TensorDataset

from distsgd.control.config import lr_factor
from distsgd.control.metrics import MetricsWriter
from distsgd.runtime import TaskEnv, TrainConfig
from distsgd.runtime.data import ShardedBatches, as_dataset


def _dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n).float().unsqueeze(1), torch.arange(n))


def test_shards_are_disjoint_and_equal() -> None:
    data = _dataset(103)
    seen: list[set[int]] = []
    for rank in range(4):
        batches = ShardedBatches(data, rank=rank, world=4, batch_size=5, seed=7)
        assert batches.steps_per_epoch == 103 // 4 // 5
        it = iter(batches)
        ids = set()
        for _ in range(batches.steps_per_epoch):
            _, y = next(it)
            ids.update(int(v) for v in y)
        assert batches.position == (0, batches.steps_per_epoch)
        seen.append(ids)
    for a in range(4):
        for b in range(a + 1, 4):
            assert not seen[a] & seen[b]


def test_each_epoch_reshuffles_the_same_shard() -> None:
    batches = ShardedBatches(_dataset(40), rank=1, world=2, batch_size=20, seed=0)
    it = iter(batches)
    first = next(it)[1].tolist()
    second = next(it)[1].tolist()
    assert sorted(first) == sorted(second) and first != second


def test_batch_larger_than_shard_is_explained() -> None:
    with pytest.raises(ValueError, match="lower --batch-size or use fewer workers"):
        ShardedBatches(_dataset(30), rank=0, world=4, batch_size=16, seed=0)


def test_as_dataset_checks_pairs() -> None:
    assert len(as_dataset((torch.zeros(3, 2), torch.zeros(3)))) == 3  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="3 inputs but 2 targets"):
        as_dataset((torch.zeros(3, 2), torch.zeros(2)))
    with pytest.raises(ValueError, match="expected a torch Dataset"):
        as_dataset([1, 2, 3])


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("batch_size", 0, "batch_size must be at least 1"),
        ("lr", 0.0, "lr must be positive"),
        ("momentum", 1.0, "momentum must be in"),
        ("steps", -1, "steps must be 0 or more"),
        ("epochs", 0.0, "epochs must be positive"),
        ("warmup", 1.0, "warmup must be a fraction"),
    ],
)
def test_train_config_rejects_bad_values(field: str, value: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        TrainConfig(**{field: value})  # type: ignore[arg-type]


def test_train_config_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        TrainConfig(32)  # type: ignore[misc]


def test_task_env_round_trip_and_validation() -> None:
    env = TaskEnv(
        cluster={"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, task_index=0, scheme="sync"
    )
    assert TaskEnv.from_json(env.to_json()) == env
    assert TaskEnv.from_environ({"DISTSGD_TASK": env.to_json()}) == env
    assert TaskEnv.from_environ({}) is None
    with pytest.raises(ValueError, match="out of range"):
        TaskEnv(cluster={"ps": [], "worker": ["127.0.0.1:2"]}, task_index=1, scheme="sync")


def test_metrics_lines_from_threads_never_interleave(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    writers = [MetricsWriter(path, f"worker{i}") for i in range(4)]

    def write(w: MetricsWriter) -> None:
        for step in range(200):
            w.log(step=step, loss=1.0 / (step + 1), padding="x" * 300)

    threads = [threading.Thread(target=write, args=(w,)) for w in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w in writers:
        w.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 800
    assert all(json.loads(line)["padding"] == "x" * 300 for line in lines)


def test_warmup_rises_linearly_then_the_schedule_runs_over_the_rest() -> None:
    total = 100
    factors = [lr_factor("cosine", step, total, warmup=0.1) for step in range(total + 1)]
    assert factors[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])
    assert factors[10] == pytest.approx(1.0)  # the cosine starts after the ramp
    assert factors[55] == pytest.approx(0.5)  # halfway through the 90 steps after it
    assert factors[total] == pytest.approx(0.0, abs=1e-12)
    assert [lr_factor("constant", s, total, warmup=0.1) for s in (0, 9, 10, 99)] == [
        pytest.approx(0.1),
        pytest.approx(1.0),
        1.0,
        1.0,
    ]
    assert lr_factor("cosine", 0, total) == 1.0  # no warmup: as before


def test_ps_addresses_are_read_from_the_servers_files(tmp_path: Path) -> None:
    """Workers start while the servers do: a ps address with port 0 comes from its file."""
    files = [tmp_path / "ps0.address", tmp_path / "ps1.address"]
    env = TaskEnv(
        cluster={"ps": ["127.0.0.1:0", "127.0.0.1:5000"], "worker": ["127.0.0.1:0"]},
        task_index=0,
        scheme="sync",
        ps_address_files=[str(f) for f in files],
    )
    with pytest.raises(TimeoutError, match="ps0 did not report its address"):
        env.with_ps_addresses(0.05)
    threading.Timer(0.1, lambda: files[0].write_text("127.0.0.1:4321\n")).start()
    resolved = env.with_ps_addresses(5.0)
    assert resolved.cluster["ps"] == ["127.0.0.1:4321", "127.0.0.1:5000"]  # a known one stays
    assert TaskEnv.from_json(resolved.to_json()) == resolved


def test_task_tells_a_script_who_it_is(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import distsgd
    from distsgd.control.task import ENV_VAR

    monkeypatch.delenv(ENV_VAR, raising=False)
    alone = distsgd.task()
    assert (alone.rank, alone.num_workers, alone.is_chief) == (0, 1, True)
    assert alone.standalone and alone.run_dir is None and alone.scheme == "allreduce"
    env = TaskEnv(
        cluster={"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:0"] * 4},
        task_index=2,
        scheme="hogwild",
        run_dir=str(tmp_path),
        registered_workers=3,
    )
    monkeypatch.setenv(ENV_VAR, env.to_json())
    info = distsgd.task()
    assert (info.rank, info.num_workers, info.is_chief, info.scheme) == (2, 3, False, "hogwild")
    assert info.run_dir == tmp_path and not info.standalone


def test_progress_line_has_the_share_done_and_time_left(tmp_path: Path) -> None:
    from distsgd.launcher.progress import Progress

    path = tmp_path / "metrics.jsonl"
    lines = [
        {"time": 100.0, "task": "worker0", "step": 0, "event": "membership"},
        {"time": 110.0, "task": "worker0", "step": 40, "local_step": 40, "progress": 0.5},
        {"time": 110.0, "task": "worker1", "step": 40, "local_step": 20, "progress": 0.25},
    ]
    # a line that is JSON but no object, and one a task is still writing, are passed over
    text = "".join(json.dumps(r) + "\n" for r in lines) + "[1, 2]\n"
    path.write_text(text + '{"time": 111.0, "task": "worker1", "progress": 0.9')
    progress = Progress(path)
    progress.poll()
    assert progress.fraction == 0.25  # the slowest worker decides when the run ends
    assert progress.eta(now=110.0) == pytest.approx(30.0)  # 10 s for a quarter: 30 s left
    assert "| 25% |" in progress.render() and "s left" in progress.render()
    assert Progress(tmp_path / "none.jsonl").eta() is None


def test_a_worker_that_left_no_longer_holds_the_progress_back(tmp_path: Path) -> None:
    """After a scale-down the departed worker's last report is stale: the line follows the
    workers that remain."""
    from distsgd.launcher.progress import Progress

    path = tmp_path / "metrics.jsonl"
    lines = [
        {"time": 100.0, "task": "worker0", "step": 10, "local_step": 10, "progress": 0.4},
        {"time": 100.0, "task": "worker2", "step": 10, "local_step": 5, "progress": 0.43},
        {"time": 101.0, "task": "worker2", "step": 12, "local_step": 6, "samples": 64},
        {
            "time": 104.0,
            "task": "launcher",
            "step": 60,
            "event": "worker_left",
            "target": "worker2",
        },
        {"time": 110.0, "task": "worker0", "step": 90, "local_step": 90, "progress": 0.9},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    progress = Progress(path)
    progress.poll()
    assert progress.fraction == 0.9
    assert "worker2" not in progress.rates


def test_throughput_counts_from_each_workers_first_line(tmp_path: Path) -> None:
    """The first line's samples were made before any line: a rate over start-up would be wrong
    both ways (start-up counted, or a burst over no time); it counts from the first line."""
    from distsgd.launcher.progress import Progress

    path = tmp_path / "metrics.jsonl"
    first = [
        {"time": 100.0, "task": "worker0", "step": 10, "local_step": 10, "samples": 320},
        {"time": 100.5, "task": "worker1", "step": 10, "local_step": 10, "samples": 320},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in first))
    progress = Progress(path)
    progress.poll()
    assert progress.samples_per_second is None and "samples/s" not in progress.render()
    more = [
        {"time": 102.0, "task": "worker0", "step": 30, "local_step": 20, "samples": 640},
        {"time": 104.5, "task": "worker1", "step": 40, "local_step": 20, "samples": 640},
    ]
    with path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in more))
    progress.poll()
    assert progress.samples_per_second == pytest.approx(320 / 2.0 + 320 / 4.0)
    assert "240 samples/s" in progress.render()


def test_a_script_run_alone_writes_a_run_folder_and_shows_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python script.py``: a run folder under $DISTSGD_RUNS and a progress line; with
    $DISTSGD_RUNS=off none (checked in this process: a second script cost a second import of
    torch, the same decision)."""
    script = tmp_path / "alone.py"
    script.write_text(
        "import torch, torch.nn.functional as F\n"
        "import distsgd\n"
        "x = torch.randn(256, 4); y = (x[:, 0] > 0).long()\n"
        "r = distsgd.train(model=torch.nn.Linear(4, 2), loss_fn=F.cross_entropy,\n"
        "    train_data=(x, y), test_data=(x, y), config=distsgd.TrainConfig(steps=30))\n"
    )
    runs = tmp_path / "runs"
    env = {**os.environ, "DISTSGD_RUNS": str(runs)}
    done = loadclock.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "[distsgd] step 30 | 100% | loss " in done.stderr  # the last step's line
    (folder,) = runs.iterdir()
    assert folder.name.endswith("-alone")
    assert {"metrics.jsonl", "result.json", "final_model.pt"} <= {p.name for p in folder.iterdir()}
    assert json.loads((folder / "result.json").read_text())["local_steps"] == 30
    import distsgd

    monkeypatch.chdir(tmp_path)  # where a folder named "off" (or distsgd-runs) would go
    monkeypatch.setenv("DISTSGD_RUNS", "off")
    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long()
    result = distsgd.train(
        model=torch.nn.Linear(4, 2),
        loss_fn=torch.nn.functional.cross_entropy,
        train_data=(x, y),
        config=TrainConfig(steps=3),
    )
    assert result.local_steps == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alone.py", "runs"]
    assert len(list(runs.iterdir())) == 1


@pytest.mark.parametrize(("width", "released"), [(64, False), (3000, True)])
def test_gradients_are_given_back_only_where_the_model_is_large(width: int, released: bool) -> None:
    """release_grads frees the gradients of a model of RELEASE_BYTES or more (36 MB here); a
    small one keeps them: the heap's trim would cost more than its memory is worth."""
    from distsgd.runtime.context import RELEASE_BYTES, WorkerContext

    model = torch.nn.Linear(width, width)
    ctx = WorkerContext(
        model=model, config=TrainConfig(steps=1), rank=0, num_workers=1,
        device=torch.device("cpu"),
    )  # fmt: skip
    assert (ctx.model_bytes >= RELEASE_BYTES) is released
    model(torch.randn(2, width)).sum().backward()
    ctx.release_grads()
    assert all((p.grad is None) is released for p in model.parameters())
