"""Typed outcomes of a worker task that the launcher acts on by exit code, and the record of a
setup error (or of a script's error after its training finished) that the worker leaves in the
run folder for the launcher to read (:class:`SetupErrorRecord`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from distsgd.cluster import TaskId
from distsgd.control.folder import RunFiles

SETUP_EXIT_CODE = 87
"""Exit code of a worker task that refused its setup (:class:`SetupError`): the launcher does
not restart it, since the same script and flags would fail the same way."""

AFTER_TRAINING_EXIT_CODE = 88
"""Exit code of a worker task whose script raised after its training finished (after
``distsgd.train`` returned or ``Worker.finish``): the script's own error, not training's. The
launcher does not restart it (a restart would redo finished training and overwrite the run's
record); the run ends when the other workers do, and fails with the script's error."""

SETUP_ERROR_PREFIX = "distsgd: error: "
"""How the task's stderr line about its setup error begins (for people reading its log)."""


ErrorKind = Literal["setup", "after_training", "crash"]
"""What a task's error record says: a setup error (:data:`SETUP_EXIT_CODE`), the script's
error after its training finished (:data:`AFTER_TRAINING_EXIT_CODE`), or an error the script
raised while training (exit code 1, restarted: the launcher names it when restarts run out)."""

MESSAGE_LIMIT = 600
"""Characters of an error's message kept in its one line (a message may hold a tensor)."""


def one_line(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """A message as one line: its lines joined, none dropped (a message's first line alone
    may end inside a quotation), at most ``limit`` characters (then ``...``)."""
    joined = " ".join(line.strip() for line in text.strip().splitlines() if line.strip())
    return joined if len(joined) <= limit else joined[: limit - 3] + "..."


class SetupError(ValueError):
    """A user mistake found before (or at) the first step: settings a scheme cannot honour,
    data it cannot read, a loop that bypasses the scheme. One line: the cause and the fix."""


@dataclass(frozen=True, kw_only=True)
class SetupErrorRecord:
    """Why a worker refused its setup, as it writes it to the run folder before it exits with
    :data:`SETUP_EXIT_CODE` (``<task>.setup-error.json``), or why its script failed after its
    training finished (:data:`AFTER_TRAINING_EXIT_CODE`); the launcher reports ``message``."""

    task: TaskId
    """The worker that refused."""
    message: str
    """The :class:`SetupError`'s message: the cause and the fix."""
    kind: ErrorKind = "setup"
    """``after_training``: the script raised after its training finished (exit
    :data:`AFTER_TRAINING_EXIT_CODE`; ``message`` names its line, the training's result
    stands); ``crash``: it raised while training (``message``: the error in one line)."""

    @staticmethod
    def path(run_dir: Path, task: TaskId) -> Path:
        """Where ``task`` writes its record in ``run_dir``."""
        return Path(run_dir) / f"{task.name}.setup-error.json"

    def save(self, files: RunFiles) -> None:
        """Write the record into the run folder (``files``), atomically."""
        data: dict[str, object] = {"task": self.task.name, "message": self.message}
        if self.kind != "setup":
            data["kind"] = self.kind
        files.put(f"{self.task.name}.setup-error.json", (json.dumps(data) + "\n").encode())

    @classmethod
    def load(cls, run_dir: Path, task: TaskId) -> SetupErrorRecord | None:
        """``task``'s record in ``run_dir``; None when it wrote none (or an unreadable one)."""
        try:
            data = json.loads(cls.path(run_dir, task).read_text())
            kind = data.get("kind", "setup")
            if kind not in get_args(ErrorKind):
                return None
            task = TaskId.parse(str(data["task"]))
            return cls(task=task, message=str(data["message"]), kind=kind)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    @classmethod
    def clear(cls, run_dir: Path, task: TaskId) -> None:
        """Remove ``task``'s record (before it starts again: an old one would say a stale cause)."""
        cls.path(run_dir, task).unlink(missing_ok=True)
