"""Synchronous SGD by all-reduce, without parameter servers (torch.distributed: gloo or NCCL).

Goyal et al. *Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour.* 2017; the ring
all-reduce of Patarasuk & Yuan (2009) popularised for deep learning by Baidu and Horovod.

Every worker, every step::

    g   <- grad L(w; batch_i)
    g   <- (1/N) * sum_j g_j            # all-reduce
    w   <- w - lr * g                   # same update on every replica (momentum if set)

Replicas start equal (broadcast from worker 0) and stay equal.
"""

from __future__ import annotations

from dataclasses import dataclass

from distsgd.runtime.context import WorkerContext
from distsgd.runtime.scheme import WorkerScheme
from distsgd.schemes.registry import SchemeSpec


@dataclass(frozen=True, kw_only=True)
class AllreduceOptions:
    """All-reduce SGD has no options of its own; --lr and --momentum set the local optimizer."""


class AllreduceWorker(WorkerScheme):
    uses_parameter_servers = False
    evaluate_on = "local"

    def __init__(self, options: AllreduceOptions, num_workers: int) -> None:
        self.options = options

    def start(self, ctx: WorkerContext) -> None:
        self.optimizer = ctx.make_optimizer("sgd")
        ctx.broadcast(list(ctx.params.values()))

    def after_backward(self, ctx: WorkerContext) -> None:
        ctx.allreduce_mean([p.grad for p in ctx.params.values() if p.grad is not None])
        self.optimizer.step()


SPEC = SchemeSpec(
    name="allreduce",
    summary="synchronous SGD by all-reduce of gradients (torch.distributed), no parameter servers",
    options=AllreduceOptions,
    worker=AllreduceWorker,
)
