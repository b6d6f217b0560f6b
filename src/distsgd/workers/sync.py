"""The worker half of :mod:`distsgd.schemes.sync` (its math, paper and options are there):
the PyTorch hooks its workers run around each step."""

from __future__ import annotations

from distsgd.runtime.context import WorkerContext
from distsgd.runtime.scheme import WorkerScheme
from distsgd.schemes.sync import SyncOptions, SyncRules


class SyncWorker(SyncRules, WorkerScheme):
    replica_from_servers = True  # it pulls before every step

    def __init__(self, options: SyncOptions, num_workers: int) -> None:
        super().__init__(options, num_workers)
        self.next_versions: list[int] | int = 0
        self.dropped = 0

    def stats(self) -> dict[str, float]:
        return {"dropped": self.dropped}

    def before_step(self, ctx: WorkerContext) -> None:
        ctx.pull(min_version=self.next_versions)

    def after_backward(self, ctx: WorkerContext) -> None:
        if ctx.skip_update:
            # The gradient is not finite (a scaled loss overflowed): not sent; the next step
            # computes this worker's gradient for the same round again, on the same version.
            return
        base = ctx.versions
        if self.rates:
            factor = self.rates[ctx.rank] / ctx.config.lr
            results = ctx.push({k: g * factor for k, g in ctx.grads().items()}, base_version=base)
        else:
            results = ctx.push_grads(base_version=base)
        self.dropped += sum(not r.accepted for r in results)
        self.next_versions = [v + 1 for v in base]
