"""Typed outcomes of a worker task that the launcher acts on by exit code."""

from __future__ import annotations

SETUP_EXIT_CODE = 87
"""Exit code of a worker task that refused its setup (:class:`SetupError`): the launcher does
not restart it, since the same script and flags would fail the same way."""

SETUP_ERROR_PREFIX = "distsgd: error: "
"""How the task's last stderr line begins; the launcher shows that line as the run's error."""


class SetupError(ValueError):
    """A user mistake found before (or at) the first step: settings a scheme cannot honour,
    data it cannot read, a loop that bypasses the scheme. One line: the cause and the fix."""
