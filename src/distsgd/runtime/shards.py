"""A folder of data shards read in place: data sets larger than memory, with random access.

:class:`ShardFolder` is a map-style ``torch.utils.data.Dataset`` over every shard file in a
folder, in the order of their names. Nothing is loaded at construction but the files' headers
(and a tar file's member table); an item is read from the memory-mapped file when asked for,
so the operating system pages the data in and out and a process never holds more than the
batches it is working on. Because every item has an index, a shard folder shards, shuffles,
checkpoints and leases work units exactly like an in-memory data set.

Three kinds of shard file, which may be mixed in one folder:

* ``.npy`` files named ``STEM.FIELD.npy`` (``part-00003.x.npy``, ``part-00003.y.npy``): one
  array per field, all of one stem the same length along axis 0;
* ``.npz`` files written by ``np.savez`` (not ``np.savez_compressed``: a compressed member
  cannot be mapped), one array per field;
* WebDataset-style ``.tar`` files (uncompressed): members ``KEY.EXT`` grouped by ``KEY``, e.g.
  ``000123.x.npy`` + ``000123.cls``. The extension names the field (``x.npy`` -> ``x``) and how
  it is decoded: ``.npy`` an array, ``.cls``/``.index``/``.id`` an integer, ``.txt`` a string,
  ``.json`` JSON; anything else raw bytes, or whatever ``decode=`` makes of a sample.

An item is a tuple of the fields, the target last: the target is the first of ``target``,
``targets``, ``label``, ``labels``, ``y``, ``cls`` present, the other fields come before it in
name order; ``fields=`` sets the order instead. Arrays are read with ``allow_pickle=False``: an
object array is refused.
"""

from __future__ import annotations

import bisect
import io
import json
import logging
import mmap
import tarfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from distsgd.runtime.data import TARGET_KEYS

log = logging.getLogger(__name__)

SHARD_SUFFIXES = (".npy", ".npz", ".tar")
"""The shard files a folder may hold."""

TARGET_FIELDS = (*TARGET_KEYS, "cls")
"""Fields that hold the target, in the order one is looked for."""

INT_EXTENSIONS = ("cls", "index", "id")
"""Tar member extensions decoded as one integer."""

Decode = Callable[[dict[str, bytes]], Any]
"""``decode(sample) -> item``: a tar sample's members (extension -> bytes) to one item."""


@dataclass(frozen=True)
class _Npy:
    """One array of a shard: where its data lies in which file."""

    path: Path
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    fortran: bool


def _npy_header(handle: Any, where: str) -> tuple[tuple[int, ...], np.dtype[Any], bool, int]:
    """(shape, dtype, fortran order, offset of the data) of the ``.npy`` data at the handle's
    position; refuses object arrays (they would need pickle)."""
    version = np.lib.format.read_magic(handle)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(handle)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(handle)
    if dtype.hasobject:
        raise ValueError(f"{where} holds Python objects, which need pickle; store plain arrays")
    return tuple(shape), dtype, bool(fortran), int(handle.tell())


def _npy_file(path: Path) -> _Npy:
    with path.open("rb") as handle:
        shape, dtype, fortran, offset = _npy_header(handle, str(path))
    return _Npy(path, offset, shape, dtype, fortran)


def _npz_members(path: Path) -> dict[str, _Npy]:
    """The arrays of an uncompressed ``.npz``, located inside the zip file."""
    out: dict[str, _Npy] = {}
    with zipfile.ZipFile(path) as archive, path.open("rb") as handle:
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                continue
            where = f"{path}:{info.filename}"
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(
                    f"{where} is compressed, and a compressed array cannot be read in place; "
                    "write the shards with np.savez (not np.savez_compressed) or as .npy files"
                )
            handle.seek(info.header_offset)
            local = handle.read(30)  # the local file header: its name and extra field follow
            if local[:4] != b"PK\x03\x04":
                raise ValueError(f"{where}: not a zip member header; is the file damaged?")
            name_len = int.from_bytes(local[26:28], "little")
            extra_len = int.from_bytes(local[28:30], "little")
            handle.seek(info.header_offset + 30 + name_len + extra_len)
            shape, dtype, fortran, offset = _npy_header(handle, where)
            out[info.filename[: -len(".npy")]] = _Npy(path, offset, shape, dtype, fortran)
    return out


def _split_member(name: str) -> tuple[str, str] | None:
    """A tar member name's (key, extension): the key is the path up to the first dot of the
    base name, as WebDataset groups them; None for a name without one."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot <= slash + 1 or dot == len(name) - 1:
        return None
    return name[:dot], name[dot + 1 :]


def _field(extension: str) -> str:
    return extension[: -len(".npy")] if extension.endswith(".npy") else extension


class _Shard:
    """One shard file (or one stem of ``.npy`` files): its length and fields."""

    length: int
    fields: tuple[str, ...]

    def read(self, field: str, rows: np.ndarray) -> list[Any]:
        """The field's values at the shard's ``rows`` (sorted)."""
        raise NotImplementedError

    def close(self) -> None:
        """Drop the mappings (they are made again on the next read)."""


class _ArrayShard(_Shard):
    """Fields that are arrays in files (``.npy`` of one stem, or an ``.npz``)."""

    def __init__(self, name: str, arrays: Mapping[str, _Npy]) -> None:
        lengths = {field: npy.shape[0] if npy.shape else None for field, npy in arrays.items()}
        if None in lengths.values() or len(set(lengths.values())) != 1:
            shown = ", ".join(f"{field} {n}" for field, n in sorted(lengths.items()))
            raise ValueError(
                f"{name}: its fields differ in length ({shown}); every field of a shard needs "
                "one row per sample"
            )
        self.name = name
        self.arrays = dict(arrays)
        self.length = int(next(iter(lengths.values())) or 0)
        self.fields = tuple(sorted(arrays))
        self._maps: dict[str, np.ndarray] = {}

    def _map(self, field: str) -> np.ndarray:
        array = self._maps.get(field)
        if array is None:
            npy = self.arrays[field]
            array = np.memmap(
                npy.path,
                dtype=npy.dtype,
                mode="r",
                offset=npy.offset,
                shape=npy.shape,
                order="F" if npy.fortran else "C",
            )
            self._maps[field] = array
        return array

    def read(self, field: str, rows: np.ndarray) -> list[Any]:
        block = np.asarray(self._map(field)[rows])  # a copy: the rows only, in memory
        return list(block)

    def close(self) -> None:
        self._maps.clear()


class _TarShard(_Shard):
    """A WebDataset-style tar file: where each sample's members lie in it."""

    def __init__(self, path: Path, decode: Decode | None) -> None:
        self.path = path
        self.decode = decode
        keys: dict[str, int] = {}
        spans: dict[str, dict[int, tuple[int, int]]] = {}
        try:
            archive = tarfile.open(path, mode="r:")  # noqa: SIM115 - closed below
        except tarfile.ReadError as exc:
            raise ValueError(
                f"{path}: not an uncompressed tar file ({exc}); a compressed tar cannot be "
                "read in place: write the shards as plain .tar"
            ) from exc
        with archive:
            while (info := archive.next()) is not None:
                archive.members.clear()  # type: ignore[attr-defined]  # keep offsets only
                if not info.isfile():
                    continue
                split = _split_member(info.name)
                if split is None:
                    continue
                key, extension = split
                row = keys.setdefault(key, len(keys))
                spans.setdefault(extension, {})[row] = (info.offset_data, info.size)
        self.length = len(keys)
        self.extensions = tuple(sorted(spans))
        missing = [e for e in self.extensions if len(spans[e]) != self.length]
        if missing:
            raise ValueError(
                f"{path}: {len(spans[missing[0]])} of its {self.length} samples have a "
                f"'.{missing[0]}' member; every sample needs the same members"
            )
        self.spans = {
            extension: np.array([spans[extension][row] for row in range(self.length)], np.int64)
            for extension in self.extensions
        }
        self.fields = tuple(sorted(_field(e) for e in self.extensions))
        self._extension = {_field(e): e for e in self.extensions}
        self._map: mmap.mmap | None = None

    def _bytes(self, extension: str, row: int) -> bytes:
        if self._map is None:
            with self.path.open("rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        start, size = (int(v) for v in self.spans[extension][row])
        return self._map[start : start + size]

    def sample(self, row: int) -> dict[str, bytes]:
        """Row ``row``'s members: extension -> bytes."""
        return {e: self._bytes(e, row) for e in self.extensions}

    def read(self, field: str, rows: np.ndarray) -> list[Any]:
        extension = self._extension[field]
        return [_decode(extension, self._bytes(extension, int(r)), self.path) for r in rows]

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


def _decode(extension: str, data: bytes, path: Path) -> Any:
    last = extension.rsplit(".", 1)[-1]
    if last == "npy":
        return np.load(io.BytesIO(data), allow_pickle=False)
    if last in INT_EXTENSIONS:
        return int(data.decode().strip())
    if last == "txt":
        return data.decode()
    if last == "json":
        return json.loads(data)
    return data


def _scan(path: Path, decode: Decode | None) -> list[tuple[str, _Shard]]:
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SHARD_SUFFIXES)
    stems: dict[str, dict[str, _Npy]] = {}
    shards: dict[str, _Shard] = {}
    for file in files:
        if file.suffix == ".npy":
            stem, dot, field = file.name[: -len(".npy")].rpartition(".")
            if not dot:
                raise ValueError(
                    f"{file}: a .npy shard is named STEM.FIELD.npy (e.g. part-0.x.npy and "
                    "part-0.y.npy); rename it"
                )
            stems.setdefault(stem, {})[field] = _npy_file(file)
        elif file.suffix == ".npz":
            shards[file.name] = _ArrayShard(file.name, _npz_members(file))
        else:
            shards[file.name] = _TarShard(file, decode)
    for stem, arrays in stems.items():
        shards[stem] = _ArrayShard(f"{path / stem}.*.npy", arrays)
    return sorted(shards.items())


class ShardFolder(Dataset[Any]):
    """Every shard file in ``path``, as one map-style data set read in place (module docstring).

    Args:
        path: the folder; its ``.npy``, ``.npz`` and ``.tar`` files, in name order, are the
            shards (other files are left alone).
        fields: the fields of an item, in order, the target last; default: the non-target
            fields in name order, then the target field.
        decode: (tar shards) ``decode(sample) -> item`` for a sample's members (extension ->
            bytes), instead of the built-in decoding; ``fields`` is then unused for them.
        window: shards a worker reads at a time: each epoch shuffles the shards and the
            samples within each window of this many (``runtime/stream.py``,
            ``WindowedBatches``), so the disk is read in long stretches; 0 = one global
            shuffle, as for data in memory (fine while the folder fits the page cache).

    Raises:
        ValueError: a folder with no shard, shards with other fields, fields of different
            lengths, a compressed ``.npz`` or tar, an object array, or no target field.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        fields: Sequence[str] | None = None,
        decode: Decode | None = None,
        window: int = 4,
    ) -> None:
        if window < 0:
            raise ValueError(f"window must be 0 (a global shuffle) or more, got {window}")
        self.window = window
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"{self.path}: not a folder; give the folder holding the shards")
        named = _scan(self.path, decode)
        if not named:
            raise ValueError(
                f"{self.path}: no shard file ({', '.join(SHARD_SUFFIXES)}) in it; write the "
                "data as STEM.FIELD.npy, .npz or WebDataset .tar shards"
            )
        self.shard_names = [name for name, _ in named]
        self._shards = [shard for _, shard in named]
        first = self._shards[0].fields
        for name, shard in named:
            if shard.fields != first and not (decode and isinstance(shard, _TarShard)):
                raise ValueError(
                    f"{self.path}: shard {name} has the fields {', '.join(shard.fields)}, "
                    f"{self.shard_names[0]} has {', '.join(first)}; every shard needs the same"
                )
        self.decode = decode
        self.fields = tuple(fields) if fields is not None else _order(first, self.path)
        unknown = [f for f in self.fields if f not in first]
        if unknown and not decode:
            raise ValueError(
                f"{self.path}: no field {unknown[0]!r} in the shards (they have {', '.join(first)})"
            )
        self.starts = np.cumsum([0] + [s.length for s in self._shards]).tolist()
        log.info(
            "%s: %d samples in %d shards, fields %s",
            self.path,
            len(self),
            len(self._shards),
            self.fields,
        )

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, row in it) of item ``index``."""
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"index {index} out of range for {n} samples")
        shard = bisect.bisect_right(self.starts, index) - 1
        return shard, index - self.starts[shard]

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The items at ``indices`` (torch's DataLoader asks for a batch so): each shard's rows
        are read together, in file order."""
        located = [self.locate(int(i)) for i in indices]
        by_shard: dict[int, list[int]] = {}
        for position, (number, _) in enumerate(located):
            by_shard.setdefault(number, []).append(position)
        items: list[Any] = [None] * len(located)
        for shard_index, positions in by_shard.items():
            shard = self._shards[shard_index]
            rows = np.array([located[p][1] for p in positions], dtype=np.int64)
            order = np.argsort(rows, kind="stable")
            if self.decode is not None and isinstance(shard, _TarShard):
                for p, row in zip(positions, rows.tolist(), strict=True):
                    items[p] = self.decode(shard.sample(row))
                continue
            columns = [shard.read(field, rows[order]) for field in self.fields]
            for k, p in enumerate(np.asarray(positions)[order].tolist()):
                items[p] = tuple(_tensor(column[k]) for column in columns)
        return items

    def close(self) -> None:
        """Unmap every file (a later read maps it again)."""
        for shard in self._shards:
            shard.close()

    def __getstate__(self) -> dict[str, Any]:
        """Without the mappings: a copy (e.g. in a spawned loader process) maps afresh."""
        self.close()
        return self.__dict__.copy()


def _order(fields: Sequence[str], path: Path) -> tuple[str, ...]:
    target = next((f for f in TARGET_FIELDS if f in fields), None)
    if target is None:
        raise ValueError(
            f"{path}: no target field among {', '.join(fields)} (looked for "
            f"{', '.join(TARGET_FIELDS)}); name the fields in order, target last: fields=(...)"
        )
    return (*sorted(f for f in fields if f != target), target)


def _tensor(value: Any) -> Any:
    """A field's value as torch's collate wants it: arrays and numbers as tensors."""
    if isinstance(value, np.ndarray | np.generic):
        return torch.from_numpy(np.array(value))
    if isinstance(value, bool | int | float):
        return torch.tensor(value)
    return value


def write_shards(
    path: str | Path,
    arrays: Mapping[str, np.ndarray],
    *,
    per_shard: int,
    kind: str = "npy",
    start: int = 0,
) -> list[Path]:
    """Write ``arrays`` (field -> array, one row per sample) as shards of ``per_shard`` samples
    into ``path``: ``kind`` ``npy`` (``part-NNNNN.FIELD.npy``), ``npz`` or ``tar`` (WebDataset
    members ``KEY.FIELD.npy``, or ``KEY.cls`` for an integer field named ``cls``). ``start``
    numbers the first shard (to add shards to a folder in pieces). Returns the files written."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    lengths = {len(a) for a in arrays.values()}
    if len(lengths) != 1:
        raise ValueError("every field needs one row per sample")
    n = lengths.pop()
    written: list[Path] = []
    for number, begin in enumerate(range(0, n, per_shard), start=start):
        part = {
            field: np.ascontiguousarray(a[begin : begin + per_shard]) for field, a in arrays.items()
        }
        stem = f"part-{number:05d}"
        if kind == "npy":
            for field, array in part.items():
                np.save(folder / f"{stem}.{field}.npy", array, allow_pickle=False)
                written.append(folder / f"{stem}.{field}.npy")
        elif kind == "npz":
            np.savez(folder / f"{stem}.npz", **part)  # type: ignore[arg-type]
            written.append(folder / f"{stem}.npz")
        elif kind == "tar":
            written.append(_write_tar(folder / f"{stem}.tar", part, begin))
        else:
            raise ValueError(f"kind must be npy, npz or tar, got {kind!r}")
    return written


def _write_tar(path: Path, part: Mapping[str, np.ndarray], first_key: int) -> Path:
    with tarfile.open(path, mode="w") as archive:
        rows = len(next(iter(part.values())))
        for row in range(rows):
            for field, array in part.items():
                if field == "cls":
                    data = str(int(array[row])).encode()
                    name = f"{first_key + row:09d}.cls"
                else:
                    buffer = io.BytesIO()
                    np.save(buffer, array[row], allow_pickle=False)
                    data = buffer.getvalue()
                    name = f"{first_key + row:09d}.{field}.npy"
                info = tarfile.TarInfo(name)
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    return path
