"""TensorBoard event files: every ``metrics.jsonl`` record as series of its task's TensorBoard run.

:class:`~distsgd.control.metrics.MetricsWriter` hands each record it appends to
``metrics.jsonl`` to a :class:`BoardWriter` too, so whatever writes metrics (a worker under
``distsgd run``, ``distsgd worker`` by hand or in a pod, the launcher) writes TensorBoard events
as well, with no launcher needed to convert anything. Where ``tensorboard`` is not installed
(``pip install 'distsgd[tensorboard]'``), or ``DISTSGD_TENSORBOARD=0``, nothing is written.

**Layout.** ``RUN/tensorboard/<task>/events.out.tfevents.*``: one TensorBoard run per task
(``worker0``, ``worker1``, ..., ``launcher``), every worker with the same tags. TensorBoard
reads one directory as one run, its files one after the other; processes writing at once need
directories of their own. So ``tensorboard --logdir RUN`` overlays the workers of a run in each
chart, and ``--logdir`` of a ``distsgd compare`` folder overlays the schemes (its runs are
``runs/<scheme>/tensorboard/worker0`` ...; the run filter picks, e.g. ``worker0``).

**Steps.** A worker's series are over its own step (``local_step``: the same for every scheme,
unlike the servers' version); the launcher's over the global step it reports. A record without
its step (an event) takes the step of the record before. A restarted worker's new process adds
a file to the same directory; points at steps it does again replace the old ones (the Rust
reader drops a tag's points at steps not before a new point's, the Python reader those at and
after the session start written before a process's first training line).

**Tags**: the table of docs/tensorboard.md (``train/``, ``comm/``, ``time/``, ``time_share/``,
``eval/``, ``membership/``, ``load/``, ``stragglers/``, ``events/``, ``user/``); a number of a
training line the table does not name is ``train/<field>`` (scheme counters such as
``dropped``).

**Writing.** Each record is one event (every value of the line in one summary), one
``os.write`` on a file opened ``O_APPEND`` with the mode of ``metrics.jsonl``: nothing is
buffered, so a SIGKILLed task loses nothing it logged, and ``metrics.jsonl`` is written before
and never depends on it. The records are framed here (TFRecord: length, masked CRC-32C) around
tensorboard's own protobuf messages; no pickle, no thread. ``tensorboard.summary`` (and torch's
``SummaryWriter`` on top of it) is not used: it imports much more (TensorFlow where installed)
and flushes from a thread every two minutes, so a killed task would lose those minutes.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import socket
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from distsgd.control.folder import TENSORBOARD_DIR, write_all
from distsgd.control.timing import COMM_PHASES, PHASES, as_number, split_from_metrics
from distsgd.util import open_private, private_dir

log = logging.getLogger(__name__)

ENV_VAR = "DISTSGD_TENSORBOARD"
"""``0`` (or ``false``, ``no``, ``off``) turns TensorBoard events off where tensorboard is
installed; a task started by the launcher inherits it."""

FIELD_TAGS = {
    "loss": "train/loss",
    "step": "train/global_step",
    "progress": "train/progress",
    "epoch": "train/epoch",
    "samples": "train/samples",
    "nonfinite_skipped": "train/nonfinite_skipped",
    "bytes_sent": "comm/bytes_sent",
    "mean_staleness": "comm/mean_staleness",
    "lost_pushes": "comm/lost_pushes",
    "test_loss": "eval/test_loss",
    "accuracy": "eval/accuracy",
}
"""The tag of each known field of a metrics line (any other number: ``train/<field>``)."""

EVENTS_TAG = "events"
"""The text series of events: at each step, one markdown list item per event there."""

_NOT_SERIES = frozenset({"time", "task", "local_step", "event", "final"})
_PHASE_FIELDS = frozenset(f"{phase}_s" for phase in PHASES)
_MAX_EVENTS_PER_STEP = 50
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_files = count()
_missing_noted = False


# --------------------------------------------------------------------------- series


@dataclass
class Points:
    """What one record becomes: scalars and texts by tag, at one step and time."""

    step: int
    wall_time: float
    scalars: dict[str, float] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    histograms: dict[str, dict[int, int]] = field(default_factory=dict)
    """Counts by integer value (the staleness histogram of ``finished_steps``)."""


def _counts(value: object) -> dict[int, int]:
    """A ``{"0": 12, "1": 30}`` histogram as ints; {} for anything else."""
    if not isinstance(value, Mapping):
        return {}
    out: dict[int, int] = {}
    for key, pushes in value.items():
        try:
            k, n = int(key), int(pushes)
        except (TypeError, ValueError):
            return {}
        if k >= 0 and n > 0:
            out[k] = n
    return out


HISTOGRAM_BUCKETS = 1024
"""Integer values above this share the last bucket of a histogram."""


class Series:
    """Turns one task's records into :class:`Points`, in the order it logged them.

    Keeps what the derived series need: the training line before (samples/s, bytes/s), the
    time split before (shares of the interval), the count of each event, the step."""

    def __init__(self) -> None:
        self._step = 0
        self._local_steps = False
        self._line: tuple[float, float, float | None] | None = None
        self._split: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._event_step: int | None = None
        self._event_lines: list[str] = []

    def points(self, record: Mapping[str, Any], wall_time: float) -> Points:
        """The series values of ``record``, logged at ``wall_time`` (seconds since the epoch)."""
        step_field = self._step_field(record)
        out = Points(step=self._step, wall_time=wall_time)
        kind = record.get("event")
        if kind is None:
            # An evaluation's line (test_loss, accuracy) has only eval/ series; a training
            # line's other numbers (scheme counters too) are train/<field>.
            evaluation = "loss" not in record and ("test_loss" in record or "accuracy" in record)
            group, skip = ("eval", {"step", step_field}) if evaluation else ("train", {step_field})
            skip |= _NOT_SERIES | _PHASE_FIELDS  # the phase fields: below, with the shares
            for key, value in record.items():
                if (number := as_number(value)) is not None and key not in skip:
                    out.scalars[FIELD_TAGS.get(key, f"{group}/{key}")] = number
            self._rates(record, wall_time, out)
            user = record.get("user")  # worker.log(...) and train(metrics=...): user/<name>
            if isinstance(user, Mapping):
                for name, value in user.items():
                    if (number := as_number(value)) is not None:
                        out.scalars[f"user/{name}"] = number
        else:
            self._event(str(kind), record, out)
        histogram = _counts(record.get("staleness"))
        if histogram:
            out.histograms["comm/staleness"] = histogram
        self._time_split(record, out, shares=kind is None)
        return out

    def _step_field(self, record: Mapping[str, Any]) -> str | None:
        """Sets this record's step: ``local_step``; the global ``step`` in a task that logs no
        local steps (the launcher); else the step before. Returns the field used."""
        local = as_number(record.get("local_step"))
        if local is not None:
            self._local_steps = True
            self._step = int(local)
            return "local_step"
        step = as_number(record.get("step"))
        if step is not None and not self._local_steps:
            self._step = int(step)
            return "step"
        return None

    def _rates(self, record: Mapping[str, Any], wall_time: float, out: Points) -> None:
        samples = as_number(record.get("samples"))
        if samples is None:
            return
        sent = as_number(record.get("bytes_sent"))
        before, self._line = self._line, (wall_time, samples, sent)
        if before is None:
            return
        seconds = wall_time - before[0]
        if seconds < 1e-3 or samples < before[1]:
            return  # no time to divide by, or counts that went back (a restart in-process)
        out.scalars["train/samples_per_s"] = (samples - before[1]) / seconds
        if sent is not None and before[2] is not None and sent >= before[2]:
            out.scalars["comm/bytes_per_s"] = (sent - before[2]) / seconds

    def _time_split(self, record: Mapping[str, Any], out: Points, *, shares: bool) -> None:
        """``time/<phase>_s`` of any record; the shares only of training lines (an event's
        split, e.g. ``finished_steps``, would replace the share of the line at its step with
        that of the few moments since)."""
        split = split_from_metrics(record)
        if not split:
            return
        for phase, seconds in split.items():
            out.scalars[f"time/{phase}_s"] = seconds
        if not shares:
            return
        delta = {p: max(0.0, s - self._split.get(p, 0.0)) for p, s in split.items()}
        self._split = split
        total = sum(delta.values())
        if total <= 0:
            return
        for phase, seconds in delta.items():
            out.scalars[f"time_share/{phase}"] = seconds / total
        out.scalars["time_share/communication"] = (
            sum(delta.get(p, 0.0) for p in COMM_PHASES) / total
        )

    def _event(self, kind: str, record: Mapping[str, Any], out: Points) -> None:
        name = re.sub(r"[^A-Za-z0-9_]", "_", kind) or "event"
        self._counts[name] = self._counts.get(name, 0) + 1
        out.scalars[f"events/{name}"] = float(self._counts[name])
        if kind == "membership":
            shard, epoch, members = record.get("ps"), record.get("epoch"), record.get("members")
            if isinstance(shard, int) and isinstance(members, list):
                out.scalars[f"membership/ps{shard}/workers"] = float(len(members))
                if (number := as_number(epoch)) is not None:
                    out.scalars[f"membership/ps{shard}/epoch"] = number
        elif kind == "scale" and (workers := as_number(record.get("workers"))) is not None:
            out.scalars["membership/workers"] = workers
        elif kind == "straggler" and isinstance(target := record.get("target"), str):
            score = as_number(record.get("score"))  # 0 once cleared: a step down in the chart
            cleared = record.get("state") == "cleared"
            out.scalars[f"stragglers/{target}/score"] = 0.0 if cleared else (score or 0.0)
        elif kind == "shard_load" and isinstance(shard := record.get("ps"), int):
            for key, value in record.items():  # series, not a line of text every 5 s
                number = as_number(value)
                if number is not None and key not in ("ps", "step", "seconds", "time"):
                    out.scalars[f"load/ps{shard}/{key}"] = number
            return
        if out.step != self._event_step:  # TensorBoard keeps one text per step: the last
            self._event_step, self._event_lines = out.step, []
        if len(self._event_lines) < _MAX_EVENTS_PER_STEP:
            self._event_lines.append(_event_line(kind, record))
        elif len(self._event_lines) == _MAX_EVENTS_PER_STEP:
            self._event_lines.append("- (more events at this step: see metrics.jsonl)")
        out.texts[EVENTS_TAG] = "\n".join(self._event_lines)


def _event_line(kind: str, record: Mapping[str, Any]) -> str:
    """``- **fault** step=`12` target=`worker1` ...``: a markdown list item."""
    fields = " ".join(
        f"{key}=`{_shown(value)}`"
        for key, value in record.items()
        if key not in ("time", "task", "event")
    )
    return f"- **{_shown(kind)}** {fields}".rstrip()


def _shown(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text.replace("`", "'").replace("\n", " ")


# --------------------------------------------------------------------------- files


def masked_crc32c(data: bytes) -> int:
    """The masked CRC-32C of a TFRecord (what TensorBoard checks each record's length and
    data against)."""
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


_CRC_POLY = 0x82F63B78  # CRC-32C (Castagnoli), bit-reflected
_CRC_BLOCK = 1024
"""Bytes per block of the vectorized CRC: its table is 256 words a byte position (1 MiB)."""


def _crc_table() -> tuple[int, ...]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ _CRC_POLY if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


_CRC_TABLE = _crc_table()


@functools.cache
def _crc_blocks() -> tuple[np.ndarray, np.ndarray]:
    """What each byte value adds to the CRC register at each distance from a block's end, as
    one flat table, and the offset of each byte position's row in it (first position first).

    A CRC is linear: with a register of 0 at the start, its value after ``m`` bytes is the XOR
    of each byte's own part, ``T[b]`` moved on through the zero bytes after it; an initial
    register is the same as XOR-ing its little-endian bytes into the first four bytes."""
    t0 = np.array(_CRC_TABLE, dtype=np.uint32)
    rows = np.empty((_CRC_BLOCK, 256), dtype=np.uint32)
    row = t0.copy()
    for distance in range(_CRC_BLOCK):
        rows[_CRC_BLOCK - 1 - distance] = row
        row = t0[row & 0xFF] ^ (row >> 8)
    return rows.ravel(), np.arange(_CRC_BLOCK, dtype=np.intp) * 256


def _crc32c(data: bytes) -> int:
    """CRC-32C of ``data``: blocks of up to 1 KiB with numpy (about 10 times as fast as byte by
    byte in Python, which short inputs take)."""
    register, start, n = 0xFFFFFFFF, 0, len(data)
    if n >= 64:
        flat, offsets = _crc_blocks()
        while n - start >= 4:
            end = min(n, start + _CRC_BLOCK)
            if n - end < 4:
                end = n if n - end == 0 else n - 4  # leave no tail shorter than 4 bytes
            size = end - start
            index = offsets[_CRC_BLOCK - size :] + np.frombuffer(
                data, dtype=np.uint8, count=size, offset=start
            )
            for i in range(4):  # the register so far, into the block's first four bytes
                index[i] ^= (register >> (8 * i)) & 0xFF
            register = int(np.bitwise_xor.reduce(flat.take(index)))
            start = end
    table = _CRC_TABLE
    for byte in data[start:]:
        register = table[(register ^ byte) & 0xFF] ^ (register >> 8)
    return register ^ 0xFFFFFFFF


def _framed(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return (
        header
        + struct.pack("<I", masked_crc32c(header))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


@dataclass(frozen=True)
class _Protos:
    event: ModuleType
    summary: ModuleType
    types: ModuleType


def _protos() -> _Protos | str:
    """tensorboard's protobuf modules (protobuf only: no TensorFlow, no torch), or why not."""
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2, types_pb2
    except ImportError:
        return "tensorboard is not installed"
    except Exception as exc:  # e.g. its generated code refused by this protobuf
        return f"tensorboard cannot be imported ({type(exc).__name__}: {exc})"
    return _Protos(event=event_pb2, summary=summary_pb2, types=types_pb2)


class BoardWriter:
    """Appends one task's :class:`Points` to an event file in ``directory`` (one TensorBoard
    run); the directory and the file are made at the first record with something to show.
    Safe to call from several threads (the heartbeat's membership events)."""

    def __init__(self, directory: Path, protos: _Protos) -> None:
        self.directory = directory
        self._protos = protos
        self._series = Series()
        self._fd: int | None = None
        self._closed = False
        self._started = False
        self._lock = threading.Lock()

    def write(self, record: Mapping[str, Any], wall_time: float) -> None:
        """Append ``record``'s series (nothing where it has none, or after :meth:`close`)."""
        with self._lock:
            if self._closed:
                return
            points = self._series.points(record, wall_time)
            if not points.scalars and not points.texts and not points.histograms:
                return
            data = _framed(self._encode(points))
            if not self._started and "loss" in record and "event" not in record:
                # The first training line: this process trained the steps up to it anew.
                self._started = True
                data = self._session_start(points) + data
            if self._fd is None:
                data = self._open(wall_time) + data
            assert self._fd is not None
            write_all(self._fd, data)

    def close(self) -> None:
        """Close the file; later writes are dropped."""
        with self._lock:
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _open(self, wall_time: float) -> bytes:
        """Make the file (a new one: a restarted task's goes beside its old one); returns its
        first record, the file version."""
        private_dir(self.directory)
        host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"
        name = f"events.out.tfevents.{int(wall_time):010d}.{host}.{os.getpid()}.{next(_files)}"
        self._fd = open_private(self.directory / name, os.O_WRONLY | os.O_APPEND | os.O_EXCL)
        version = self._protos.event.Event(wall_time=wall_time, file_version="brain.Event:2")
        return _framed(version.SerializeToString())

    def _session_start(self, points: Points) -> bytes:
        """A session start at the step of this process's first training line. TensorBoard's
        Python reader then drops the run's points at that step and after: those of an earlier
        process of this task (killed, restarted) that this one trained again. (The Rust reader
        drops them per tag, as each new point comes.) Events before it, such as the join at
        step 0 or ``resumed`` at the checkpoint's step, are at earlier steps and stay."""
        event = self._protos.event
        start = event.Event(
            wall_time=points.wall_time,
            step=points.step,
            session_log=event.SessionLog(status=event.SessionLog.START),
        )
        return _framed(start.SerializeToString())

    def _encode(self, points: Points) -> bytes:
        event = self._protos.event.Event(wall_time=points.wall_time, step=points.step)
        for tag, number in points.scalars.items():
            event.summary.value.add(tag=tag, simple_value=number)
        for tag, text in points.texts.items():
            value = event.summary.value.add(tag=tag)
            value.metadata.plugin_data.plugin_name = "text"
            value.tensor.dtype = self._protos.types.DT_STRING
            value.tensor.string_val.append(text.encode())
        for tag, counts in points.histograms.items():
            _histogram(event.summary.value.add(tag=tag).histo, counts)
        data: bytes = event.SerializeToString()
        return data


def _histogram(histo: Any, counts: Mapping[int, int]) -> None:
    """Fill a ``HistogramProto`` with integer ``counts``: one bucket per value from 0 up
    (value ``k`` in the bucket ending at ``k + 0.5``), the values above
    :data:`HISTOGRAM_BUCKETS` in the last one."""
    top = min(max(counts), HISTOGRAM_BUCKETS)
    buckets = [0] * (top + 1)
    for k, n in counts.items():
        buckets[min(k, top)] += n
    histo.min = float(min(counts))
    histo.max = float(max(counts))
    histo.num = float(sum(counts.values()))
    histo.sum = float(sum(k * n for k, n in counts.items()))
    histo.sum_squares = float(sum(k * k * n for k, n in counts.items()))
    histo.bucket_limit.extend([k + 0.5 for k in range(top)] + [float(max(counts)) + 0.5])
    histo.bucket.extend(float(n) for n in buckets)


def open_board(run_dir: Path, task: str) -> BoardWriter | None:
    """The writer of ``task``'s TensorBoard run in ``run_dir`` (``tensorboard/<task>``); None
    where tensorboard cannot be imported (said once a process, at info level), turned off by
    ``DISTSGD_TENSORBOARD=0``, or ``task`` is no plain name."""
    global _missing_noted
    if os.environ.get(ENV_VAR, "").strip().lower() in ("0", "false", "no", "off"):
        return None
    if not _NAME.fullmatch(task) or task in (".", ".."):
        log.warning("no TensorBoard events for task %r: not a plain name", task)
        return None
    protos = _protos()
    if isinstance(protos, str):
        if not _missing_noted:
            _missing_noted = True
            log.info("%s: no TensorBoard events (pip install 'distsgd[tensorboard]')", protos)
        return None
    _crc_blocks()  # now, not in the first write (which may be the launcher's, restarting a task)
    return BoardWriter(run_dir / TENSORBOARD_DIR / task, protos)
