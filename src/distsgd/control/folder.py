"""The files of a run folder that the runtime writes and the launcher and the tools read."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from distsgd.util import open_private, write_bytes_atomic, write_stream_atomic

CONFIG_FILE = "config.json"
"""The run's settings, a :class:`~distsgd.control.spec.RunSpec` (written when the run starts)."""
METRICS_FILE = "metrics.jsonl"
"""One JSON object per line from every task (``control.metrics.MetricsWriter``)."""
RESULT_FILE = "result.json"
"""The chief's ``TrainResult`` (runtime/loop.py) and the training config."""
FINAL_PARAMS_FILE = "final_model.pt"
"""The final parameters, a ``state_dict`` of tensors (``torch.load(weights_only=True)``)."""
TENSORBOARD_DIR = "tensorboard"
"""TensorBoard event files, a folder (one TensorBoard run) per task (``control.board``)."""

RUNS_ENV = "DISTSGD_RUNS"
"""Environment variable: the folder new run folders go in (default ``./distsgd-runs``); ``off``
keeps a script run alone (``python script.py``) from writing one."""


def runs_root() -> Path | None:
    """Where new run folders go, from :data:`RUNS_ENV`; None when it says ``off``."""
    value = os.environ.get(RUNS_ENV, "distsgd-runs")
    return None if value.strip().lower() == "off" else Path(value)


def new_run_folder(label: str, root: Path | None = None) -> Path:
    """``<root>/<time>-<label>``, with ``-2``, ``-3`` ... when that exists (not created)."""
    base = (root or Path("distsgd-runs")) / f"{time.strftime('%Y%m%d-%H%M%S')}-{label}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


@dataclass(frozen=True, kw_only=True)
class TaskFile:
    """A file of the run folder that a task writes (and the way it may), as the launcher's run
    control accepts it from the network (``launcher/control.py``): nothing else may be named."""

    pattern: str
    """Its name relative to the run folder, a regular expression matched whole."""
    append: bool
    """Written by adding at its end (``metrics.jsonl``) rather than replaced whole."""
    limit: int
    """The most bytes one write may carry."""
    readable: bool = False
    """Whether a task may read it back (a server's address; a kill's marks; the result)."""


_MiB = 1 << 20
TASK_FILES = (
    TaskFile(pattern=re.escape(METRICS_FILE), append=True, limit=8 * _MiB),
    TaskFile(pattern=re.escape(RESULT_FILE), append=False, limit=64 * _MiB, readable=True),
    TaskFile(pattern=re.escape(FINAL_PARAMS_FILE), append=False, limit=1 << 40),
    TaskFile(pattern=r"(ps|replica)[0-9]{1,6}\.address", append=False, limit=256, readable=True),
    TaskFile(pattern=r"(ps|worker)[0-9]{1,6}\.setup-error\.json", append=False, limit=_MiB),
    TaskFile(pattern=r"faults/[a-z-]{1,32}[0-9]{1,6}-at-[0-9]{1,12}\.(due|landed)", append=False,
             limit=64, readable=True),
)  # fmt: skip
"""The files a task writes in the run folder: the one table the run control checks names by."""


def task_file(name: str) -> TaskFile:
    """The entry of :data:`TASK_FILES` that ``name`` is; ValueError when it is none."""
    for entry in TASK_FILES:
        if re.fullmatch(entry.pattern, name):
            return entry
    raise ValueError(f"{name!r} is not a file a task writes in the run folder")


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (``os.write`` may write part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class RunFiles(Protocol):
    """The run folder's files as a task reaches them: on its own disk (:class:`LocalFiles`) or
    through the launcher's run control (``control/remote_files.py``). ``name`` is relative to
    the run folder, one of :data:`TASK_FILES`."""

    def append(self, name: str, data: bytes) -> None:
        """Add ``data`` at the file's end, in one piece."""

    def put(self, name: str, data: bytes) -> None:
        """Replace the file by ``data``, atomically."""

    def put_stream(self, name: str, write: Callable[[BinaryIO], object]) -> None:
        """Replace the file, atomically, by what ``write`` writes into the (seekable) file it
        is given: a large file is never whole in memory."""

    def get(self, name: str) -> bytes | None:
        """The file's bytes; None when there is none."""

    def remove(self, name: str) -> None:
        """Remove the file (nothing when there is none)."""

    def close(self) -> None:
        """Send what is still buffered and let go."""


class LocalFiles:
    """:class:`RunFiles` in a run folder on this disk (a task that shares the launcher's)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _path(self, name: str) -> Path:
        task_file(name)
        return self.root / name

    def append(self, name: str, data: bytes) -> None:
        fd = open_private(self._path(name), os.O_WRONLY | os.O_APPEND)
        try:
            write_all(fd, data)
        finally:
            os.close(fd)

    def put(self, name: str, data: bytes) -> None:
        write_bytes_atomic(self._path(name), data)

    def put_stream(self, name: str, write: Callable[[BinaryIO], object]) -> None:
        write_stream_atomic(self._path(name), write)

    def get(self, name: str) -> bytes | None:
        try:
            return self._path(name).read_bytes()
        except FileNotFoundError:
            return None

    def remove(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def close(self) -> None:
        """Nothing is buffered."""
