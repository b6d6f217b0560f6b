"""What the collaborators of a local run share (:class:`RunState`): its settings, folder,
tasks, progress and events, and the bookkeeping each of them reads or changes (the workers
meant to run, the tasks done, restarts in a row, rollbacks taken). The collaborators are
:class:`~distsgd.launcher.tasks.TaskStarter`, :class:`~distsgd.launcher.server_watch.ServerWatch`,
:class:`~distsgd.launcher.restart.PlanExecutor`, :class:`~distsgd.launcher.scaler.Scaler` and
:class:`~distsgd.launcher.fault_driver.FaultDriver`, composed by
:class:`~distsgd.launcher.run.LocalRun`."""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path

from distsgd.control.folder import METRICS_FILE
from distsgd.control.metrics import MetricsWriter
from distsgd.control.recovery import RunTopology
from distsgd.launcher.config import LaunchConfig
from distsgd.launcher.progress import Console, Progress
from distsgd.launcher.supervisor import Tasks
from distsgd.transport.security import SECRET_FILE_ENV, load_secret, write_secret_file


def run_identity(config: LaunchConfig, run_dir: Path) -> tuple[str, str | None]:
    """The run's id and its secret: the secret file kept on ``--resume`` (the restored shards
    know the run), else a new one written."""
    run_id = config.run_id or secrets.token_hex(8)
    secret_file = run_dir / "secret"
    if config.resume:
        return run_id, load_secret({SECRET_FILE_ENV: str(secret_file)})
    return run_id, write_secret_file(secret_file)


@dataclass(eq=False, kw_only=True)
class RunState:
    """One local run's shared facts and bookkeeping."""

    config: LaunchConfig
    """The run's settings (a rollback replaces them with its ``lr_cut`` among the overrides)."""
    console: Console
    run_dir: Path
    supervisor: Tasks
    stop: threading.Event
    """Set by Ctrl-C or SIGTERM."""
    run_id: str
    secret: str | None
    progress: Progress
    events: MetricsWriter
    active: set[int] = field(default_factory=set)
    """The worker indexes meant to run now (``distsgd elastic scale`` changes them)."""
    done: set[str] = field(default_factory=set)
    """Tasks that have finished (or left, or were dropped)."""
    restarts: dict[str, int] = field(default_factory=dict)
    """Restarts of each task in a row (reset once it runs healthy_seconds)."""
    started_at: dict[str, float] = field(default_factory=dict)
    """When each task was last started (monotonic seconds)."""
    restored_ps: set[int] = field(default_factory=set)
    """Parameter servers restored from a file in this cluster's life (told who finished)."""
    rollbacks: tuple[dict[str, object], ...] = ()
    """The rollbacks taken so far (``result.json``'s ``rollbacks``)."""

    @classmethod
    def open(
        cls,
        config: LaunchConfig,
        console: Console,
        run_dir: Path,
        supervisor: Tasks,
        stop: threading.Event,
        *,
        run_id: str,
        secret: str | None,
    ) -> RunState:
        """The state of a run starting now: its progress read from, and its events written
        to, the run folder's metrics file."""
        return cls(
            config=config,
            console=console,
            run_dir=run_dir,
            supervisor=supervisor,
            stop=stop,
            run_id=run_id,
            secret=secret,
            progress=Progress(run_dir / METRICS_FILE),
            events=MetricsWriter(run_dir / METRICS_FILE, "launcher"),
            active=set(range(config.size.workers)),
        )

    @property
    def checkpointing(self) -> bool:
        return bool(
            self.config.durability.checkpoint_every or self.config.durability.checkpoint_seconds
        )

    @property
    def ckpt_root(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def wal_root(self) -> Path:
        return self.run_dir / "wal"

    @property
    def rollbacks_left(self) -> int:
        """Rollbacks the run may still take (each worker watches for spikes while any are)."""
        return max(0, self.config.durability.max_rollbacks - len(self.rollbacks))

    def topology(self) -> RunTopology:
        return RunTopology(
            collective=self.config.collective,
            workers=len(self.active),
            min_workers=self.config.size.lowest_workers,
            elastic=self.config.size.elastic,
            checkpointing=self.checkpointing,
        )
