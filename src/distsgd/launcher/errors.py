"""How a launch ends early: a failed task, Ctrl-C, or training that diverged."""

from __future__ import annotations

from distsgd.control.outcome import RunStatus


class RunFailed(RuntimeError):
    """A task failed or the run could not start; the message says which and why (for people),
    ``reason`` the same in one line, ``log_tail`` the failed task's last log lines."""

    def __init__(
        self,
        message: str,
        *,
        reason: str = "",
        log_tail: tuple[str, ...] = (),
        status: RunStatus = RunStatus.FAILED,
    ) -> None:
        super().__init__(message)
        self.reason = reason or message.split("\n", 1)[0]
        self.log_tail = log_tail
        self.status = status


class Interrupted(Exception):
    """Ctrl-C or SIGTERM reached the launcher."""


class RunDiverged(RuntimeError):
    """Training diverged (a non-finite loss, or a result no better than chance); ``stalled``:
    it ended at chance while its parameters barely moved (it did not learn)."""

    def __init__(self, reason: str, *, stalled: bool = False, unclear: bool = False) -> None:
        super().__init__(reason)
        self.stalled = stalled
        self.unclear = unclear
        """At chance, and the parameters moved too much to have stalled, too little to be
        sure it blew up (``TrainResult.unclear``)."""
