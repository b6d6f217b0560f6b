"""AGN: Accumulated Gradient Normalization (formerly ADAG), asynchronous.

Hermans, Spanakis, Moeckel. *Accumulated Gradient Normalization.* ACML 2017 (arXiv:1710.02368);
Hermans' thesis *On Scalable Deep Learning and Parallelizing Gradient Descent* (2017).

DOWNPOUR's worker, except that the update accumulated over the communication window is divided
by the window before it is pushed. Worker i::

    w_i <- pull();  w_start <- w_i
    repeat lambda times:  w_i <- w_i - lr * grad L(w_i; batch)     # local SGD
    delta <- (w_start - w_i) / lambda                               # = lr * mean local gradient
    push(delta)

Server, on each push, at once::

    w <- w - server_lr * delta          # server_lr = 1, as in the paper

A push is one normalized step, whatever the window: the local steps explore, and only their
mean direction reaches the center. With many workers the center moves by N such steps per
round of windows instead of N * lambda (DOWNPOUR's sum), which is what keeps AGN stable where
DOWNPOUR diverges. A remainder window shorter than ``window`` is divided by its own length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distsgd.plan.traffic import Traffic
from distsgd.schemes.downpour import DownpourOptions, DownpourRules, DownpourServer
from distsgd.schemes.registry import SchemeSpec


@dataclass(frozen=True, kw_only=True)
class AgnOptions:
    window: int = field(
        default=4, metadata={"help": "lambda: local steps between pushes (communication window)"}
    )
    server_lr: float = field(
        default=1.0, metadata={"help": "rate at which the server applies a normalized update"}
    )

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be at least 1, got {self.window}")
        if not self.server_lr > 0:
            raise ValueError(f"server_lr must be positive, got {self.server_lr}")


class AgnRules(DownpourRules):
    lr_rule = "sqrt"
    """N workers take 1/N of the local steps, each push one normalized step: --lr x sqrt(N)."""

    def __init__(self, options: AgnOptions, num_workers: int) -> None:
        super().__init__(
            DownpourOptions(window=options.window, server_lr=options.server_lr), num_workers
        )


SPEC = SchemeSpec(
    name="agn",
    summary="AGN/ADAG: DOWNPOUR's window, the accumulated update divided by the window",
    options=AgnOptions,
    rules=AgnRules,
    worker="distsgd.workers.agn:AgnWorker",
    server=DownpourServer,
    step_size=("lr", "server_lr"),
    traffic=Traffic(kind="async", period_option="window"),
)
