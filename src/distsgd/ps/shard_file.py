"""A shard's file on disk (``ps<j>.npz``): its format number, its name, and reading its header
and the list of its arrays without loading them or any pickle. :class:`CorruptCheckpoint` names
a file that is no shard file. The layout's writer and full reader are
:meth:`distsgd.ps.shard.Shard.pack_into` and :meth:`~distsgd.ps.shard.Shard.from_bytes`."""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from distsgd.ps import snapshot_check

CHECKPOINT_FORMAT = 1
"""The shard file's format (its header's ``format``)."""


class CorruptCheckpoint(ValueError):
    """A shard file that cannot be read back; the message names the file."""


_HEADER_TYPES: dict[str, type] = {
    "index": int,
    "version": int,
    "num_workers": int,
    "scheme": str,
    "keys": list,
    "finished": list,
    "rule": dict,
}
"""The header keys every reader of a shard file relies on, with their JSON types."""


def _not_a_shard(path: Path, why: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(
        f"{path}: not a distsgd shard checkpoint ({why}); give a psN.npz of a checkpoint"
    )


def first_line(exc: BaseException) -> str:
    """``exc`` in one short line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def _count(header: Mapping[str, Any], key: str) -> int | None:
    value = header.get(key)
    return value if type(value) is int else None


SHARD_FILE_GLOB = "ps*.npz"
"""The names of shard files in a checkpoint folder."""


def shard_file_name(index: int) -> str:
    """The file name shard ``index`` saves to in a checkpoint folder (``ps<index>.npz``)."""
    return f"ps{index}.npz"


@dataclass(frozen=True, kw_only=True)
class ShardHeader:
    """The JSON header of a shard file (``ps<j>.npz``, written by :meth:`Shard.to_bytes`)."""

    index: int
    """Which shard of the model the file holds."""
    version: int
    """The shard's version (parameter changes applied) when it was saved."""
    num_workers: int
    """The workers the shard was serving."""
    scheme: str
    """The scheme whose update rule the shard ran."""
    keys: tuple[str, ...]
    """The parameters (``values/<key>`` members)."""
    finished: tuple[int, ...]
    """Workers that had finished when the file was saved."""
    rule: Mapping[str, Any]
    """The rule's non-array state (its arrays are ``rule/<name>`` members)."""
    pushes_accepted: int | None = None
    """Pushes applied (None: a file without the counter)."""
    pushes_rejected: int | None = None
    """Pushes refused."""
    nonfinite_rejected: int | None = None
    """Pushes refused for non-finite values."""

    @classmethod
    def from_json(cls, path: Path, header: Any) -> ShardHeader:
        """The header of ``path`` from its decoded JSON; :class:`CorruptCheckpoint` naming the
        file for a header of another format or without a required key."""
        if not isinstance(header, dict):
            raise _not_a_shard(path, "its header is not a JSON object")
        if header.get("format") != CHECKPOINT_FORMAT:
            why = f"shard format {header.get('format')!r}, not {CHECKPOINT_FORMAT}"
            raise _not_a_shard(path, why)
        for key, kind in _HEADER_TYPES.items():
            if key not in header:
                raise _not_a_shard(path, f"its header has no {key!r}")
            if not isinstance(header[key], kind) or isinstance(header[key], bool):
                raise _not_a_shard(path, f"its header's {key!r} is {header[key]!r}")
        return cls(
            index=header["index"],
            version=header["version"],
            num_workers=header["num_workers"],
            scheme=header["scheme"],
            keys=tuple(str(k) for k in header["keys"]),
            finished=tuple(int(w) for w in header["finished"]),
            rule=dict(header["rule"]),
            pushes_accepted=_count(header, "pushes_accepted"),
            pushes_rejected=_count(header, "pushes_rejected"),
            nonfinite_rejected=_count(header, "nonfinite_rejected"),
        )


def read_shard_header(path: Path) -> ShardHeader:
    """The header of a shard file, read from its ``header`` member alone (no parameters, no
    pickle); :class:`CorruptCheckpoint` naming the file when it is no shard file."""
    if not zipfile.is_zipfile(path):
        raise _not_a_shard(path, "not an .npz archive")
    try:
        with np.load(path, allow_pickle=False) as npz:
            if "header" not in npz.files:
                raise _not_a_shard(path, "no header")
            raw = npz["header"]
    except CorruptCheckpoint:
        raise
    except ValueError:  # numpy: an object array, which would need pickle
        raise _not_a_shard(path, "its header is not plain data") from None
    except Exception as exc:  # zip, zlib, truncated member
        raise _not_a_shard(path, f"damaged: {first_line(exc)}") from None
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise _not_a_shard(path, f"its header is {raw.dtype.name}{list(raw.shape)}, not JSON")
    try:
        header = json.loads(raw.tobytes())
    except ValueError:
        raise _not_a_shard(path, "its header is not JSON") from None
    return ShardHeader.from_json(path, header)


@dataclass(frozen=True, kw_only=True)
class ArrayInfo:
    """One array of a shard file, described without keeping its values."""

    name: str
    """The parameter's key."""
    dtype: str
    """Its numpy dtype's name."""
    shape: tuple[int, ...]
    """Its shape."""
    nbytes: int
    """Its size in bytes."""


def read_shard_arrays(path: Path, header: ShardHeader) -> tuple[list[ArrayInfo], list[str]]:
    """(each parameter of ``path``, the names of the rule's state: its arrays, then the rest),
    read without pickle; :class:`CorruptCheckpoint` naming the file for a missing parameter,
    an object array or a damaged member."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = []
            for key in header.keys:
                a = npz[f"values/{key}"]
                info = ArrayInfo(name=key, dtype=a.dtype.name, shape=a.shape, nbytes=a.nbytes)
                arrays.append(info)
            rule = [k[5:] for k in npz.files if k.startswith("rule/")] + list(header.rule)
    except (KeyError, ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise _not_a_shard(path, f"{type(exc).__name__} reading its parameters") from None
    return arrays, rule


shard_file_intact = snapshot_check.file_intact
"""Whether every member of a shard file passes its zip checksum and its contents the checks a
server makes before it serves them (:mod:`snapshot_check`)."""


# -- the whole state, as the shard writes and reads it -------------------------------------------
def pack_state_into(f: BinaryIO, arrays: dict[str, np.ndarray], header: dict[str, Any]) -> None:
    """A shard's arrays and header (``Shard.state_copy``) as an ``.npz`` into the file ``f``
    (how a server writes snapshots: never twice whole)."""
    arrays = {**arrays, "header": np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)}
    np.savez(f, **arrays)  # type: ignore[arg-type]


def pack_state(arrays: dict[str, np.ndarray], header: dict[str, Any]) -> bytes:
    """:func:`pack_state_into` as bytes."""
    pack_state_into(buf := io.BytesIO(), arrays, header)
    return buf.getvalue()


def unpack_state(data: bytes, name: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The header and arrays of a shard file's bytes, checked (:mod:`snapshot_check`);
    :class:`CorruptCheckpoint` naming ``name`` for a file of another format or a damaged one
    (any other exception: the caller names the file unreadable)."""
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    header: dict[str, Any] = json.loads(arrays.pop("header").tobytes())
    if not isinstance(header, dict) or header.get("format") != CHECKPOINT_FORMAT:
        why = header.get("format") if isinstance(header, dict) else header
        raise CorruptCheckpoint(f"{name}: unknown shard format {why!r:.60}")
    why = snapshot_check.header_problem(header) or snapshot_check.arrays_problem(header, arrays)
    if why is not None:  # served, it would fail later as a bug, or as a diverged run
        raise CorruptCheckpoint(f"{name}: a damaged shard file: {why}")
    return header, arrays
