"""Checkpoints of a whole run on disk: the layout, finding the newest usable files, and
verifying manifests, all without torch.

Layout under ``<run dir>/checkpoints/``::

    workers/worker<i>-<step>.pt   each worker's state, saved when due (newest 3 kept)
    workers/worker<i>-<step>.json its sidecar: the state file's size and SHA-256
    ckpt-<step>/ps<j>.npz         each shard's state (written by the shard on the chief's call)
    ckpt-<step>/worker<i>.pt      hard links to the workers' state files the manifest names
    ckpt-<step>/MANIFEST.json     written last: the files, their sizes and SHA-256 sums

A checkpoint is complete only when its manifest exists and every file it names matches its
checksum; a write killed halfway leaves no manifest (or a damaged file), and
:func:`latest_checkpoint` falls back to the previous complete one. Every file is written to a
temporary name, fsynced and renamed. A worker state file holding Python objects beyond tensors
and plain containers is refused (:class:`UnsafeFileError`) by reading its pickle's opcodes
(:mod:`distsgd.control.checkpoint.safety`); the shard file's own reader is
:func:`distsgd.ps.shard_file.read_shard_header`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distsgd.control.checkpoint.errors import (
    CheckpointError,
    IncompleteCheckpoint,
    UnsafeFileError,
    refuse_code,
)
from distsgd.control.checkpoint.safety import unsafe_globals
from distsgd.ps import wal
from distsgd.ps.shard_file import (
    CorruptCheckpoint,
    read_shard_header,
    shard_file_intact,
    shard_file_name,
)
from distsgd.util import file_digest, write_atomic

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
SHARDS_PREFIX = "shards-"
"""Folders of server-only checkpoints (``shards-<version>/ps<j>.npz``, no manifest) that the
chief takes while it waits for the other workers to finish."""
KEEP = 3
"""Complete checkpoints kept (of a size under :data:`LARGE_CHECKPOINT`), and saved states
kept per worker."""
LARGE_CHECKPOINT = 256 * 2**20
"""Bytes (every worker state and shard file of one checkpoint) from which only two complete
checkpoints are kept: with the next one being written, a run folder then holds about three
checkpoints' bytes, not four, and a crash while one is written still leaves the newest
complete one and the one before it."""


def keep_count(checkpoint_bytes: int) -> int:
    """How many complete checkpoints to keep when the newest holds ``checkpoint_bytes``."""
    return 2 if checkpoint_bytes >= LARGE_CHECKPOINT else KEEP


def checkpoint_bytes(folder: Path) -> int:
    """The bytes a complete checkpoint's manifest names (its shards and worker states); 0 for
    a manifest that cannot be read."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        return sum(int(e["bytes"]) for e in [*manifest["shards"], *manifest["workers"]])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


FORMAT = 1
"""The manifest's format."""

WORKER_FILE = re.compile(r"worker(\d+)-(\d+)\.pt")
"""``workers/worker<i>-<step>.pt``: a worker's saved state (step zero-padded to 8 digits)."""


# -- worker files -------------------------------------------------------------------------------
def worker_file(root: Path, rank: int, step: int) -> Path:
    """Where worker ``rank`` saves its state of local step ``step`` under ``root``."""
    return root / "workers" / f"worker{rank}-{step:08d}.pt"


def worker_state_step(path: Path) -> int:
    """The local step a ``workers/worker<i>-<step>.pt`` file was saved at, from its name alone
    (nothing is read); :class:`CheckpointError` for another name."""
    match = WORKER_FILE.fullmatch(path.name)
    if match is None:
        raise CheckpointError(
            f"{path}: not a worker state file name (worker<i>-<step>.pt); give a file of "
            "checkpoints/workers/"
        )
    return int(match.group(2))


def worker_files(root: Path, rank: int) -> list[Path]:
    """This worker's saved states, oldest first."""
    return sorted(
        path
        for path in (root / "workers").glob(f"worker{rank}-*.pt")
        if (match := WORKER_FILE.fullmatch(path.name)) and int(match.group(1)) == rank
    )


def sidecar(path: Path) -> Path:
    """The JSON beside a worker state file: its size and SHA-256 as written."""
    return path.with_suffix(".json")


def write_sidecar(path: Path, data: bytes | None = None) -> None:
    """Record the state file ``path`` just written with ``data`` (None: read it back, in
    blocks, for a file written as it was made)."""
    if data is None:
        digest, size = file_digest(path)
    else:
        digest, size = hashlib.sha256(data).hexdigest(), len(data)
    write_atomic(sidecar(path), json.dumps({"bytes": size, "sha256": digest}) + "\n")


def _zip_intact(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip() is None
    except (OSError, zipfile.BadZipFile, EOFError, ValueError):
        return False


def check_worker_file(path: Path) -> None:
    """Check a worker state file without torch: its size and SHA-256 against its sidecar (a
    missing sidecar is derived once the zip's checksums pass), and its pickle for Python
    objects (:class:`UnsafeFileError`); :class:`CheckpointError` for a damaged file."""
    try:
        recorded = json.loads(sidecar(path).read_text())
        size, digest = int(recorded["bytes"]), str(recorded["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        size, digest = -1, ""
    found = unsafe_globals(path)
    if found:
        raise refuse_code(path, found)
    if digest:
        if path.stat().st_size != size or file_digest(path)[0] != digest:
            raise CheckpointError(f"{path}: damaged (size or SHA-256 differs from its sidecar)")
        return
    if not _zip_intact(path):
        raise CheckpointError(f"{path}: damaged (a zip checksum fails)")
    try:
        write_sidecar(path)
    except OSError as exc:  # a read-only copy of a run folder: derived again next time
        log.debug("no sidecar for %s: %s", path, exc)


def newest_worker_state(root: Path, rank: int) -> Path | None:
    """The newest usable state of worker ``rank`` (damaged ones, and ones holding Python
    objects, are skipped: a single worker's restart never loads them)."""
    for path in reversed(worker_files(root, rank)):
        try:
            check_worker_file(path)
            return path
        except CheckpointError as exc:
            log.warning("skipping %s", exc)
    return None


def prune_worker_files(root: Path, rank: int, num_workers: int = 1) -> None:
    """Keep this worker's newest states (and their sidecars): as many as complete checkpoints
    are kept (:func:`keep_count`) of ``num_workers`` states the size of its newest, so that
    ``workers/`` holds no state that no kept checkpoint holds too (they link the same files)."""
    files = worker_files(root, rank)
    try:
        keep = keep_count(num_workers * files[-1].stat().st_size) if files else KEEP
    except OSError:  # pruned meanwhile (another incarnation of this worker)
        keep = KEEP
    for old in files[:-keep]:
        old.unlink(missing_ok=True)
        sidecar(old).unlink(missing_ok=True)


def remove_stale_temps(root: Path, rank: int) -> None:
    """Remove the temporary files a write of this worker's state left behind (a crash, or a
    writer killed, mid-write; an atomic write renames its temporary file only when whole)."""
    for tmp in (root / "workers").glob(f".worker{rank}-*.tmp"):  # a state's or its sidecar's
        tmp.unlink(missing_ok=True)


@dataclass(frozen=True, kw_only=True)
class WorkerStateRef:
    """A worker's saved state."""

    path: Path
    """The state file."""
    step: int
    """The local step it was saved at (from its name)."""


@dataclass(frozen=True, kw_only=True)
class ShardRef:
    """A shard file."""

    path: Path
    """The ``ps<j>.npz`` file."""
    version: int
    """The shard's version in it (from its header)."""


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


def _check_entries(path: Path, manifest: dict[str, Any]) -> None:
    int(manifest["step"])
    for entry in [*manifest["shards"], *manifest["workers"]]:
        file = path / entry["file"]
        if not file.exists():
            raise CheckpointError(f"{file}: missing")
        if file.stat().st_size != entry["bytes"] or file_digest(file)[0] != entry["sha256"]:
            raise CheckpointError(f"{file}: damaged (size or SHA-256 differs from the manifest)")
    # The checksums only say the files are the ones the manifest names (whoever wrote one
    # could write the other): each worker state's pickle is also read for Python objects.
    for entry in manifest["workers"]:
        file = path / entry["file"]
        found = unsafe_globals(file)
        if found:
            raise UnsafeFileError(
                f"{refuse_code(file, found)}; move {path} out of {path.parent} to use an "
                "older checkpoint"
            )


def verify(path: Path) -> Checkpoint:
    """Read and check one checkpoint folder; :class:`CheckpointError` naming what is wrong."""
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise IncompleteCheckpoint(
            f"{path}: incomplete (no {MANIFEST}; still being written, or interrupted)"
        ) from None
    except ValueError as exc:
        raise CheckpointError(f"{manifest_path}: damaged ({exc})") from None
    try:
        _check_entries(path, manifest)
    except CheckpointError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise CheckpointError(f"{manifest_path}: damaged (bad field: {exc!r})") from None
    return Checkpoint(path=path, manifest=manifest)


def checkpoint_dirs(root: Path) -> list[Path]:
    """Checkpoint folders under ``root`` (a run's ``checkpoints/``), oldest first."""
    return sorted(p for p in root.glob("ckpt-*") if p.is_dir())


def latest_checkpoint(root: Path) -> tuple[Checkpoint | None, list[CheckpointError]]:
    """The newest complete checkpoint, and why each newer one was unusable.

    A damaged or incomplete checkpoint is skipped for an older one; one holding a file with
    Python objects raises :class:`UnsafeFileError` (a resume from it must not go on quietly).
    """
    problems: list[CheckpointError] = []
    for path in reversed(checkpoint_dirs(root)):
        try:
            return verify(path), problems
        except UnsafeFileError:
            raise
        except CheckpointError as exc:
            problems.append(exc)
    return None, problems


def complete_checkpoints(root: Path) -> list[Checkpoint]:
    """Every complete, intact checkpoint under ``root``, oldest first (as
    :func:`latest_checkpoint` judges each: a damaged or incomplete one is left out, one holding
    Python objects raises)."""
    found = []
    for path in checkpoint_dirs(root):
        try:
            found.append(verify(path))
        except UnsafeFileError:
            raise
        except CheckpointError:
            continue
    return found


DIVERGED = "diverged"
"""The folder under ``checkpoints/`` that a rollback moves what it went back past into (it
holds the diverged state): out of every resume's and restart's reach, kept to be looked at."""


def set_aside(root: Path, newer: Iterable[Checkpoint], *, after_step: int) -> None:
    """Move the checkpoints ``newer``, every server-only one (:data:`SHARDS_PREFIX`) and every
    worker state saved after local step ``after_step`` into ``root/diverged/``, in place of
    what an earlier rollback set aside there (one rollback's worth is kept)."""
    moving = [c.path for c in newer if c.path.parent == root]
    moving += [p for p in root.glob(f"{SHARDS_PREFIX}*") if p.is_dir()]
    states = [p for p in (root / "workers").glob("worker*.pt") if WORKER_FILE.fullmatch(p.name)]
    states = [p for p in states if worker_state_step(p) > after_step]
    if not moving and not states:
        return
    aside = root / DIVERGED
    shutil.rmtree(aside, ignore_errors=True)
    (aside / "workers").mkdir(parents=True)
    for path in moving:
        path.rename(aside / path.name)
    for path in states:
        path.rename(aside / "workers" / path.name)
        if sidecar(path).exists():
            sidecar(path).rename(aside / "workers" / sidecar(path).name)


# -- shard files --------------------------------------------------------------------------------
def newest_shard_file(root: Path, index: int) -> Path | None:
    """The intact ``ps<index>.npz`` under ``root`` (in any folder of it) whose header holds the
    highest version, complete checkpoint or not.

    Restarting one server wants its own newest state (each shard file is written atomically and
    carries zip checksums); only a whole-run resume needs a manifest's consistent set. Headers
    are read first; the zip checksums only of the chosen file (and of any that fail them).
    """
    found: list[tuple[int, Path]] = []
    for path in root.glob(f"*/{shard_file_name(index)}"):
        try:
            header = read_shard_header(path)
        except CorruptCheckpoint as exc:
            log.warning("skipping %s", exc)
            continue
        if header.index != index:
            log.warning("skipping %s: it holds shard %d, not %d", path, header.index, index)
            continue
        found.append((header.version, path))
    for _, path in sorted(found, reverse=True):  # highest version; a tie: the later folder
        if shard_file_intact(path):
            return path
        log.warning("skipping damaged %s", path)
    return None


def prune_shard_dirs(root: Path, keep: int = 2) -> None:
    """Keep the newest ``keep`` server-only checkpoints (:data:`SHARDS_PREFIX` folders)."""
    folders = sorted(p for p in root.glob(f"{SHARDS_PREFIX}*") if p.is_dir())
    for old in folders[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


class DiskStore:
    """The checkpoints of a run folder as the restart planner sees them
    (:class:`distsgd.control.recovery.StoreView`)."""

    def __init__(self, root: Path, wal_root: Path | None = None) -> None:
        self.root = root
        """The run's ``checkpoints/``."""
        self.wal_root = wal_root
        """Where each server's write-ahead log is (``ps<j>/``; None: no logs)."""

    def latest(self) -> Checkpoint | None:
        return latest_checkpoint(self.root)[0]

    def newest_worker(self, index: int) -> WorkerStateRef | None:
        path = newest_worker_state(self.root, index)
        return None if path is None else WorkerStateRef(path=path, step=worker_state_step(path))

    def newest_shard(self, index: int) -> ShardRef | None:
        path = newest_shard_file(self.root, index)
        return (
            None if path is None else ShardRef(path=path, version=read_shard_header(path).version)
        )

    def has_wal(self, index: int) -> bool:
        return self.wal_root is not None and wal.has_state(self.wal_root / f"ps{index}")
