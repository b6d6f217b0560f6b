"""DiLoCo and Streaming DiLoCo: inner AdamW steps, then an outer Nesterov step, over all-reduce.

Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen. *DiLoCo: Distributed
Low-Communication Training of Language Models.* arXiv:2311.08105 (2023); Douillard, Donchev,
Rush, et al. *Streaming DiLoCo with overlapping communication.* arXiv:2501.18512 (2025).

Every worker keeps a replica theta_i and (identical on all workers) the global parameters theta.
Each step t::

    theta_i <- AdamW(theta_i, grad L(theta_i; batch_i), inner_lr)      # the inner step
    for each fragment p due at t:  (t + 1 - p * H / P) % H == 0
        delta_p   <- (1/N) * sum_j (theta_p - theta_j,p)               # outer pseudo-gradient
        theta_p   <- NesterovSGD(theta_p, delta_p, outer_lr, outer_momentum)
        theta_i,p <- theta_p                                           # every replica restarts

``fragments = 1`` is DiLoCo: the whole model every H inner steps. ``fragments = P > 1`` is
Streaming DiLoCo's schedule: the parameters are cut into P fragments of consecutive tensors,
each synchronized every H steps at staggered offsets, so one fragment travels at a time and
the peak bandwidth falls by P. With ``outer_lr = 1`` and ``outer_momentum = 0`` the outer step
is plain parameter averaging (local SGD with AdamW).

``overlap`` (Streaming DiLoCo's overlapped communication, with one outer step of delay, the
"naive delayed" form of Kale et al., *Eager updates for overlapped communication and
computation in DiLoCo*, arXiv:2502.12996): the mean of round k's pseudo-gradients travels while
round k + 1's inner steps run, and is applied at the fragment's next synchronization::

    at fragment p's k-th synchronization:
        start  delta_p(k) <- (1/N) * sum_j (theta_p - theta_j,p)       # in the background
        theta_p   <- NesterovSGD(theta_p, delta_p(k - 1), ...)          # the previous round's
        theta_i,p <- theta_p

so a replica restarts from parameters one outer step behind, and no worker waits for the
exchange unless it takes longer than H inner steps. The final step waits for every fragment's
exchange and applies it, then synchronizes without delay, so all replicas end equal to theta.

Compression (``--wire-dtype`` int8, int4, int2, fp16 or bf16, ``--topk``): the pseudo-gradients
travel encoded, with error feedback, all-gathered instead of all-reduced
(:mod:`distsgd.runtime.encoded_mean`); every worker decodes the same frames, so theta stays
identical everywhere.

Defaults follow the paper (outer Nesterov lr 0.7, momentum 0.9; AdamW weight decay 0.1) except
two that depend on the model and the run's length: H (the paper: 500, on runs of tens of
thousands of steps; here 50, for runs of hundreds of steps) and the inner rate (the paper:
4e-4 for transformers; here 5e-3, what the small demo CNN needs). The inner rate is
``inner_lr``, not ``--lr``: AdamW wants far smaller rates than the SGD schemes; the run's
learning-rate schedule scales it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from distsgd.control.config import TrainConfig
from distsgd.plan.traffic import Traffic
from distsgd.runtime.context import WorkerContext
from distsgd.runtime.scheme import WorkerScheme
from distsgd.schemes.registry import SchemeSpec

if TYPE_CHECKING:
    from distsgd.runtime.collective import PendingMean


@dataclass(frozen=True, kw_only=True)
class DilocoOptions:
    inner_steps: int = field(default=50, metadata={"help": "H: inner steps between outer steps"})
    inner_lr: float = field(default=5e-3, metadata={"help": "the inner AdamW's learning rate"})
    weight_decay: float = field(default=0.1, metadata={"help": "the inner AdamW's weight decay"})
    outer_lr: float = field(default=0.7, metadata={"help": "the outer Nesterov step's rate"})
    outer_momentum: float = field(default=0.9, metadata={"help": "the outer Nesterov momentum"})
    fragments: int = field(
        default=1, metadata={"help": "P: Streaming DiLoCo's staggered fragments (1 = DiLoCo)"}
    )
    overlap: bool = field(
        default=False,
        metadata={
            "help": "exchange the pseudo-gradients while the next inner steps run, applying "
            "them one outer step late"
        },
    )

    def __post_init__(self) -> None:
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps must be at least 1, got {self.inner_steps}")
        if self.fragments < 1 or self.fragments > self.inner_steps:
            raise ValueError(
                f"fragments must be between 1 and inner_steps ({self.inner_steps}), "
                f"got {self.fragments}"
            )
        for name in ("inner_lr", "outer_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be 0 or more, got {self.weight_decay}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")


def fragment_of(num_tensors: int, fragments: int) -> list[int]:
    """Each tensor's fragment: ``fragments`` runs of consecutive tensors, as equal as possible."""
    return [i * fragments // num_tensors for i in range(num_tensors)]


class DilocoWorker(WorkerScheme):
    uses_parameter_servers = False
    evaluate_on = "local"

    def check_config(self, config: TrainConfig) -> None:
        super().check_config(config)
        self.refuse_pull_dtype(config, "diloco")

    def __init__(self, options: DilocoOptions, num_workers: int) -> None:
        self.options = options

    def start(self, ctx: WorkerContext) -> None:
        o = self.options
        ctx.broadcast(list(ctx.params.values()))
        self.inner = ctx.make_optimizer("adamw", lr=o.inner_lr, weight_decay=o.weight_decay)
        self.theta = [p.detach().clone() for p in ctx.params.values()]
        self.outer = torch.optim.SGD(
            self.theta, lr=o.outer_lr, momentum=o.outer_momentum, nesterov=o.outer_momentum > 0
        )
        parts = min(o.fragments, len(self.theta))
        self.fragment = fragment_of(len(self.theta), parts)
        self.offsets = [p * o.inner_steps // parts for p in range(parts)]
        self.outer_steps = 0
        self.arrived: dict[int, list[torch.Tensor]] = {}
        """(overlap) Fragment -> the mean pseudo-gradient that arrived and waits to be applied."""
        self.inflight: dict[int, tuple[PendingMean, list[torch.Tensor]]] = {}

    def after_backward(self, ctx: WorkerContext) -> None:
        self.inner.step()
        done = ctx.local_step + 1  # inner steps taken, this one included
        for part, offset in enumerate(self.offsets):
            if done >= offset and (done - offset) % self.options.inner_steps == 0:
                self.outer_step(ctx, part)

    def finish(self, ctx: WorkerContext) -> None:
        for part in range(len(self.offsets)):
            self.outer_step(ctx, part, last=True)

    def outer_step(self, ctx: WorkerContext, part: int, *, last: bool = False) -> None:
        """Start this fragment's mean pseudo-gradient; apply it now, or (overlap) apply the
        previous one and leave this one travelling (``last``: apply both)."""
        params = list(ctx.params.values())
        chosen = [i for i, p in enumerate(self.fragment) if p == part]
        with torch.no_grad():
            delta = [self.theta[i] - params[i].detach() for i in chosen]
            pending = ctx.start_mean(delta, key=f"fragment{part}", compressed=True)
            if part in self.inflight:
                self._land(ctx, part)
            if part in self.arrived:
                self._apply(chosen, self.arrived.pop(part))
            if self.options.overlap and not last:
                self.inflight[part] = (pending, delta)
            else:
                ctx.wait_mean(pending)
                self._apply(chosen, delta)
            for i in chosen:
                params[i].copy_(self.theta[i])
        self.outer_steps += 1

    def _land(self, ctx: WorkerContext, part: int) -> None:
        """Wait for a fragment's travelling mean; it waits in :attr:`arrived` to be applied."""
        pending, delta = self.inflight.pop(part)
        ctx.wait_mean(pending)
        self.arrived[part] = delta

    def _apply(self, chosen: list[int], delta: list[torch.Tensor]) -> None:
        """The outer Nesterov step of the fragment's tensors ``chosen`` on the mean ``delta``."""
        self.outer.zero_grad(set_to_none=True)
        for i, d in zip(chosen, delta, strict=True):
            self.theta[i].grad = d  # the outer pseudo-gradient
        self.outer.step()  # steps only the tensors that have a gradient: this fragment
        self.outer.zero_grad(set_to_none=True)

    def stats(self) -> dict[str, float]:
        return {"outer_steps": self.outer_steps}

    def state_dict(self) -> dict[str, Any]:
        for part in list(self.inflight):  # a travelling mean is waited for, then saved
            pending, delta = self.inflight.pop(part)
            pending.wait()
            self.arrived[part] = delta
        state = super().state_dict()
        state["theta"] = [t.detach().clone() for t in self.theta]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        theta = state.pop("theta")
        super().load_state_dict(state)
        with torch.no_grad():  # in place: the outer optimizer holds these very tensors
            for mine, saved in zip(self.theta, theta, strict=True):
                mine.copy_(saved)


SPEC = SchemeSpec(
    name="diloco",
    summary="DiLoCo: H inner AdamW steps, then an outer Nesterov step on the averaged change",
    options=DilocoOptions,
    worker=DilocoWorker,
    step_size=("inner_lr", "outer_lr"),
    local_optimizer=True,
    traffic=Traffic(kind="collective", period_option="inner_steps", overlap_option="overlap"),
)
