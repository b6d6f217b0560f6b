"""Local SGD (periodic model averaging) and post-local SGD, over all-reduce.

Stich. *Local SGD Converges Fast and Communicates Little.* ICLR 2019; Lin, Stich, Patel, Jaggi.
*Don't Use Large Mini-Batches, Use Local SGD.* ICLR 2020 (post-local SGD).

Every worker, every step t::

    if t < switch_step:                         # post-local SGD: a synchronous phase first
        g <- (1/N) * sum_j grad L(w_j; batch_j)  # all-reduce of gradients, as `allreduce`
        w <- w - lr * g
    else:
        w <- w - lr * grad L(w; batch)          # a local step, no communication
        if (t + 1) % period == 0:
            w <- (1/N) * sum_j w_j              # all-reduce of the parameters

``switch_step = 0`` (the default) is plain local SGD; ``period = 1`` with plain SGD equals
synchronous all-reduce SGD. Optimizer state (momentum) stays local, as in the papers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distsgd.control.config import TrainConfig
from distsgd.plan.traffic import Traffic
from distsgd.schemes.base import WorkerRules
from distsgd.schemes.registry import SchemeSpec


@dataclass(frozen=True, kw_only=True)
class LocalsgdOptions:
    period: int = field(default=4, metadata={"help": "H: local steps between parameter averages"})
    switch_step: int = field(
        default=0, metadata={"help": "post-local SGD: all-reduce gradients before this step"}
    )

    def __post_init__(self) -> None:
        if self.period < 1:
            raise ValueError(f"period must be at least 1, got {self.period}")
        if self.switch_step < 0:
            raise ValueError(f"switch_step must be 0 or more, got {self.switch_step}")


class LocalsgdRules(WorkerRules):
    lr_rule = "sqrt"
    """N workers take 1/N of the steps, their replicas averaged every period: --lr x sqrt(N)."""

    uses_parameter_servers = False
    options: LocalsgdOptions

    def check_config(self, config: TrainConfig) -> None:
        super().check_config(config)
        self.refuse_compression(config, "localsgd")


SPEC = SchemeSpec(
    name="localsgd",
    summary="local SGD: average the replicas every `period` steps (post-local: sync first)",
    options=LocalsgdOptions,
    rules=LocalsgdRules,
    worker="distsgd.workers.localsgd:LocalsgdWorker",
    traffic=Traffic(kind="collective", period_option="period"),
)
