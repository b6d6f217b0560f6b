"""The worker half of :mod:`distsgd.schemes.sagn` (its math, paper and options are there):
the PyTorch hooks its workers run around each step."""

from __future__ import annotations

import numpy as np

from distsgd.runtime.context import WorkerContext
from distsgd.schemes.sagn import SagnOptions, SagnRules
from distsgd.workers.agn import AgnWorker


class SagnWorker(SagnRules, AgnWorker):
    def __init__(self, options: SagnOptions, num_workers: int) -> None:
        super().__init__(options, num_workers)
        self.dropped = 0

    def stats(self) -> dict[str, float]:
        return {"dropped": self.dropped}

    def send(self, ctx: WorkerContext, update: dict[str, np.ndarray]) -> None:
        base = ctx.versions
        results = ctx.push(update, base_version=base)
        self.dropped += sum(not r.accepted for r in results)
        ctx.pull(min_version=[v + 1 for v in base])  # the round closed: everyone's sum is in
