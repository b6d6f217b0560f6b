"""Synchronous SGD by all-reduce, without parameter servers (torch.distributed: gloo or NCCL).

Goyal et al. *Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour.* 2017; the ring
all-reduce of Patarasuk & Yuan (2009) popularised for deep learning by Baidu and Horovod.

Every worker, every step::

    g   <- grad L(w; batch_i)
    g   <- (1/N) * sum_j g_j            # all-reduce
    w   <- w - lr * g                   # same update on every replica (momentum if set)

Replicas start equal (broadcast from worker 0) and stay equal.

The worker trains through PyTorch's ``DistributedDataParallel``, which all-reduces buckets of
gradients while backward still runs. ``--wire-dtype fp16`` or ``bf16`` sends them in 16 bits
(DDP's ``fp16_compress_hook`` / ``bf16_compress_hook``); ``--powersgd-rank R`` sends each
gradient matrix as two rank-R factors after ``powersgd_start`` plain steps (Vogels, Karimireddy,
Jaggi. *PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization.*
NeurIPS 2019), with error feedback: what the factors miss is added to the next step's gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distsgd.control.config import TrainConfig
from distsgd.plan.traffic import Traffic
from distsgd.ps import wire
from distsgd.schemes.base import WorkerRules
from distsgd.schemes.registry import SchemeSpec


@dataclass(frozen=True, kw_only=True)
class AllreduceOptions:
    """--lr and --momentum set the local optimizer; --wire-dtype and --powersgd-rank the hook."""

    powersgd_start: int = field(
        default=10,
        metadata={
            "help": "with --powersgd-rank: steps of plain float32 all-reduce before PowerSGD "
            "starts (torch's start_powerSGD_iter, at least 2; torch suggests a tenth of the "
            "run, and no fewer than the warmup's steps)"
        },
    )

    dynamic_graph: bool = field(
        default=False,
        metadata={
            "help": "the parameters forward uses change from step to step: DDP then looks for "
            "unused ones at every step (a walk of the graph and one small all-reduce more per "
            "step) instead of at the first step only (static_graph)"
        },
    )

    def __post_init__(self) -> None:
        if self.powersgd_start < 2:
            raise ValueError(
                f"powersgd_start must be at least 2 (DDP rebuilds its buckets after the first "
                f"step), got {self.powersgd_start}"
            )


class AllreduceRules(WorkerRules):
    uses_parameter_servers = False
    lr_rule = "sqrt"
    """N workers take 1/N of the steps, each on the mean of N batches: --lr x sqrt(N)."""

    options: AllreduceOptions

    def __init__(self, options: AllreduceOptions, num_workers: int) -> None:
        super().__init__(options, num_workers)
        self.alone = num_workers == 1

    def check_config(self, config: TrainConfig) -> None:
        if self.alone:  # nothing travels: a script run alone (python train.py) keeps its config
            return
        self.refuse_pull_dtype(config, "allreduce")
        if config.wire_dtype in wire.pushes() and config.wire_dtype not in wire.hooks():
            raise ValueError(
                f"--wire-dtype {config.wire_dtype} under allreduce: integer codes are for "
                "parameter-server schemes; use fp16, bf16 or --powersgd-rank"
            )
        if config.topk:
            raise ValueError(
                "--topk under allreduce: top-k is for parameter-server schemes; drop --topk, "
                "or use --wire-dtype fp16/bf16 or --powersgd-rank"
            )
        if config.powersgd_rank and config.wire_dtype != "float32":
            raise ValueError(
                f"--powersgd-rank with --wire-dtype {config.wire_dtype}: one compression at a "
                "time under allreduce; drop one of them"
            )


SPEC = SchemeSpec(
    name="allreduce",
    summary="synchronous SGD by all-reduce of gradients (torch.distributed), no parameter servers",
    options=AllreduceOptions,
    rules=AllreduceRules,
    worker="distsgd.workers.allreduce:AllreduceWorker",
    traffic=Traffic(kind="collective"),
)
