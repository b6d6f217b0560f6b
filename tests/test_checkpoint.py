"""Checkpoint pieces on their own: shard files, worker state, manifests, NaN, sync timeouts."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import loadclock
import numpy as np
import pytest
import torch

from distsgd import schemes
from distsgd.control.checkpoint.errors import CheckpointError, IncompleteCheckpoint
from distsgd.control.checkpoint.manifests import ManifestWriter
from distsgd.control.checkpoint.store import (
    MANIFEST,
    SHARDS_PREFIX,
    latest_checkpoint,
    prune_shard_dirs,
    verify,
)
from distsgd.ps import PushMeta, Shard
from distsgd.ps.shard_file import CorruptCheckpoint
from distsgd.runtime.checkpoint import save_worker_state
from distsgd.schemes.downpour import DownpourOptions
from distsgd.workers.downpour import DownpourWorker


def _shard(scheme: str, options: dict, workers: int = 2) -> Shard:
    rule = schemes.make_server_rule(scheme, options, workers)
    values = {"w#0": np.arange(6, dtype=np.float32), "b#0": np.ones((2, 2), np.float32)}
    return Shard(
        index=0,
        scheme=scheme,
        options_json=json.dumps(options),
        num_workers=workers,
        values=values,
        rule=rule,
    )


def _push(shard: Shard, worker: int, base: int, value: float = 1.0):  # type: ignore[no-untyped-def]
    payload = {k: np.full_like(v, value) for k, v in shard.values.items()}
    return shard.push(payload, PushMeta(worker=worker, incarnation=1, base_version=base))


def test_sync_shard_round_trip_keeps_open_step_and_momentum() -> None:
    options = {"lr": 0.1, "momentum": 0.9, "required": 2, "step_timeout": 60.0}
    shard = _shard("sync", options)
    _push(shard, 0, 0), _push(shard, 1, 0)  # step 0 closes: momentum buffers exist
    _push(shard, 0, 1, value=2.0)  # step 1 open with worker 0's gradient
    version, data = shard.to_bytes()
    restored = Shard.from_bytes(data, schemes.make_server_rule)
    assert version == restored.version == restored.restored_version == 1
    for key in shard.values:
        np.testing.assert_array_equal(restored.values[key], shard.values[key])
    # Closing step 1 on both gives the same parameters: open sums and momentum came back.
    _push(shard, 1, 1, value=4.0)
    _push(restored, 1, 1, value=4.0)
    for key in shard.values:
        np.testing.assert_allclose(restored.values[key], shard.values[key], rtol=1e-6)
    assert restored.version == 2


@pytest.mark.parametrize(
    "damage", [lambda b: b[: len(b) // 2], lambda b: b"not a zip", lambda b: b[:-10] + b"0" * 10]
)
def test_damaged_shard_file_is_named(damage) -> None:  # type: ignore[no-untyped-def]
    _, data = _shard("hogwild", {"lr": 0.1}).to_bytes()
    with pytest.raises(CorruptCheckpoint, match=r"ps0\.npz"):
        Shard.from_bytes(damage(data), schemes.make_server_rule, name="ps0.npz")


def test_nonfinite_push_is_refused_and_counted() -> None:
    shard = _shard("hogwild", {"lr": 0.1})
    before = {k: v.copy() for k, v in shard.values.items()}
    payload = {k: np.zeros_like(v) for k, v in shard.values.items()}
    payload["b#0"][1, 1] = np.nan
    outcome, version = shard.push(payload, PushMeta(worker=0, incarnation=1, base_version=0))
    assert (
        not outcome.accepted and outcome.reason.startswith("nonfinite") and "b#0" in outcome.reason
    )
    assert version == 0 and shard.nonfinite_rejected == 1
    for key in before:
        np.testing.assert_array_equal(shard.values[key], before[key])


def test_sync_step_closes_after_timeout_without_a_dead_worker() -> None:
    shard = _shard("sync", {"lr": 1.0, "required": 2, "step_timeout": 5.0})
    _push(shard, 0, 0)
    opened = shard.rule.opened  # type: ignore[attr-defined]
    shard.rule.tick(shard, opened + 4.0)
    assert shard.version == 0  # still waiting for worker 1
    shard.rule.tick(shard, opened + 5.5)
    assert shard.version == 1  # closed with worker 0's gradient alone
    np.testing.assert_allclose(shard.values["w#0"], np.arange(6) - 1.0)


def test_worker_scheme_state_round_trip_includes_optimizer() -> None:
    model = torch.nn.Linear(3, 2)
    a = DownpourWorker(DownpourOptions(window=3), 2)
    a.optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    a.optimizer.step()
    a.pending = 2
    state = a.state_dict()
    b = DownpourWorker(DownpourOptions(window=3), 2)
    b.optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    b.load_state_dict(state)
    assert b.pending == 2 and b.server_lr == a.server_lr
    bufs_a = [s["momentum_buffer"] for s in a.optimizer.state.values()]
    bufs_b = [s["momentum_buffer"] for s in b.optimizer.state.values()]
    assert bufs_b and all(torch.equal(x, y) for x, y in zip(bufs_a, bufs_b, strict=True))


def worker_state(step: int, **changes: Any) -> dict[str, Any]:
    """A small complete worker state, as the runtime saves it."""
    model = torch.nn.Linear(3, 2)
    return {
        "worker": 0,
        "local_step": step,
        "global_step": step,
        "position": (0, step),
        "model": model.state_dict(),
        "scheme": {"pending": 1, "window_start": {"w": np.arange(3.0)}},
        "scheme_name": "hogwild",
        "steps": 100,
        **changes,
    }


def _complete_checkpoint(root: Path, step: int) -> Path:
    shard = _shard("hogwild", {"lr": 0.1})
    version, data = shard.to_bytes()
    folder = root / f"ckpt-{step:08d}"
    folder.mkdir(parents=True)
    (folder / "ps0.npz").write_bytes(data)
    import hashlib

    shards = [
        {
            "file": str(folder / "ps0.npz"),
            "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data),
            "version": version,
        }
    ]
    save_worker_state(root / "workers" / f"worker0-{step:08d}.pt", worker_state(step))
    writer = ManifestWriter(root, 1, wait=5)
    writer.complete(folder.name, step, shards, {"scheme": "hogwild"})
    writer.join(10)
    return folder


def test_a_settled_writer_completes_what_it_can_and_does_not_wait_for_a_worker_gone(
    tmp_path: Path,
) -> None:
    """At a run's end every worker has saved what it ever will: a checkpoint whose states are
    all there is completed, one that waits for a worker who left (an elastic scale-down) is
    given up at once, not after the join's timeout."""
    root = tmp_path / "checkpoints"
    for step in (10, 20):
        (root / f"ckpt-{step:08d}").mkdir(parents=True)
        save_worker_state(root / "workers" / f"worker0-{step:08d}.pt", worker_state(step))
    save_worker_state(root / "workers" / f"worker1-{10:08d}.pt", worker_state(10))
    writer = ManifestWriter(root, 2, wait=60)
    for step in (10, 20):
        writer.complete(f"ckpt-{step:08d}", step, [], {"scheme": "hogwild"})
    watch = loadclock.Stopwatch()
    writer.join(30, settled=True)
    assert watch.elapsed() < 10  # not the join's 30 s
    assert (root / "ckpt-00000010" / MANIFEST).is_file()  # worker1 reached step 10
    assert not (root / "ckpt-00000020" / MANIFEST).exists()  # worker1 never reached 20


def test_latest_checkpoint_skips_damaged_and_incomplete(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    good = _complete_checkpoint(root, 10)
    damaged = _complete_checkpoint(root, 20)
    raw = bytearray((damaged / "ps0.npz").read_bytes())
    raw[100] ^= 0xFF
    (damaged / "ps0.npz").write_bytes(bytes(raw))
    incomplete = root / "ckpt-00000030"  # killed before its manifest was written
    incomplete.mkdir()
    (incomplete / "ps0.npz").write_bytes(b"partial")
    checkpoint, problems = latest_checkpoint(root)
    assert checkpoint is not None and checkpoint.path == good and checkpoint.step == 10
    assert isinstance(problems[0], IncompleteCheckpoint) and "ckpt-00000030" in str(problems[0])
    assert not isinstance(problems[1], IncompleteCheckpoint)
    assert "damaged" in str(problems[1]) and "ckpt-00000020" in str(problems[1])
    with pytest.raises(CheckpointError, match="damaged"):
        verify(damaged)
    assert json.loads((good / MANIFEST).read_text())["workers"][0]["step"] == 10


def test_server_only_checkpoints_keep_the_newest_two(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for version in (5, 40, 120, 300):
        (root / f"{SHARDS_PREFIX}{version:012d}").mkdir(parents=True)
    (root / "ckpt-00000010").mkdir()  # a manifest checkpoint is never touched here
    prune_shard_dirs(root)
    assert sorted(p.name for p in root.iterdir()) == [
        "ckpt-00000010",
        f"{SHARDS_PREFIX}000000000120",
        f"{SHARDS_PREFIX}000000000300",
    ]


def test_the_shards_are_saved_after_every_workers_state(tmp_path: Path) -> None:
    """A consistent cut (issue 36, item 13): a checkpoint's shards are saved once every
    worker's state of it is there, so they hold every push those states counted (the pushes
    past them, a resumed worker skips: the servers tell it where its pushes stopped). They
    were saved at the chief's step, before a lagging worker's state: its pushes in between
    were in neither, lost at a resume."""
    root = tmp_path / "checkpoints"
    (root / "ckpt-00000010").mkdir(parents=True)
    save_worker_state(root / "workers" / f"worker0-{10:08d}.pt", worker_state(10))
    seen: list[list[str]] = []

    def save_shards(name: str) -> list[dict[str, Any]]:
        seen.append(sorted(p.name for p in (root / "workers").glob("*.pt")))
        return []

    writer = ManifestWriter(root, 2, wait=60)
    writer.complete("ckpt-00000010", 10, save_shards, {"scheme": "hogwild"})
    time.sleep(0.5)  # worker1 lags: nothing saved yet
    assert seen == []
    save_worker_state(root / "workers" / f"worker1-{12:08d}.pt", worker_state(12))
    writer.join(30)
    assert seen == [["worker0-00000010.pt", "worker1-00000012.pt"]]
    assert (root / "ckpt-00000010" / MANIFEST).is_file()
