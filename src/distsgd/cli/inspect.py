"""What a checkpoint holds, read without starting anything (``distsgd doctor PATH`` of a
checkpoint, or of a run folder no task runs in: :mod:`distsgd.cli.doctor`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distsgd.control.checkpoint.errors import CheckpointError
from distsgd.control.checkpoint.store import MANIFEST, latest_checkpoint, verify
from distsgd.ps.shard_file import (
    SHARD_FILE_GLOB,
    CorruptCheckpoint,
    read_shard_arrays,
    read_shard_header,
)


def _count(value: int | None) -> str:
    return "?" if value is None else str(value)


def _shard_lines(path: Path) -> list[str]:
    header = read_shard_header(path)
    lines = [
        f"  {path.name}: shard {header.index}, scheme {header.scheme}, "
        f"version {header.version}, "
        f"{header.num_workers} workers ({len(header.finished)} finished), "
        f"pushes {_count(header.pushes_accepted)} accepted / "
        f"{_count(header.pushes_rejected)} rejected "
        f"({_count(header.nonfinite_rejected)} non-finite)"
    ]
    arrays, rule = read_shard_arrays(path, header)
    for a in arrays:
        lines.append(f"    {a.name:40s} {a.dtype}{list(a.shape)}  {a.nbytes} bytes")
    lines.append(f"    rule state: {', '.join(rule) if rule else 'none'}")
    return lines


def _worker_lines(path: Path) -> list[str]:
    from distsgd.runtime.checkpoint import load_worker_state  # a worker's state: torch reads it

    state = load_worker_state(path)
    params = sum(int(v.numel()) for v in state["model"].values())
    scheme_state = ", ".join(sorted(map(str, state["scheme"]))) or "none"
    from_servers = state.get("replica_from_servers", False)
    held = " (its exchanged parameters are the servers', pulled on resume)" if from_servers else ""
    return [
        f"  {path.name}: worker {state['worker']}, "
        f"local step {state['local_step']} of {state['steps']}, "
        f"global step {state['global_step']}, "
        f"data position (epoch, batch) = {tuple(state['position'])}",
        f"    replica: {len(state['model'])} tensors, {params} values"
        f"{held}; scheme state: {scheme_state}",
    ]


def describe(path: Path) -> list[str]:
    """Lines describing ``path`` (a run folder, a checkpoint folder, or one state file)."""
    if path.is_file():
        return _shard_lines(path) if path.suffix == ".npz" else _worker_lines(path)
    if (path / "checkpoints").is_dir():
        checkpoint, problems = latest_checkpoint(path / "checkpoints")
        lines = [f"unusable: {p}" for p in problems]
        if checkpoint is None:
            saved = sorted((path / "checkpoints" / "workers").glob("worker*.pt"))
            files = f"; inspect one of its files, e.g. {saved[-1]}" if saved else ""
            raise CheckpointError(
                f"{path}: no complete checkpoint (a run shorter than --checkpoint-every, "
                f"30 s by default, has none){files}"
            )
        return [*lines, *describe(checkpoint.path)]
    if not (path / MANIFEST).exists() and not any(path.glob(SHARD_FILE_GLOB)):
        raise CheckpointError(
            f"{path}: neither a run folder (no checkpoints/) nor a checkpoint (no {MANIFEST}); "
            "give a run folder, a checkpoint folder or one of its files"
        )
    checkpoint = verify(path)
    m: dict[str, Any] = checkpoint.manifest
    lines = [
        f"checkpoint {path} ({MANIFEST} verified): step {m['step']}, "
        f"scheme {m.get('scheme', '?')}, "
        f"{len(m['shards'])} shards, {len(m['workers'])} workers"
    ]
    for entry in m["shards"]:
        lines += _shard_lines(path / entry["file"])
    for entry in m["workers"]:
        lines += _worker_lines(path / entry["file"])
    return lines


def inspect(path: Path) -> int:
    """Print :func:`describe`; a file that is not what it should be is one line of ValueError
    (nothing in it is ever run: worker states are read with ``weights_only``, shards without
    pickle)."""
    if not path.exists():
        raise ValueError(f"{path}: no such file or folder; give a run folder or a checkpoint")
    try:
        lines = describe(path)
    except (CheckpointError, CorruptCheckpoint) as exc:
        raise ValueError(str(exc)) from None
    for line in lines:
        print(line)
    return 0
