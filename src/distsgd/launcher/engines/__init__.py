"""Engines: where the tasks of a run run, behind one seam.

An engine starts, watches and stops the tasks of one run
(:class:`~distsgd.launcher.supervisor.Tasks`: start a task from its command line and
environment; its handle's ``poll``, ``kill``, ``terminate`` and ``interrupt``; ``stop``,
``forget``, ``close``). Everything else of a run is the launcher's and the same on every engine:
the task specs and command lines, restarts (:mod:`distsgd.control.recovery` decides, the
launcher carries out through the engine), injected faults, progress and the run folder.

An engine also says the two things the launcher decides by before it starts one
(:class:`Engine`): whether it places the tasks on machines itself (then ``--hosts``, which
places local processes in emulated hosts, does not apply), and whether it hands each task its
devices (Ray gives a task the GPU its bundle reserved; locally the launcher assigns
``CUDA_VISIBLE_DEVICES`` itself).

Engines: ``local`` (processes on this machine, :mod:`distsgd.launcher.engines.local`) and
``ray`` (Ray actors, ``--ray``, :mod:`distsgd.launcher.engines.ray`). To add one: a module here
whose ``ENGINE`` is an :class:`Engine`, a line in :data:`ENGINES`, and the flag that chooses it
in :func:`engine_name`. A module is imported only when its engine is chosen: Ray's imports
nothing of Ray unless a run asks for it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distsgd.launcher.config import LaunchConfig
    from distsgd.launcher.progress import Console
    from distsgd.launcher.supervisor import Tasks

ENGINES: dict[str, str] = {
    "local": "distsgd.launcher.engines.local",
    "ray": "distsgd.launcher.engines.ray",
}
"""Each engine's name and the module that holds its :class:`Engine` (as ``ENGINE``)."""


@dataclass(frozen=True, kw_only=True)
class Engine:
    """One engine, as the launcher sees it before it starts one."""

    name: str
    """How the console and the errors name it."""
    flag: str
    """The command-line flag that chooses it ("" for the default)."""
    places_tasks: bool
    """Whether it puts each task on a machine itself (``--hosts`` then does not apply)."""
    assigns_devices: bool
    """Whether it hands each task its devices (the launcher then sets no
    ``CUDA_VISIBLE_DEVICES``, and tells a Keras script nothing of a GPU)."""
    start: Callable[[LaunchConfig, Path, Console], Tasks]
    """Its task starter for one run (``config``, the run folder, the console)."""


def engine_name(config: LaunchConfig) -> str:
    """The engine a run's flags choose: ``ray`` with ``--ray``, else ``local``."""
    return "ray" if config.hosting.ray is not None else "local"


def engine_for(config: LaunchConfig) -> Engine:
    """The chosen engine (its module imported now)."""
    engine: Engine = importlib.import_module(ENGINES[engine_name(config)]).ENGINE
    return engine
