"""The checks of a shard file (a write-ahead-log snapshot or a checkpoint's ``psN.npz``) before
a server serves it, as ``Register`` checks a model (:mod:`distsgd.ps.checks`): every header
field of its JSON type and range, every piece a float16/32/64 array of finite values (of the
dtype and shape the header records, where it records them), and every array of the rule's state
finite and, where it belongs to a piece, of that piece's shape.

:func:`problem` says in a few words what is wrong (None: nothing); the caller names the file
and raises :class:`~distsgd.ps.shard_file.CorruptCheckpoint`, so that a damaged snapshot is named as
damaged and the server falls back to an older state instead of serving NaN or failing later as
a bug.
"""

from __future__ import annotations

import json
import logging
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from distsgd.ps.rules import all_finite
from distsgd.transport.codec import FLOAT_DTYPES

log = logging.getLogger(__name__)

MAX_KEY_CHARS = 1024
"""Longest piece key (as :data:`distsgd.ps.checks.MAX_KEY_CHARS`)."""

_COUNTS = (
    "index",
    "version",
    "num_workers",
    "pushes_accepted",
    "pushes_rejected",
    "nonfinite_rejected",
)
_TYPES: dict[str, type] = {
    "scheme": str,
    "options_json": str,
    "run_id": str,
    "keys": list,
    "finished": list,
    "rule": dict,
    "moved": dict,
}


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def header_problem(header: Any) -> str | None:
    """What is wrong with a shard file's decoded JSON header (None: nothing)."""
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    for name in _COUNTS:
        if name in header and not _is_count(header[name]):
            return f"header field {name!r} is {header[name]!r:.60}, not a count"
    if header.get("num_workers") == 0:
        return "header field 'num_workers' is 0"
    for name, kind in _TYPES.items():
        if name in header and not isinstance(header[name], kind):
            got = type(header[name]).__name__
            return f"header field {name!r} has type {got}, not {kind.__name__}"
    keys = header.get("keys", [])
    if not all(isinstance(k, str) and 0 < len(k) <= MAX_KEY_CHARS for k in keys):
        return "header field 'keys' holds a name that is not a piece key"
    if len(set(keys)) != len(keys):
        return "header field 'keys' names a piece twice"
    if not all(_is_count(w) for w in header.get("finished", [])):
        return "header field 'finished' holds something that is not a worker index"
    if not all(_is_count(s) for s in header.get("moved", {}).values()):
        return "header field 'moved' holds something that is not a shard index"
    specs = header.get("specs", {})
    if not isinstance(specs, dict) or not all(_is_spec(s) for s in specs.values()):
        return "header field 'specs' is not a map of [dtype, shape]"
    return None


def _is_spec(spec: object) -> bool:
    return (
        isinstance(spec, list)
        and len(spec) == 2
        and isinstance(spec[0], str)
        and isinstance(spec[1], list)
        and all(_is_count(n) for n in spec[1])
    )


def spec_of(array: np.ndarray) -> list[Any]:
    """What a snapshot's header records of a piece (``specs``): [dtype, shape]."""
    return [array.dtype.name, list(array.shape)]


def arrays_problem(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> str | None:
    """What is wrong with a shard file's arrays, given its (checked) header (None: nothing)."""
    specs = header.get("specs", {})
    values: dict[str, np.ndarray] = {}
    for key in header.get("keys", []):
        array = arrays.get(f"values/{key}")
        if array is None:
            return f"piece {key!r:.80} is missing"
        if array.dtype.name not in FLOAT_DTYPES:
            return f"piece {key!r:.80} is {array.dtype.name}, not float16, float32 or float64"
        if key in specs and spec_of(array) != specs[key]:
            want, got = specs[key], spec_of(array)
            return f"piece {key!r:.80} is {got[0]}{got[1]}, its header says {want[0]}{want[1]}"
        if not all_finite(array):
            return f"piece {key!r:.80} holds NaN or Inf"
        values[key] = array
    for name, array in arrays.items():
        if not name.startswith("rule/"):
            continue
        if array.dtype.kind == "f" and not all_finite(array):
            return f"rule state {name[5:]!r:.80} holds NaN or Inf"
        piece = values.get(name.partition("/")[2].partition("/")[2])
        if piece is not None and array.shape != piece.shape:
            return (
                f"rule state {name[5:]!r:.80} has shape {list(array.shape)}, "
                f"its piece {list(piece.shape)}"
            )
    return None


def file_intact(path: Path) -> bool:
    """Whether the shard file ``path`` passes its zip checksums and the checks above (a
    restarted server then starts from it); a damaged one is logged, naming the damage."""
    try:
        with zipfile.ZipFile(path) as archive:
            if archive.testzip() is not None:
                return False
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
        header = json.loads(arrays.pop("header").tobytes())
    except (OSError, zipfile.BadZipFile, EOFError, ValueError, KeyError):
        return False
    why = header_problem(header) or arrays_problem(header, arrays)
    if why is not None:
        log.warning("%s: a damaged shard file: %s", path, why)
    return why is None
