"""EAMSGD: asynchronous elastic averaging with Nesterov momentum on the workers.

Zhang, Choromanska, LeCun. *Deep learning with Elastic Averaging SGD.* NeurIPS 2015
(Algorithm 2, asynchronous EAMSGD).

EASGD's elastic exchange with the center every ``tau`` steps; between exchanges each worker
takes Nesterov momentum steps with its own velocity v_i (kept across exchanges)::

    every tau steps (before the gradient step):
        c    <- pull()
        diff <- alpha * (x_i - c)
        x_i  <- x_i - diff;  push(diff)          # server: c <- c + diff
    every step:
        g    <- grad L(x_i + delta * v_i; batch) # the gradient at the look-ahead point
        v_i  <- delta * v_i - lr * g
        x_i  <- x_i + v_i

``delta`` is the momentum term. The paper uses delta = 0.99 with small learning rates; the
default here is 0.9, for the run's ``--lr`` is shared with the SGD schemes: the effective step
is about lr / (1 - delta), so lower ``--lr`` as ``delta`` grows. ``alpha`` defaults to 0.9 / p
for p workers, as in the paper. The chief evaluates the center.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distsgd.plan.traffic import Traffic
from distsgd.schemes.easgd import EasgdOptions, EasgdRules, ElasticServer
from distsgd.schemes.registry import SchemeSpec


@dataclass(frozen=True, kw_only=True)
class EamsgdOptions:
    tau: int = field(
        default=4, metadata={"help": "local steps between elastic exchanges (communication period)"}
    )
    alpha: float = field(
        default=0.0,
        metadata={"help": "moving rate; 0 = 0.9 / workers (beta = 0.9, as in the paper)"},
    )
    delta: float = field(default=0.9, metadata={"help": "Nesterov momentum of each worker"})

    def __post_init__(self) -> None:
        EasgdOptions(tau=self.tau, alpha=self.alpha)  # same checks
        if not 0.0 <= self.delta < 1.0:
            raise ValueError(f"delta must be in [0, 1), got {self.delta}")


class EamsgdRules(EasgdRules):
    lr_rule = "inverse-sqrt"
    """Momentum delta multiplies each step by about 1 / (1 - delta), and N workers push
    elastic differences at the center: --lr / sqrt(N) (measured: docs/schemes/defaults.md)."""

    def __init__(self, options: EamsgdOptions, num_workers: int) -> None:
        super().__init__(EasgdOptions(tau=options.tau, alpha=options.alpha), num_workers)
        self.delta = options.delta


SPEC = SchemeSpec(
    name="eamsgd",
    summary="EASGD with Nesterov momentum on each worker (delta), elastic exchange every `tau`",
    options=EamsgdOptions,
    rules=EamsgdRules,
    worker="distsgd.workers.eamsgd:EamsgdWorker",
    server=ElasticServer,
    step_size=("lr", "alpha", "delta"),
    traffic=Traffic(kind="async", period_option="tau"),
)
