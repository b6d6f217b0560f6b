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

Nothing in a file distsgd reads can run code. A worker state holds only plain data (dicts,
lists, tuples, str, int, float, bool, None and torch tensors; numpy arrays are stored as tensors
and given back as arrays) and is read with ``torch.load(weights_only=True)``; a value of any other
type is refused when the state is saved (:class:`UnsavableStateError`, naming it), and a file
holding Python objects is refused when read (:class:`UnsafeFileError`, naming the file). Shard
files are ``.npz`` archives read with ``allow_pickle=False``; :func:`read_shard_header` is the one
reader of their JSON header.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import threading
import time
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distsgd.ps.shard import CHECKPOINT_FORMAT as SHARD_FORMAT
from distsgd.util import private_dir, write_atomic, write_bytes_atomic

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
SHARDS_PREFIX = "shards-"
"""Folders of server-only checkpoints (``shards-<version>/ps<j>.npz``, no manifest) that the
chief takes while it waits for the other workers to finish."""
KEEP = 3
FORMAT = 1
"""The manifest's format."""
WORKER_FORMAT = 2
"""The worker state's format: 2 stores numpy arrays as tensors (1 pickled them)."""
READABLE_WORKER_FORMATS = (1, 2)
"""A format-1 state without numpy arrays is a format-2 state; one with them holds pickled
numpy objects and is refused like any other file with Python objects."""

WORKER_FILE = re.compile(r"worker(\d+)-(\d+)\.pt")
"""``workers/worker<i>-<step>.pt``: a worker's saved state (step zero-padded to 8 digits)."""


class CheckpointError(ValueError):
    """No usable checkpoint; the message says which and why."""


class IncompleteCheckpoint(CheckpointError):
    """A checkpoint folder without its manifest: being written now, or its write was cut off."""


class UnsafeFileError(CheckpointError):
    """A file holds Python objects that could run code when loaded; it is never loaded.

    Unlike a damaged file, which is skipped for an older one, this one stops a resume: someone
    wrote it on purpose, and the user has to look.
    """


class UnsavableStateError(ValueError):
    """A worker state holds a value a state file cannot (raised when it is saved)."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# -- plain state --------------------------------------------------------------------------------
_SCALARS = (type(None), bool, int, float, str)
_ARRAY = "__ndarray__"  # {_ARRAY: tensor}: a numpy array in a file ("scalar": True: a numpy scalar)
_ARRAY_DTYPES = frozenset(
    np.dtype(name)
    for name in (
        *("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"),
        *("float16", "float32", "float64", "complex64", "complex128"),
    )
)
_PLAIN = (
    "a worker state file holds only torch tensors, numpy arrays of numbers, dict (str or int "
    "keys), list, tuple, str, int, float, bool and None"
)


def _walk(
    value: Any,
    where: str,
    tensor: Callable[[torch.Tensor], Any],
    array: Callable[[np.ndarray | np.generic, str], Any],
) -> Any:
    """``value`` rebuilt with ``tensor`` and ``array`` applied to its leaves of those types;
    :class:`UnsavableStateError` naming ``where`` (its path in the state) for anything else."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if isinstance(value, torch.Tensor):
        return tensor(value)
    if isinstance(value, np.ndarray | np.generic):
        if value.dtype not in _ARRAY_DTYPES or not value.dtype.isnative:
            raise UnsavableStateError(
                f"{where}: a numpy array of dtype {value.dtype.str} cannot be saved ({_PLAIN}, "
                "arrays of bool, ints, uints, float16-64 or complex); convert it to one of those"
            )
        return array(value, where)
    if kind is dict or kind is OrderedDict:
        out = kind()
        for key, item in value.items():
            if type(key) not in (str, int) or key == _ARRAY:
                raise UnsavableStateError(
                    f"{where}: key {key!r} cannot be saved ({_PLAIN}; {_ARRAY!r} is reserved); "
                    "use str or int keys"
                )
            out[key] = _walk(item, f"{where}[{key!r}]", tensor, array)
        return out
    if kind is list or kind is tuple:
        return kind(_walk(v, f"{where}[{i}]", tensor, array) for i, v in enumerate(value))
    hint = "; store a sorted list" if isinstance(value, set | frozenset) else ""
    raise UnsavableStateError(
        f"{where}: a {kind.__module__}.{kind.__qualname__} cannot be saved ({_PLAIN}){hint}; "
        "keep the scheme's state in those types, or override state_dict and load_state_dict"
    )


def plain_state(value: Any, where: str, *, copy: bool = True) -> Any:
    """``value`` as a worker state file can hold it: a deep copy (tensors detached and cloned)
    when ``copy``, else the same leaves in rebuilt containers.

    :class:`UnsavableStateError` names ``where`` and the path inside it for a value of any other
    type, so a scheme learns what it cannot save when it saves, not when it resumes.
    """
    if copy:
        return _walk(
            value,
            where,
            lambda t: t.detach().clone(),
            lambda a, _: a if isinstance(a, np.generic) else a.copy(),
        )
    return _walk(value, where, lambda t: t, lambda a, _: a)


def _encode_array(a: np.ndarray | np.generic, where: str) -> dict[str, Any]:
    tensor = torch.from_numpy(np.array(a, order="C"))  # a copy: np.generic becomes 0-d
    return {_ARRAY: tensor, "scalar": True} if isinstance(a, np.generic) else {_ARRAY: tensor}


def _decode(value: Any) -> Any:
    """The inverse of the encoding in :func:`save_worker_state`: numpy arrays back."""
    if type(value) is dict and _ARRAY in value:
        array = value[_ARRAY].numpy()
        return array[()] if value.get("scalar") else array
    if type(value) is dict or type(value) is OrderedDict:
        return type(value)((k, _decode(v)) for k, v in value.items())
    if type(value) is list or type(value) is tuple:
        return type(value)(_decode(v) for v in value)
    return value


# -- worker state -------------------------------------------------------------------------------
_COUNTERS = ("worker", "local_step", "global_step", "steps")


def _structure_problem(state: Any) -> str | None:
    """What is wrong with a worker state's top level (``None``: nothing)."""
    if not isinstance(state, Mapping):
        return f"a {type(state).__name__}, not a dict"
    required = ("format", *_COUNTERS, "position", "model", "scheme", "scheme_name")
    missing = [key for key in required if key not in state]
    if len(missing) == len(required) and all(isinstance(v, torch.Tensor) for v in state.values()):
        return f"a model's state_dict of {len(state)} tensors, like final_model.pt"
    if missing:
        return "no " + ", ".join(repr(k) for k in missing)
    if state["format"] not in READABLE_WORKER_FORMATS:
        return f"format {state['format']!r}; this distsgd reads {READABLE_WORKER_FORMATS}"
    for key in _COUNTERS:
        if type(state[key]) is not int or state[key] < 0:
            return f"{key!r} is {state[key]!r}, not a count"
    position = state["position"]
    if position is not None and not (  # None: the loop read data of its own
        isinstance(position, list | tuple)
        and len(position) == 2
        and all(type(p) is int for p in position)
    ):
        return f"'position' is {position!r}, not (epoch, batch)"
    model = state["model"]
    if not isinstance(model, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()
    ):
        return "'model' is not a state_dict of tensors"
    if not isinstance(state["scheme"], Mapping):
        return f"'scheme' is a {type(state['scheme']).__name__}, not a dict"
    if not isinstance(state["scheme_name"], str):
        return f"'scheme_name' is {state['scheme_name']!r}, not a name"
    return None


def save_worker_state(path: Path, state: Mapping[str, Any]) -> None:
    """Write a worker's state (``worker``, ``local_step``, ``global_step``, ``steps``,
    ``position``, ``model``, ``scheme``, ``scheme_name``) atomically.

    :class:`UnsavableStateError` if it lacks one of those or holds a value a file cannot hold
    (see :func:`plain_state`); numpy arrays are stored as tensors.
    """
    full = {**state, "format": WORKER_FORMAT}
    problem = _structure_problem(full)
    if problem is not None:
        raise UnsavableStateError(f"worker state for {path.name}: {problem}")
    # The replica as it is (its state_dict's metadata included); the rest encoded.
    encoded = {
        key: value if key == "model" else _walk(value, key, lambda t: t, _encode_array)
        for key, value in full.items()
    }
    buf = io.BytesIO()
    torch.save(encoded, buf)
    write_bytes_atomic(path, buf.getvalue())


def _unsafe_globals(path: Path) -> list[str]:
    """The Python objects (``module.name``) in a ``torch.save`` file that ``weights_only``
    refuses, found by reading its pickle's opcodes (nothing is run)."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # not a zip torch.save wrote: torch.load says what it is
        return []


def _refuse_code(path: Path, found: list[str]) -> UnsafeFileError:
    what = f": {', '.join(found[:3])}{', ...' if len(found) > 3 else ''}" if found else ""
    return UnsafeFileError(
        f"{path}: not a distsgd worker state (it holds Python objects that could run code"
        f"{what}; distsgd never loads those)"
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def _read_worker_state(path: Path, *, mmap: bool) -> dict[str, Any]:
    """Load and check a worker state without running anything in it (``mmap``: the tensors
    stay on disk until touched, for a check that does not need them)."""
    found = _unsafe_globals(path)
    if found:
        raise _refuse_code(path, found)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:  # weights_only refused what the file holds
        if zipfile.is_zipfile(path):
            raise _refuse_code(path, []) from None
        raise CheckpointError(f"{path}: not a readable worker state ({_first_line(exc)})") from None
    except Exception as exc:
        raise CheckpointError(f"{path}: not a readable worker state ({_first_line(exc)})") from None
    problem = _structure_problem(state)
    if problem is not None:
        raise CheckpointError(f"{path}: not a distsgd worker state ({problem})")
    return {key: value if key == "model" else _decode(value) for key, value in state.items()}


def load_worker_state(path: Path) -> dict[str, Any]:
    """A worker's state as :func:`save_worker_state` was given it (numpy arrays back).

    Read with ``torch.load(weights_only=True)``: :class:`UnsafeFileError` for a file holding
    Python objects (it is never loaded), :class:`CheckpointError` for a damaged one or one
    without the keys and types of a worker state.
    """
    return _read_worker_state(path, mmap=False)


def check_worker_state(path: Path) -> None:
    """:func:`load_worker_state`'s checks without reading the tensors (memory-mapped)."""
    _read_worker_state(path, mmap=True)


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


def newest_worker_state(root: Path, rank: int) -> Path | None:
    """The newest usable state of worker ``rank`` (damaged ones, and ones holding Python
    objects, are skipped: a single worker's restart never loads them)."""
    for path in reversed(worker_files(root, rank)):
        try:
            check_worker_state(path)
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
        raise IncompleteCheckpoint(
            f"{path}: incomplete (no {MANIFEST}; still being written, or interrupted)"
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
        # The checksums only say the files are the ones the manifest names (whoever wrote one
        # could write the other): each worker state is also read the safe way, and checked.
        for entry in manifest["workers"]:
            try:
                check_worker_state(path / entry["file"])
            except UnsafeFileError as exc:
                raise UnsafeFileError(
                    f"{exc}; move {path} out of {path.parent} to use an older checkpoint"
                ) from None
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
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
            if not files or worker_state_step(files[-1]) < step:
                return False
            # The state of exactly this step when it is still there: workers of a collective
            # scheme move in lockstep and must resume at the same step.
            exact = [f for f in files if worker_state_step(f) == step]
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
                    "step": worker_state_step(source),
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


# -- shard files --------------------------------------------------------------------------------
_SHARD_HEADER: dict[str, type | tuple[type, ...]] = {
    "index": int,
    "version": int,
    "num_workers": int,
    "scheme": str,
    "keys": list,
    "finished": list,
    "rule": dict,
}


def _not_a_shard(path: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: not a distsgd shard checkpoint ({why}); give a psN.npz of a checkpoint"
    )


def read_shard_header(path: Path) -> dict[str, Any]:
    """The JSON header of a shard file (``ps<j>.npz``, written by ``Shard.to_bytes``), read
    without the parameters and without pickle; :class:`CheckpointError` naming the file when it
    is no shard file. Keys: ``index``, ``version``, ``scheme``, ``num_workers``, ``keys`` (the
    parameters), ``finished``, ``rule`` (the rule's non-array state), push counters, ..."""
    if not zipfile.is_zipfile(path):
        raise _not_a_shard(path, "not an .npz archive")
    try:
        with np.load(path, allow_pickle=False) as npz:
            if "header" not in npz.files:
                raise _not_a_shard(path, "no header")
            raw = npz["header"]
    except CheckpointError:
        raise
    except ValueError:  # numpy: an object array, which would need pickle
        raise _not_a_shard(path, "its header is not plain data") from None
    except Exception as exc:  # zip, zlib, truncated member
        raise _not_a_shard(path, f"damaged: {_first_line(exc)}") from None
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise _not_a_shard(path, f"its header is {raw.dtype.name}{list(raw.shape)}, not JSON")
    try:
        header = json.loads(raw.tobytes())
    except ValueError:
        raise _not_a_shard(path, "its header is not JSON") from None
    if not isinstance(header, dict):
        raise _not_a_shard(path, "its header is not a JSON object")
    if header.get("format") != SHARD_FORMAT:
        raise _not_a_shard(path, f"shard format {header.get('format')!r}, not {SHARD_FORMAT}")
    for key, kind in _SHARD_HEADER.items():
        if key not in header:
            raise _not_a_shard(path, f"its header has no {key!r}")
        if not isinstance(header[key], kind) or isinstance(header[key], bool):
            raise _not_a_shard(path, f"its header's {key!r} is {header[key]!r}")
    return header


def _zip_intact(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip() is None
    except (OSError, zipfile.BadZipFile, EOFError, ValueError):
        return False


def newest_shard_file(root: Path, index: int) -> Path | None:
    """The intact ``ps<index>.npz`` under ``root`` (in any folder of it) whose header holds the
    highest version, complete checkpoint or not.

    Restarting one server wants its own newest state (each shard file is written atomically and
    carries zip checksums); only a whole-run resume needs a manifest's consistent set. Headers
    are read first; the zip checksums only of the chosen file (and of any that fail them).
    """
    found: list[tuple[int, Path]] = []
    for path in root.glob(f"*/ps{index}.npz"):
        try:
            header = read_shard_header(path)
        except CheckpointError as exc:
            log.warning("skipping %s", exc)
            continue
        if header["index"] != index:
            log.warning("skipping %s: it holds shard %d, not %d", path, header["index"], index)
            continue
        found.append((header["version"], path))
    for _, path in sorted(found, reverse=True):  # highest version; a tie: the later folder
        if _zip_intact(path):
            return path
        log.warning("skipping damaged %s", path)
    return None


def prune_shard_dirs(root: Path, keep: int = 2) -> None:
    """Keep the newest ``keep`` server-only checkpoints (:data:`SHARDS_PREFIX` folders)."""
    folders = sorted(p for p in root.glob(f"{SHARDS_PREFIX}*") if p.is_dir())
    for old in folders[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def prune_worker_files(root: Path, rank: int) -> None:
    for old in worker_files(root, rank)[:-KEEP]:
        old.unlink(missing_ok=True)


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
        self.count = 0
        """Checkpoints this worker took part in (its state saved when due)."""
        self.seconds = 0.0
        """Seconds the training loop spent in them: saving the state, and on the chief asking
        the servers for theirs (what checkpoints cost this worker in training time)."""

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
            started = self.last_time = time.monotonic()
            self.save_worker(state(), local_step)
            self.due_step = local_step
            self.count += 1
            self.seconds += time.monotonic() - started

    def maybe_checkpoint_servers(self, shard_checkpoint: Any, extra: dict[str, Any]) -> None:
        """(Chief, after the step's pull) snapshot every shard and complete the manifest."""
        if self.writer is None or self.due_step is None:
            return
        name = f"ckpt-{self.due_step:08d}"
        started = time.monotonic()
        try:
            shards = shard_checkpoint(name) if shard_checkpoint is not None else []
        except Exception as exc:  # a server down right now: skip this one, training goes on
            log.warning("checkpoint %s skipped: %s", name, exc)
            return
        finally:
            self.seconds += time.monotonic() - started
        private_dir(self.root / name)
        self.writer.complete(name, self.due_step, shards, extra)

    def close(self, timeout: float = 5.0) -> None:
        if self.writer is not None:
            self.writer.join(timeout)
