"""How a run ended, as data: the exit codes of ``distsgd run``/``demo``/``compare`` and the
:class:`RunOutcome` that :func:`distsgd.launcher.run.launch` returns.

Callers decide from the outcome's fields (``compare`` reads ``status`` and ``reason``; the CLI
turns it into its exit code); the launcher's console lines about a failure are for people only.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_DIVERGED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
"""Exit codes of ``distsgd run``/``demo``/``compare``: 3 means training finished or stopped but
diverged (or did not learn: ended at chance while its parameters barely moved); 2 is a usage
error found before anything started."""
EXIT_TERMINATED = 143
"""The exit code of a run stopped by SIGTERM: the shell's 128 + 15 (Ctrl-C, SIGINT, is 130)."""


class RunStatus(str, enum.Enum):
    """How a run ended."""

    OK = "ok"
    """Every worker finished and the chief wrote its result."""
    FAILED = "failed"
    """A task failed for good (out of restarts), or the run could not start or resume."""
    DIVERGED = "diverged"
    """Training diverged: a non-finite loss, or a final score no better than chance."""
    STALLED = "stalled"
    """It ended at chance while its parameters barely moved: it did not learn."""
    SETUP_ERROR = "setup error"
    """A worker refused its setup (a user mistake that a restart would repeat)."""
    INTERRUPTED = "interrupted"
    """Ctrl-C or SIGTERM stopped it."""

    @property
    def exit_code(self) -> int:
        """The process exit code for this status (a setup error is a failed run: 1)."""
        return _EXIT_CODES[self]


_EXIT_CODES = {
    RunStatus.OK: EXIT_OK,
    RunStatus.FAILED: EXIT_FAILED,
    RunStatus.DIVERGED: EXIT_DIVERGED,
    RunStatus.STALLED: EXIT_DIVERGED,
    RunStatus.SETUP_ERROR: EXIT_FAILED,
    RunStatus.INTERRUPTED: EXIT_INTERRUPTED,
}


@dataclass(frozen=True, kw_only=True)
class RunOutcome:
    """The end of one launch: what happened, why, and where its files are."""

    status: RunStatus
    """How it ended."""
    run_dir: Path
    """The run folder (logs, metrics, checkpoints, result)."""
    reason: str = ""
    """One line on why it did not end ``ok`` (the failed task and its exit code, the setup
    error, the divergence); empty when it did."""
    log_tail: tuple[str, ...] = ()
    """The failed task's last log lines (oldest first), when a task's failure ended the run."""
    result_path: Path | None = None
    """The chief's ``result.json`` when it wrote one, else None."""
    result: Mapping[str, Any] | None = None
    """That file's contents, as the launcher last wrote them."""
    terminated: bool = False
    """``interrupted`` by SIGTERM rather than Ctrl-C: exit code 143 (:data:`EXIT_TERMINATED`),
    not 130, as the shell has it."""

    @property
    def exit_code(self) -> int:
        """The exit code of ``distsgd run`` for this outcome."""
        if self.terminated and self.status is RunStatus.INTERRUPTED:
            return EXIT_TERMINATED
        return self.status.exit_code

    def explanation(self) -> str:
        """``reason``, followed by the failed task's last non-blank log line when there is one:
        'task worker1 failed (exit code 1): ValueError: bad'."""
        said = [line.strip() for line in self.log_tail if line.strip()]
        if not said:
            return self.reason
        return f"{self.reason.rstrip(':;')}: {said[-1]}"
