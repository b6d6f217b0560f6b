"""Why a checkpoint, or one of its files, cannot be used."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(ValueError):
    """No usable checkpoint; the message says which and why."""


class IncompleteCheckpoint(CheckpointError):
    """A checkpoint folder without its manifest: being written now, or its write was cut off."""


class UnsafeFileError(CheckpointError):
    """A file holds Python objects that could run code when loaded; it is never loaded.

    Unlike a damaged file, which is skipped for an older one, this one stops a resume: someone
    wrote it on purpose, and the user has to look.
    """


def refuse_code(path: Path, found: list[str]) -> UnsafeFileError:
    """The error for a worker state file holding the Python objects ``found`` (may be empty)."""
    what = f": {', '.join(found[:3])}{', ...' if len(found) > 3 else ''}" if found else ""
    return UnsafeFileError(
        f"{path}: not a distsgd worker state (it holds Python objects that could run code"
        f"{what}; distsgd never loads those)"
    )


def first_line(exc: BaseException) -> str:
    """``exc`` in one short line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
