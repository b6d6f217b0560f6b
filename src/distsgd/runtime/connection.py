"""What a worker is connected to, behind one interface: :class:`Connection`.

A worker of a parameter-server scheme talks to the servers
(:class:`~distsgd.runtime.ps_connection.PsConnection`), one of a collective scheme to the
other workers' process group
(:class:`~distsgd.runtime.collective_connection.CollectiveConnection`), and a worker alone
to no one (this base class). :func:`distsgd.runtime.setup.connect` picks one; the session
holds it and never asks which it is.

Over a run the session calls, in order: :meth:`Connection.join` once the scheme's context
exists, and :meth:`~Connection.continue_at` once resumed; per step
:meth:`~Connection.settle`, :attr:`~Connection.shard_checkpoint` (chief, when a checkpoint
is due), :meth:`~Connection.trained`, :meth:`~Connection.after_step` and
:meth:`~Connection.step_fields`; at the end :meth:`~Connection.work_report`,
:meth:`~Connection.leave`, :meth:`~Connection.finish_fields`, (chief)
:meth:`~Connection.wait_for_others` and :meth:`~Connection.server_parameters`, then
:meth:`~Connection.part`; and always :meth:`~Connection.close`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from distsgd.control.metrics import MetricsWriter
from distsgd.control.task import TaskEnv

if TYPE_CHECKING:
    from distsgd.ps.client import ParameterClient
    from distsgd.runtime.collective import Collective
    from distsgd.runtime.context import WorkerContext
    from distsgd.runtime.work import LeasedBatches
    from distsgd.transport.proto import distsgd_pb2 as pb


class Connection:
    """A worker's connection to the rest of the run; this base class is a worker with no
    peers (a run alone, or one worker of a collective scheme): nothing to join, to leave or
    to wait for, and the cluster's step count is its own."""

    ps: ParameterClient | None = None
    """The parameter servers' client (``WorkerContext.ps``), or None."""
    collective: Collective | None = None
    """The process group of all workers (``WorkerContext``'s all-reduce), or None."""
    leased: LeasedBatches | None = None
    """(An elastic run counted in epochs) the batches leased from shard 0's work queue,
    which replace the worker's own shard of the data; None otherwise."""

    def join(self, ctx: WorkerContext, metrics: MetricsWriter) -> None:
        """Once the scheme's context exists: join the run's membership and keep it (its
        changes logged to ``metrics``)."""

    def continue_at(self, env: TaskEnv) -> int:
        """The local step a worker restarted after a fault goes on from, past its saved state
        (the steps in between already reached the servers); 0: from its saved state."""
        return 0

    @property
    def shard_checkpoint(self) -> Callable[[str], list[dict[str, Any]]] | None:
        """What saves every server's shard under a checkpoint's name (None: no servers)."""
        return None

    def settle(self, outcomes: deque[tuple[int, bool]]) -> None:
        """Before a step: the leased work units whose pushes landed are done."""
        if self.leased is not None:
            self.leased.settle(outcomes)

    def trained(self, pushes_started: int) -> None:
        """After a step's backward: its leased unit's update is in the pushes begun after."""
        if self.leased is not None:
            self.leased.trained(pushes_started)

    def after_step(self, ctx: WorkerContext) -> None:
        """After a step: the cluster's step count as far as this worker knows it (here its
        own: no servers count updates)."""
        ctx.global_step = ctx.local_step

    def step_fields(self, ctx: WorkerContext) -> dict[str, Any]:
        """What a metrics line of a step adds about the connection."""
        return {}

    def work_report(self, outcomes: deque[tuple[int, bool]]) -> pb.WorkStatus | None:
        """At the end: report the leased units still held; the queue's status (None: no
        leased work)."""
        return None if self.leased is None else self.leased.report(outcomes)

    def leave(self) -> None:
        """This worker is done with its steps: tell the servers (before the chief waits)."""

    def finish_fields(self) -> dict[str, Any]:
        """What the ``finished_steps`` metrics line adds about the connection."""
        return {}

    def wait_for_others(self, env: TaskEnv, checkpoints: Path | None) -> pb.WorkStatus | None:
        """(Chief, after :meth:`leave`) wait until the other workers are done, saving the
        servers' state under ``checkpoints`` meanwhile (None: no checkpoints); the work
        queue's last status (None: no leased work)."""
        return None

    def server_parameters(self) -> tuple[int, dict[str, np.ndarray]] | None:
        """(Chief, at the end) the servers' (version, parameters); None: no servers."""
        return None

    def part(self) -> None:
        """The normal end, after the chief's evaluation: every worker is done."""

    def close(self) -> None:
        """Always, after the end or a failure: heartbeat, sockets, process group."""
