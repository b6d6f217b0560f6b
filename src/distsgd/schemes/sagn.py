"""SAGN: Synchronous Accumulated Gradient Normalization.

Hermans, Spanakis, Moeckel. *Accumulated Gradient Normalization.* ACML 2017 (arXiv:1710.02368),
the synchronous variant; Hermans' thesis (2017).

AGN's worker, with the pushes of one round gathered before the center moves. Worker i, round t::

    w_i <- pull(min_version = t);  w_start <- w_i       # waits until round t-1 is applied
    repeat lambda times:  w_i <- w_i - lr * grad L(w_i; batch)
    delta_i <- (w_start - w_i) / lambda                 # normalized accumulated gradient
    push(delta_i, base_version = t)

Server, for round t (the synchronous rule of ``sync``: late pushes are stale and dropped)::

    once N normalized updates are in:
        w <- w - server_lr * sum_i delta_i              # server_lr = 1: each counts in full
        t <- t + 1

With ``server_lr = 1/N`` the center takes the mean instead: one step of large-batch SGD on the
N * lambda batches' mean gradient. No worker ever computes on stale parameters, so SAGN has
AGN's normalization without its staleness; the price is waiting for the slowest worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from distsgd.control.config import TrainConfig
from distsgd.plan.traffic import Traffic
from distsgd.ps.deadline import parse_step_timeout
from distsgd.schemes.agn import AgnOptions, AgnRules
from distsgd.schemes.registry import SchemeSpec
from distsgd.schemes.sync import SyncServer, step_timeout_options


@dataclass(frozen=True, kw_only=True)
class SagnOptions:
    window: int = field(
        default=4, metadata={"help": "lambda: local steps between synchronous rounds"}
    )
    server_lr: float = field(
        default=1.0,
        metadata={"help": "rate on the sum of a round's normalized updates (1/workers: mean)"},
    )
    step_timeout: str = field(
        default="60",
        metadata={
            "help": "seconds a round waits for missing (dead) workers, then closes; auto: a "
            "deadline learned from the rounds before"
        },
    )

    def __post_init__(self) -> None:
        AgnOptions(window=self.window, server_lr=self.server_lr)  # same checks
        parse_step_timeout(self.step_timeout)


class SagnServer(SyncServer):
    """``sync``'s rule (rounds, stale and duplicate refusal, timeouts) applying the sum."""

    def step_scale(self) -> float:
        return 1.0  # the pushes are already lr-scaled updates; ServerSGD's lr is server_lr


class SagnRules(AgnRules):
    lr_rule = "sqrt"
    """N workers take 1/N of the local steps, each round the sum of N normalized steps:
    --lr x sqrt(N)."""

    def __init__(self, options: SagnOptions, num_workers: int) -> None:
        super().__init__(
            AgnOptions(window=options.window, server_lr=options.server_lr), num_workers
        )
        self.num_workers = num_workers
        self.step_timeout = options.step_timeout

    def server_options(self, config: TrainConfig) -> dict[str, Any]:
        return {
            "lr": self.server_lr,
            "required": self.num_workers,
            **step_timeout_options(self.step_timeout),
        }


SPEC = SchemeSpec(
    name="sagn",
    summary="synchronous AGN: rounds of `window` local steps, normalized updates summed",
    options=SagnOptions,
    rules=SagnRules,
    worker="distsgd.workers.sagn:SagnWorker",
    server=SagnServer,
    step_size=("lr", "server_lr"),
    traffic=Traffic(kind="sync", period_option="window"),
)
