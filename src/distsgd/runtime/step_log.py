"""What a worker writes about its steps: :class:`StepLog`, the metrics line of every
``log_every``-th step and the one when its steps end (and the progress line of a script run
alone)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from distsgd.control.metrics import MetricsWriter
from distsgd.control.progress import AloneProgress
from distsgd.runtime.checkpoint import Checkpointer
from distsgd.runtime.context import WorkerContext


class StepLog:
    """A worker's step lines in ``metrics.jsonl`` (``alone``: and the progress line of a script
    run alone, ``python script.py``)."""

    def __init__(self, metrics: MetricsWriter, *, alone: bool) -> None:
        self.metrics = metrics
        self.alone = AloneProgress() if alone else None

    def step(
        self,
        ctx: WorkerContext,
        *,
        progress: tuple[int, int] | None,
        loss: float,
        samples: int,
        last: bool,
        epoch: int | None,
        extra: Mapping[str, Any],
    ) -> None:
        """The line of the step ``ctx`` has just taken: ``progress`` (done, total; None: the
        loop decides the end), the step's ``loss`` (NaN: none), the samples trained so far,
        whether it is the ``last`` step, the data's ``epoch``, and the connection's and the
        scheme's ``extra`` values."""
        fraction = None if progress is None else progress[0] / max(1, progress[1])
        finite = math.isfinite(loss)
        if self.alone is not None:
            self.alone.update(
                step=ctx.local_step,
                fraction=fraction,
                loss=loss if finite else None,
                samples=samples,
                last=last,
            )
        self.metrics.log(
            step=ctx.global_step,
            local_step=ctx.local_step,
            **({"progress": round(min(1.0, fraction), 4)} if fraction is not None else {}),
            **({"loss": round(loss, 6)} if finite else {}),
            samples=samples,
            **({"epoch": epoch} if epoch is not None else {}),
            bytes_sent=ctx.bytes_sent,
            bytes_received=ctx.bytes_received,
            lost_pushes=ctx.lost_pushes,
            nonfinite_skipped=ctx.nonfinite_skipped,
            **extra,
            **ctx.clock.metrics(),
        )

    def finished(
        self,
        ctx: WorkerContext,
        *,
        seconds: float,
        checkpoints: Checkpointer | None,
        extra: Mapping[str, Any],
    ) -> None:
        """The ``finished_steps`` line: the loop's ``seconds``, the checkpoints taken, the
        connection's ``extra`` values, the time split, and (through parameter servers) the
        ``staleness`` histogram of this worker's accepted shard pushes."""
        self.metrics.log(
            step=ctx.global_step,
            local_step=ctx.local_step,
            event="finished_steps",
            seconds=round(seconds, 3),
            checkpoints=0 if checkpoints is None else checkpoints.count,
            checkpoint_seconds=0.0 if checkpoints is None else round(checkpoints.seconds, 4),
            **extra,
            **ctx.clock.metrics(),
            **({"staleness": ctx.staleness_histogram()} if ctx.applied_pushes else {}),
        )
