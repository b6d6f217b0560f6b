"""A worker's state file, the torch half of a checkpoint: the plain-state codec, saving and
loading a worker's state, and the worker-side :class:`Checkpointer`.

A worker's state is everything it needs to continue: its step counters, its position in its
data shard, its replica, and its scheme's state (:meth:`WorkerScheme.state_dict`: local
optimizers, windows, elastic variables). The layout of a run's checkpoints, their manifests and
the choice of a file to resume from need no torch: :mod:`distsgd.control.checkpoint.store`.

Nothing in a file distsgd reads can run code. A worker state holds only plain data (dicts,
lists, tuples, str, int, float, bool, None and torch tensors; numpy arrays are stored as tensors
and given back as arrays) and is read with ``torch.load(weights_only=True)``; a value of any other
type is refused when the state is saved (:class:`UnsavableStateError`, naming it), and a file
holding Python objects is refused when read (:class:`UnsafeFileError`, naming the file).
"""

from __future__ import annotations

import logging
import pickle
import time
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distsgd.control.checkpoint.errors import CheckpointError, first_line, refuse_code
from distsgd.control.checkpoint.manifests import ManifestWriter
from distsgd.control.checkpoint.store import (
    prune_worker_files,
    remove_stale_temps,
    worker_file,
    worker_state_step,
    write_sidecar,
)
from distsgd.runtime import state_writer
from distsgd.runtime.state_writer import CAN_FORK, BackgroundWrite, WriteOutcome, outcome_of
from distsgd.util import private_dir

log = logging.getLogger(__name__)

WORKER_FORMAT = 2
"""The worker state's format: 2 stores numpy arrays as tensors (1 pickled them)."""
READABLE_WORKER_FORMATS = (1, 2)
"""A format-1 state without numpy arrays is a format-2 state; one with them holds pickled
numpy objects and is refused like any other file with Python objects."""


class UnsavableStateError(ValueError):
    """A worker state holds a value a state file cannot (raised when it is saved)."""


# -- plain state --------------------------------------------------------------------------------
_SCALARS = (type(None), bool, int, float, str)
_ARRAY = "__ndarray__"  # {_ARRAY: tensor}: a numpy array in a file ("scalar": True: a numpy scalar)
_ARRAY_DTYPES = frozenset(
    np.dtype(t)
    for t in (
        *(np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32),
        *(np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128),
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
    # No copy of a writable C-ordered array: the state is a copy already (WorkerScheme's
    # state_dict), or written by a forked process from its snapshot. np.generic becomes 0-d.
    plain = isinstance(a, np.ndarray) and a.flags.c_contiguous and a.flags.writeable
    tensor = torch.from_numpy(a if plain else np.array(a, order="C"))  # type: ignore[arg-type]
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
    if type(state.get("replica_from_servers", False)) is not bool:
        return f"'replica_from_servers' is {state['replica_from_servers']!r}, not a bool"
    return None


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself on the CPU, else a copy there (a forked writer must not touch a GPU)."""
    return tensor if tensor.device.type == "cpu" else tensor.detach().cpu()


def encode_worker_state(path: Path, state: Mapping[str, Any]) -> dict[str, Any]:
    """What :func:`save_worker_state` writes for ``state``: checked (:class:`UnsavableStateError`
    naming ``path``'s file), numpy arrays as tensors, tensors on the CPU; no other copy."""
    full = {**state, "format": WORKER_FORMAT}
    problem = _structure_problem(full)
    if problem is not None:
        raise UnsavableStateError(f"worker state for {path.name}: {problem}")
    encoded = {
        key: _walk(value, key, _host, _encode_array)
        for key, value in full.items()
        if key != "model"
    }
    model = state["model"]  # a state_dict's metadata (its version per module) stays with it
    encoded["model"] = type(model)((k, _host(v)) for k, v in model.items())
    if hasattr(model, "_metadata"):
        encoded["model"]._metadata = model._metadata
    return encoded


def save_worker_state(path: Path, state: Mapping[str, Any]) -> None:
    """Write a worker's state (``worker``, ``local_step``, ``global_step``, ``steps``,
    ``position``, ``model``, ``scheme``, ``scheme_name``) atomically.

    :class:`UnsavableStateError` if it lacks one of those or holds a value a file cannot hold
    (see :func:`plain_state`); numpy arrays are stored as tensors.
    """
    state_writer.write_state_file(path, encode_worker_state(path, state))
    write_sidecar(path)


def replica_state(model: torch.nn.Module, left_out: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """``model.state_dict()`` without the entries that are ``left_out``'s tensors (by storage:
    a tied weight's second name goes too): a replica whose exchanged parameters the servers
    hold and a resumed worker pulls (:attr:`WorkerScheme.replica_from_servers`)."""
    state = model.state_dict()
    if not left_out:
        return state
    held = {t.untyped_storage().data_ptr() for t in left_out.values()}
    for key in [k for k, v in state.items() if v.untyped_storage().data_ptr() in held]:
        del state[key]
    return state


def load_replica(
    model: torch.nn.Module, state: Mapping[str, Any], exchanged: Mapping[str, Any]
) -> None:
    """Load a saved replica into ``model``; one saved without its exchanged parameters
    (``replica_from_servers``) must lack only those (or their tied names): they are pulled
    before the first step."""
    if not state.get("replica_from_servers", False):
        model.load_state_dict(state["model"])
        return
    found = model.load_state_dict(state["model"], strict=False)
    held = {t.untyped_storage().data_ptr() for t in exchanged.values()}
    params = model.state_dict()
    missing = [k for k in found.missing_keys if params[k].untyped_storage().data_ptr() not in held]
    if missing or found.unexpected_keys:
        raise CheckpointError(
            f"worker state of step {state['local_step']} does not fit this model "
            f"(missing {missing[:3]}, unexpected {found.unexpected_keys[:3]}); resume with "
            "the script and model it was saved with"
        )


def _unsafe_globals(path: Path) -> list[str]:
    """The Python objects (``module.name``) in a ``torch.save`` file that ``weights_only``
    refuses, found by reading its pickle's opcodes (nothing is run)."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # not a zip torch.save wrote: torch.load says what it is
        return []


def load_worker_state(path: Path) -> dict[str, Any]:
    """A worker's state as :func:`save_worker_state` was given it (numpy arrays back).

    Read with ``torch.load(weights_only=True)``: :class:`UnsafeFileError` for a file holding
    Python objects (it is never loaded), :class:`CheckpointError` for a damaged one or one
    without the keys and types of a worker state.
    """
    found = _unsafe_globals(path)
    if found:
        raise refuse_code(path, found)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # weights_only refused what the file holds
        if zipfile.is_zipfile(path):
            raise refuse_code(path, []) from None
        raise CheckpointError(f"{path}: not a readable worker state ({first_line(exc)})") from None
    except Exception as exc:
        raise CheckpointError(f"{path}: not a readable worker state ({first_line(exc)})") from None
    problem = _structure_problem(state)
    if problem is not None:
        raise CheckpointError(f"{path}: not a distsgd worker state ({problem})")
    return {key: value if key == "model" else _decode(value) for key, value in state.items()}


class Checkpointer:
    """Drives checkpoints from inside the training loop (one per worker process).

    Every worker saves its own state when a checkpoint is due (at the start of a step, so the
    data position is exact); the chief's manifest writer, in the background, has every shard
    save its state once every worker's state is there, then completes the manifest.

    A worker's state is written in the background (``background``, where ``os.fork`` exists):
    the loop builds the state and forks a writer that saves it from that snapshot
    (:mod:`distsgd.runtime.state_writer`), then trains on. A checkpoint due while the previous
    one is still being written waits for it (counted in :attr:`waited`, logged): every due
    checkpoint is taken, and the cadence holds.
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
        background: bool = True,
    ) -> None:
        self.root = run_dir / "checkpoints"
        self.rank = rank
        self.num_workers = num_workers
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.background = background and CAN_FORK
        self.last_time = time.monotonic()
        self.due_step: int | None = None
        self.writer = ManifestWriter(self.root, num_workers, wait) if rank == 0 else None
        self.count = 0
        """Checkpoints this worker took part in (its state written when due)."""
        self.seconds = 0.0
        """Seconds the training loop spent in them: building the state and starting its
        write, waiting for a previous write, and on the chief asking the manifest writer for
        the servers' (what checkpoints cost this worker in training time)."""
        self.skipped = 0
        """Checkpoints this worker skipped: the disk was full (ENOSPC, EDQUOT), or their writer
        hung and was killed."""
        self.waited = 0
        """Checkpoints that came due while the previous state was still being written."""
        self._writing: BackgroundWrite | None = None
        self._failed: BackgroundWrite | None = None
        remove_stale_temps(self.root, rank)

    def _due(self, local_step: int, start_step: int) -> bool:
        if local_step <= start_step:
            return False
        if self.every_steps and local_step % self.every_steps == 0:
            return True
        return bool(self.every_seconds) and time.monotonic() - self.last_time >= self.every_seconds

    def _written(self, path: Path, outcome: WriteOutcome) -> None:
        """(After a write, on whichever thread waited for it) record its outcome."""
        if outcome is WriteOutcome.NO_SPACE:
            log.warning(  # the previous checkpoint stays the newest; training goes on
                "checkpoint at step %d skipped: no space left (or over quota) in %s "
                "(free space on that disk)",
                worker_state_step(path),
                self.root,
            )
            self.skipped += 1
            return
        assert outcome is WriteOutcome.WRITTEN, outcome
        write_sidecar(path)
        prune_worker_files(self.root, self.rank, self.num_workers)

    def _background_done(self, write: BackgroundWrite) -> None:
        assert write.outcome is not None
        if write.outcome is WriteOutcome.HUNG:
            self.skipped += 1
            return
        if write.outcome is WriteOutcome.FAILED:
            self._failed = write
            return
        self._written(write.path, write.outcome)
        if write.outcome is WriteOutcome.WRITTEN:
            self.count += 1

    def _settle(self, local_step: int) -> None:
        """Wait for a write still running (logged: a checkpoint came due meanwhile), and
        raise what a finished one failed with."""
        writing = self._writing
        if writing is not None and not writing.done:
            log.warning(
                "checkpoint at step %d waits for the previous one (%s, %.1f s so far) to be "
                "written: the disk is slower than the checkpoint cadence (--checkpoint-every)",
                local_step,
                writing.path.name,
                time.monotonic() - writing.started,
            )
            self.waited += 1
            if not writing.join(max(0.0, writing.started + writing.patience - time.monotonic())):
                log.warning(
                    "the writer of %s made no end in %.0f s; killed (its checkpoint is "
                    "skipped, the previous one stays the newest)",
                    writing.path.name,
                    time.monotonic() - writing.started,
                )
                writing.abandon()
        self._writing = None
        failed, self._failed = self._failed, None
        if failed is not None:
            raise CheckpointError(
                f"{failed.path}: writing this worker's state failed (exit status "
                f"{failed.exit_code}; the reason is in this worker's log)"
            )

    def save_worker(self, state: dict[str, Any], local_step: int) -> None:
        """Write this worker's state now, in the loop (its last one: it must be on disk
        before the worker leaves), after any write still running."""
        self._settle(local_step)
        path = worker_file(self.root, self.rank, local_step)
        if self._write_in_loop(path, lambda: save_worker_state(path, state)):
            prune_worker_files(self.root, self.rank, self.num_workers)

    def _write_in_loop(self, path: Path, write: Callable[[], None]) -> bool:
        """``write()`` the state file ``path``; whether it was (False: skipped, the disk full)."""
        try:
            write()
        except OSError as exc:
            if outcome_of(exc) is not WriteOutcome.NO_SPACE:
                raise
            self._written(path, WriteOutcome.NO_SPACE)
            return False
        return True

    def _start_save(self, state: dict[str, Any], local_step: int) -> bool:
        """Snapshot ``state`` and have it written (in the background where possible);
        whether it was (False: skipped, the disk full)."""
        path = worker_file(self.root, self.rank, local_step)
        encoded = encode_worker_state(path, state)
        if self.background:
            private_dir(path.parent)
            self._writing = BackgroundWrite(path, encoded, self._background_done)
            return True
        if not self._write_in_loop(path, lambda: state_writer.write_state_file(path, encoded)):
            return False
        self._written(path, WriteOutcome.WRITTEN)
        self.count += 1
        return True

    def maybe_save_worker(self, local_step: int, start_step: int, state: Any) -> None:
        """``state`` is a callable returning the worker state (built only when due)."""
        self.due_step = None
        if self._failed is not None:
            self._settle(local_step)  # raises what the write failed with
        if not self._due(local_step, start_step):
            return
        started = self.last_time = time.monotonic()
        try:
            self._settle(local_step)
            if self._start_save(state(), local_step):
                self.due_step = local_step
        finally:
            self.seconds += time.monotonic() - started

    def maybe_checkpoint_servers(self, shard_checkpoint: Any, extra: dict[str, Any]) -> None:
        """(Chief, after the step's pull) have the manifest writer snapshot every shard once
        every worker saved its state of this checkpoint (a consistent cut: the shards hold
        every push the states counted; the later ones a resumed worker skips, as the servers
        tell it) and complete the manifest."""
        if self.due_step is not None:
            self._complete(self.due_step, shard_checkpoint, extra)

    def checkpoint_on_stop(
        self, local_step: int, shard_checkpoint: Any, extra: dict[str, Any]
    ) -> None:
        """(Chief, asked to stop and save, once every worker saved its last state and left)
        a checkpoint of each worker's newest state, then the shards (a consistent cut: every
        push those states counted, and nothing later: the workers stopped), named after the
        chief's ``local_step``; its manifest says ``"stopped": true``. :meth:`close`
        completes it."""
        self._complete(local_step, shard_checkpoint, {**extra, "stopped": True}, newest=True)

    def _complete(
        self, step: int, shard_checkpoint: Any, extra: dict[str, Any], newest: bool = False
    ) -> None:
        """(Chief) have the manifest writer complete the checkpoint ``ckpt-<step>``."""
        if self.writer is None:
            return
        name = f"ckpt-{step:08d}"
        private_dir(self.root / name)
        self.writer.complete(name, step, shard_checkpoint or [], extra, newest=newest)

    def close(self, timeout: float = 5.0) -> None:
        """(After the other workers finished) complete what checkpoints can be completed, give
        up the others, and stop the chief's manifest writer; a state still being written is
        waited for first."""
        if self._writing is not None:
            self._writing.join()
        if self.writer is not None:
            self.writer.join(timeout, settled=True)
