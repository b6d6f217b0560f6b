"""How many complete checkpoints a run keeps follows their size (control.checkpoint): 3 small
ones, 2 from LARGE_CHECKPOINT bytes on; pending ones and newer ones are never pruned."""

from __future__ import annotations

import json
from pathlib import Path

from distsgd.control.checkpoint.manifests import ManifestWriter
from distsgd.control.checkpoint.store import (
    KEEP,
    LARGE_CHECKPOINT,
    MANIFEST,
    checkpoint_bytes,
    keep_count,
)


def test_large_checkpoints_are_kept_twice_small_ones_three_times() -> None:
    assert keep_count(0) == keep_count(LARGE_CHECKPOINT - 1) == KEEP == 3
    assert keep_count(LARGE_CHECKPOINT) == keep_count(10 * LARGE_CHECKPOINT) == 2


def _checkpoint(root: Path, step: int, shard_bytes: int, worker_bytes: int) -> Path:
    folder = root / f"ckpt-{step:08d}"
    folder.mkdir(parents=True)
    manifest = {
        "shards": [{"file": "ps0.npz", "bytes": shard_bytes}],
        "workers": [{"file": "worker0.pt", "bytes": worker_bytes}] * 2,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return folder


def _pruned(tmp_path: Path, each: int) -> list[str]:
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30, 40):
        _checkpoint(root, step, each // 2, each // 4)
    (root / "ckpt-00000050").mkdir()  # being written: no manifest yet
    writer = ManifestWriter(root, num_workers=2, wait=1.0)
    try:
        writer._prune()
    finally:
        writer.join(1.0, settled=True)
    return sorted(p.name for p in root.iterdir())


def test_the_manifest_writer_keeps_by_the_newest_checkpoints_size(tmp_path: Path) -> None:
    assert checkpoint_bytes(_checkpoint(tmp_path / "one", 1, 100, 30)) == 160
    assert checkpoint_bytes(tmp_path / "none") == 0
    small = _pruned(tmp_path / "small", 1000)
    assert small == ["ckpt-00000020", "ckpt-00000030", "ckpt-00000040", "ckpt-00000050"]
    large = _pruned(tmp_path / "large", LARGE_CHECKPOINT)
    assert large == ["ckpt-00000030", "ckpt-00000040", "ckpt-00000050"]


def test_a_worker_keeps_as_many_states_as_checkpoints_of_their_size_are_kept(
    tmp_path: Path,
) -> None:
    from distsgd.control.checkpoint.store import prune_worker_files, worker_files

    workers = tmp_path / "workers"
    workers.mkdir()

    def saved(size: int) -> list[int]:
        for step in (1, 2, 3, 4):
            with open(workers / f"worker0-{step:08d}.pt", "wb") as f:
                f.truncate(size)  # sparse: the size without the bytes
        prune_worker_files(tmp_path, 0, num_workers=2)
        return [int(f.stem.split("-")[1]) for f in worker_files(tmp_path, 0)]

    assert saved(LARGE_CHECKPOINT // 4) == [2, 3, 4]  # two of them: a small checkpoint
    assert saved(LARGE_CHECKPOINT // 2) == [3, 4]  # two of them: a large one, kept twice


def test_a_restarted_worker_removes_the_temporaries_of_its_own_interrupted_writes(
    tmp_path: Path,
) -> None:
    """A write killed midway leaves its temporary file (an atomic write renames it only when
    whole): the state's, or its sidecar's (a CI run's k8s worker left
    ``.worker1-00000010.json.<random>.tmp``). The worker's next start removes its own, and
    only its own."""
    from distsgd.control.checkpoint.store import remove_stale_temps

    workers = tmp_path / "workers"
    workers.mkdir()
    own = [".worker1-00000010.pt.k2j4.tmp", ".worker1-00000010.json.x9a1.tmp"]
    others = [".worker10-00000010.pt.k2j4.tmp", ".worker2-00000010.json.x9a1.tmp"]
    kept = ["worker1-00000008.pt", "worker1-00000008.json", *others]
    for name in [*own, *kept]:
        (workers / name).write_bytes(b"x")
    remove_stale_temps(tmp_path, 1)
    assert sorted(p.name for p in workers.iterdir()) == sorted(kept)
