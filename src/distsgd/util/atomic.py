"""Atomic file writes: a reader, or a crash, sees the old file or the new one, never half of one.

And private files: what distsgd writes (run folders, logs, metrics, checkpoints) is its user's
only: folders it creates are 0700 (:func:`private_dir`), files 0600 (:func:`open_private`, and
the temporary file an atomic write renames, which ``mkstemp`` makes 0600).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

PRIVATE_DIR_MODE = 0o700
"""Mode of every folder distsgd creates (its user only)."""
PRIVATE_FILE_MODE = 0o600
"""Mode of every file distsgd creates (its user only)."""


def private_dir(path: Path) -> Path:
    """Create ``path`` and its missing parents, each 0700 (folders already there keep their
    mode); returns ``path``."""
    path = Path(path)
    missing = []
    for folder in (path, *path.parents):
        if folder.is_dir():
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:
            if not folder.is_dir():
                raise
    return path


def open_private(path: Path, flags: int) -> int:
    """``os.open(path, flags | O_CREAT)``, a new file made 0600; the descriptor."""
    return os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE_MODE)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` (0600), fsync it, then rename over
    ``path``; missing folders are made 0700."""
    write_stream_atomic(path, lambda f: f.write(data))


def write_stream_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """:func:`write_bytes_atomic` of what ``write`` writes into the (seekable) file it is
    given: a large file is never whole in memory."""
    path = Path(path)
    private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_atomic(path: Path, text: str) -> None:
    """Text version of :func:`write_bytes_atomic`."""
    write_bytes_atomic(path, text.encode())


def file_digest(path: Path) -> tuple[str, int]:
    """(SHA-256 in hex, size in bytes) of a file, read in 1 MiB blocks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size
