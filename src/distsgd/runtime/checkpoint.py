"""Checkpoints of a whole run: every shard, every worker, and a manifest written last.

Layout under ``<run dir>/checkpoints/``::

    workers/worker<i>-<step>.pt   each worker's state, saved when due (newest 3 kept)
    ckpt-<step>/ps<j>.npz         each shard's state (written by the shard on the chief's call)
    ckpt-<step>/worker<i>.pt      hard links to the workers' state files the manifest names
    ckpt-<step>/MANIFEST.json     written last: the files, their sizes and SHA-256 sums

A checkpoint is complete only when its manifest exists and every file it names matches its
checksum; a write killed halfway leaves no manifest (or a damaged file), and
:func:`latest_checkpoint` falls back to the previous complete one. Every file is written to a
temporary name, fsynced and renamed.

A worker's state is everything it needs to continue: its step counters, its position in its
data shard, its replica, and its scheme's state (:meth:`WorkerScheme.state_dict`: local
optimizers, windows, elastic variables).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distsgd.util import write_atomic, write_bytes_atomic

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
KEEP = 3
INCOMPLETE = "incomplete (no"
FORMAT = 1


class CheckpointError(ValueError):
    """No usable checkpoint; the message says which and why."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# -- worker state -------------------------------------------------------------------------------
def save_worker_state(path: Path, state: dict[str, Any]) -> None:
    buf = io.BytesIO()
    torch.save({"format": FORMAT, **state}, buf)
    write_bytes_atomic(path, buf.getvalue())


def load_worker_state(path: Path) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(
            f"{path}: not a readable worker state ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a distsgd worker state")
    return state


def worker_files(root: Path, rank: int) -> list[Path]:
    """This worker's saved states, oldest first."""
    return sorted((root / "workers").glob(f"worker{rank}-*.pt"))


def newest_worker_state(root: Path, rank: int) -> Path | None:
    """The newest readable state of worker ``rank`` (damaged ones are skipped)."""
    for path in reversed(worker_files(root, rank)):
        try:
            load_worker_state(path)
            return path
        except CheckpointError as exc:
            log.warning("skipping %s", exc)
    return None


# -- manifests ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Checkpoint:
    """A complete, verified checkpoint."""

    path: Path
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def shard_file(self, index: int) -> Path:
        return self.path / self.manifest["shards"][index]["file"]

    def worker_file(self, rank: int) -> Path:
        return self.path / self.manifest["workers"][rank]["file"]


def verify(path: Path) -> Checkpoint:
    """Read and check one checkpoint folder; :class:`CheckpointError` naming what is wrong."""
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: {INCOMPLETE} {MANIFEST}; the write was interrupted)"
        ) from None
    except ValueError as exc:
        raise CheckpointError(f"{manifest_path}: damaged ({exc})") from None
    try:
        int(manifest["step"])
        entries = [*manifest["shards"], *manifest["workers"]]
        for entry in entries:
            file = path / entry["file"]
            if not file.exists():
                raise CheckpointError(f"{file}: missing")
            if file.stat().st_size != entry["bytes"] or sha256_file(file) != entry["sha256"]:
                raise CheckpointError(
                    f"{file}: damaged (size or SHA-256 differs from the manifest)"
                )
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{manifest_path}: damaged (bad field: {exc!r})") from None
    return Checkpoint(path=path, manifest=manifest)


def checkpoint_dirs(root: Path) -> list[Path]:
    """Checkpoint folders under ``root`` (a run's ``checkpoints/``), oldest first."""
    return sorted(p for p in root.glob("ckpt-*") if p.is_dir())


def latest_checkpoint(root: Path) -> tuple[Checkpoint | None, list[str]]:
    """The newest complete checkpoint, and a line for each newer one that was unusable."""
    problems: list[str] = []
    for path in reversed(checkpoint_dirs(root)):
        try:
            return verify(path), problems
        except CheckpointError as exc:
            problems.append(str(exc))
    return None, problems


class ManifestWriter:
    """(Chief) completes checkpoints in the background, oldest first, on one thread.

    A checkpoint of step k is complete when every worker has saved a state of step k or later
    (asynchronous workers drift apart; a restarted one lags): those files are linked in and the
    manifest is written last. A checkpoint still waiting after ``wait`` seconds is given up.
    Only complete checkpoints count for :data:`KEEP`; pending ones never push a complete one out.
    """

    def __init__(self, root: Path, num_workers: int, wait: float = 60.0) -> None:
        self.root = root
        self.num_workers = num_workers
        self.wait = wait
        self._pending: list[tuple[str, int, list[dict[str, Any]], dict[str, Any], float]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="manifests", daemon=True)
        self._thread.start()

    def complete(
        self, name: str, step: int, shards: list[dict[str, Any]], extra: dict[str, Any]
    ) -> None:
        with self._lock:
            self._pending.append((name, step, shards, extra, time.monotonic() + self.wait))
        self._wake.set()

    def join(self, timeout: float) -> None:
        """Finish what can be finished within ``timeout`` seconds, then stop."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    break
            time.sleep(0.05)
        self._closing = True
        self._wake.set()
        self._thread.join(max(0.0, deadline - time.monotonic()) + 1.0)

    def _run(self) -> None:
        while not self._closing:
            self._wake.wait(0.1)
            self._wake.clear()
            with self._lock:
                pending = list(self._pending)
            for item in pending:
                name, step, shards, extra, give_up = item
                done = self._try(name, step, shards, extra)
                if done or time.monotonic() > give_up:
                    if not done:
                        log.warning(
                            "checkpoint %s: not every worker reached step %d; given up", name, step
                        )
                    with self._lock:
                        self._pending.remove(item)
                    self._prune()

    def _try(
        self, name: str, step: int, shards: list[dict[str, Any]], extra: dict[str, Any]
    ) -> bool:
        newest: list[Path] = []
        for rank in range(self.num_workers):
            files = worker_files(self.root, rank)
            if not files or _step_of(files[-1]) < step:
                return False
            # The state of exactly this step when it is still there: workers of a collective
            # scheme move in lockstep and must resume at the same step.
            exact = [f for f in files if _step_of(f) == step]
            newest.append(exact[0] if exact else files[-1])
        folder = self.root / name
        workers = []
        for rank, source in enumerate(newest):
            target = folder / f"worker{rank}.pt"
            target.unlink(missing_ok=True)
            try:
                os.link(source, target)
            except FileNotFoundError:  # the worker pruned it meanwhile: try again
                return False
            workers.append(
                {
                    "file": target.name,
                    "sha256": sha256_file(target),
                    "bytes": target.stat().st_size,
                    "step": _step_of(source),
                }
            )
        manifest = {
            "format": FORMAT,
            "name": name,
            "step": step,
            "time": time.time(),
            "shards": [{**s, "file": Path(s["file"]).name} for s in shards],
            "workers": workers,
            **extra,
        }
        write_atomic(folder / MANIFEST, json.dumps(manifest, indent=2) + "\n")
        log.info("checkpoint %s complete (%d shards, %d workers)", name, len(shards), len(workers))
        return True

    def _prune(self) -> None:
        """Keep the newest KEEP complete checkpoints and whatever is newer than them."""
        with self._lock:
            waiting = {name for name, *_ in self._pending}
        folders = checkpoint_dirs(self.root)
        complete = [f for f in folders if (f / MANIFEST).exists()]
        if len(complete) <= KEEP:
            return
        oldest_kept = complete[-KEEP]
        for folder in folders:
            if folder < oldest_kept and folder.name not in waiting:
                shutil.rmtree(folder, ignore_errors=True)


def newest_shard_file(root: Path, index: int) -> Path | None:
    """The newest intact ``ps<index>.npz`` under ``root``, complete checkpoint or not.

    Restarting one server wants its own newest state (each shard file is written atomically and
    carries zip checksums); only a whole-run resume needs a manifest's consistent set.
    """
    for folder in reversed(checkpoint_dirs(root)):
        path = folder / f"ps{index}.npz"
        try:
            with zipfile.ZipFile(path) as archive:
                if archive.testzip() is None and "header.npy" in archive.namelist():
                    return path
        except (OSError, zipfile.BadZipFile):
            continue
        log.warning("skipping damaged %s", path)
    return None


def prune_worker_files(root: Path, rank: int) -> None:
    for old in worker_files(root, rank)[:-KEEP]:
        old.unlink(missing_ok=True)


def _step_of(path: Path) -> int:
    return int(path.stem.rsplit("-", 1)[1])


class Checkpointer:
    """Drives checkpoints from inside the training loop (one per worker process).

    Every worker saves its own state when a checkpoint is due (at the start of a step, so the
    data position is exact); the chief then asks every shard to save its state and, in the
    background, completes the manifest.
    """

    def __init__(
        self,
        *,
        run_dir: Path,
        rank: int,
        num_workers: int,
        every_steps: int,
        every_seconds: float,
        wait: float,
    ) -> None:
        self.root = run_dir / "checkpoints"
        self.rank = rank
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.last_time = time.monotonic()
        self.due_step: int | None = None
        self.writer = ManifestWriter(self.root, num_workers, wait) if rank == 0 else None

    def _due(self, local_step: int, start_step: int) -> bool:
        if local_step <= start_step:
            return False
        if self.every_steps and local_step % self.every_steps == 0:
            return True
        return bool(self.every_seconds) and time.monotonic() - self.last_time >= self.every_seconds

    def save_worker(self, state: dict[str, Any], local_step: int) -> None:
        save_worker_state(self.root / "workers" / f"worker{self.rank}-{local_step:08d}.pt", state)
        prune_worker_files(self.root, self.rank)

    def maybe_save_worker(self, local_step: int, start_step: int, state: Any) -> None:
        """``state`` is a callable returning the worker state (built only when due)."""
        self.due_step = None
        if self._due(local_step, start_step):
            self.last_time = time.monotonic()
            self.save_worker(state(), local_step)
            self.due_step = local_step

    def maybe_checkpoint_servers(self, shard_checkpoint: Any, extra: dict[str, Any]) -> None:
        """(Chief, after the step's pull) snapshot every shard and complete the manifest."""
        if self.writer is None or self.due_step is None:
            return
        name = f"ckpt-{self.due_step:08d}"
        try:
            shards = shard_checkpoint(name) if shard_checkpoint is not None else []
        except Exception as exc:  # a server down right now: skip this one, training goes on
            log.warning("checkpoint %s skipped: %s", name, exc)
            return
        (self.root / name).mkdir(parents=True, exist_ok=True)
        self.writer.complete(name, self.due_step, shards, extra)

    def close(self, timeout: float = 5.0) -> None:
        if self.writer is not None:
            self.writer.join(timeout)
