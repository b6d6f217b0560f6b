"""Launcher: starts a whole cluster on this machine, relays logs, shows progress, and stops
every process it started (process supervisor). Names are imported on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from distsgd.util.lazy import lazy_exports

__all__ = [
    "EXIT_DIVERGED",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "LaunchConfig",
    "launch",
]

_EXPORTS = {name: "distsgd.control.outcome" for name in __all__ if name.startswith("EXIT_")}
_EXPORTS.update(LaunchConfig="distsgd.launcher.config", launch="distsgd.launcher.run")

if TYPE_CHECKING:
    from distsgd.control.outcome import (
        EXIT_DIVERGED,
        EXIT_FAILED,
        EXIT_INTERRUPTED,
        EXIT_OK,
        EXIT_USAGE,
    )
    from distsgd.launcher.config import LaunchConfig
    from distsgd.launcher.run import launch

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
