"""Launcher: starts a whole cluster on this machine, relays logs, shows progress, and stops
every process it started (process supervisor)."""

from distsgd.launcher.config import LaunchConfig
from distsgd.launcher.run import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, launch

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "LaunchConfig", "launch"]
