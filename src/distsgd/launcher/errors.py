"""How a launch ends early: a failed task, Ctrl-C, or training that diverged."""

from __future__ import annotations


class RunFailed(RuntimeError):
    """A task failed or the run could not start; the message says which and why."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM reached the launcher."""


class Diverged(RuntimeError):
    """Training diverged (a non-finite loss, or a result no better than chance); ``stalled``:
    it ended at chance while its parameters barely moved (it did not learn)."""

    def __init__(self, reason: str, *, stalled: bool = False) -> None:
        super().__init__(reason)
        self.stalled = stalled
