"""The local engine: every task a process on this machine (the default).

Its task starter is :class:`~distsgd.launcher.supervisor.Supervisor`: each task in a session of
its own, stopped by its PID; workers forked by the fork server (:mod:`distsgd.launcher.zygote`)
where the run allows it. Emulated hosts (``--hosts``) put these same processes into network
namespaces (:mod:`distsgd_emulate.netns`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from distsgd.launcher.engines import Engine
from distsgd.launcher.supervisor import Supervisor

if TYPE_CHECKING:
    from distsgd.launcher.config import LaunchConfig
    from distsgd.launcher.progress import Console

FORK_SERVER_LOG = "fork-server.log"
"""The fork server's log, in the run folder."""


def _start(config: LaunchConfig, run_dir: Path, console: Console) -> Supervisor:
    server_log = run_dir / FORK_SERVER_LOG if config.forks_workers else None
    return Supervisor(
        log_dir=run_dir / "logs",
        echo=console.line,
        note=console.note,
        fork_server_log=server_log,
    )


ENGINE = Engine(name="local", flag="", places_tasks=False, assigns_devices=False, start=_start)
