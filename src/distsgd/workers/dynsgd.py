"""The worker half of :mod:`distsgd.schemes.dynsgd` (its math, paper and options are there):
the PyTorch hooks its workers run around each step."""

from __future__ import annotations

from distsgd.runtime.context import WorkerContext
from distsgd.runtime.scheme import WorkerScheme
from distsgd.schemes.dynsgd import DynsgdRules


class DynsgdWorker(DynsgdRules, WorkerScheme):
    """Hogwild's worker; every push carries the version it was computed on (the runtime's
    ``mean_staleness`` metric reports what the server divided by)."""

    replica_from_servers = True  # it pulls before every step

    def before_step(self, ctx: WorkerContext) -> None:
        ctx.pull()

    def after_backward(self, ctx: WorkerContext) -> None:
        if ctx.skip_update:  # the gradient is not finite (a scaled loss overflowed): not sent
            return
        ctx.push_grads(base_version=ctx.versions, in_place=True)
