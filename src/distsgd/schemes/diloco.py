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

``overlap_steps = tau > 0`` (Streaming DiLoCo's overlapped communication): a fragment's mean
travels while the next tau inner steps run, and lands then::

    at t, fragment p due:   start delta_p <- (1/N) * sum_j (theta_p - theta_j,p)   # background
    at t + tau:             theta_p   <- NesterovSGD(theta_p, delta_p, outer_lr, outer_momentum)
                            theta_i,p <- merge * theta_i,p + (1 - merge) * theta_p

so a replica keeps ``merge`` (the paper's alpha; 0.5 here, as there) of the tau steps it took
meanwhile instead of throwing them away, and no worker waits unless the exchange takes longer
than tau inner steps. ``tau = H`` is one outer step of delay: the mean lands as the fragment's
next exchange starts. A mean lands before the fragment's next exchange is measured, so the
next pseudo-gradient carries only what the merge kept of the round (nothing is counted twice);
``merge = 0`` with ``tau = H`` would keep nothing and is refused. (An earlier form here measured
the next exchange first and then restarted the replica from theta, the "naive delayed" overlap
of Kale et al., *Eager updates for overlapped communication and computation in DiLoCo*,
arXiv:2502.12996: each round's progress was redone by the next and applied twice, and a demo
run ended at 0.21.)
The final step lands every travelling mean, then synchronizes every fragment without delay, so
all replicas end equal to theta.

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

from distsgd.control.config import TrainConfig
from distsgd.plan.traffic import Traffic
from distsgd.schemes.base import WorkerRules
from distsgd.schemes.registry import SchemeSpec


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
    overlap_steps: int = field(
        default=0,
        metadata={
            "help": "tau: a fragment's exchange overlaps this many inner steps, then lands "
            "(0 = blocking; inner_steps = one outer step of delay)"
        },
    )
    merge: float = field(
        default=0.5,
        metadata={
            "help": "(overlap) the share of its own fragment a replica keeps when the mean lands"
        },
    )

    def __post_init__(self) -> None:
        check_rounds(self.inner_steps, self.fragments)
        if not 0 <= self.overlap_steps <= self.inner_steps:
            raise ValueError(
                f"overlap_steps must be between 0 and inner_steps ({self.inner_steps}), "
                f"got {self.overlap_steps}"
            )
        if not 0.0 <= self.merge < 1.0:
            raise ValueError(f"merge must be in [0, 1), got {self.merge}")
        if self.merge == 0.0 and self.overlap_steps == self.inner_steps:
            raise ValueError(
                "merge 0 with overlap_steps = inner_steps throws every round's steps away "
                "(the mean lands as the next exchange starts); set merge above 0, e.g. 0.5"
            )
        for name in ("inner_lr", "outer_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be 0 or more, got {self.weight_decay}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")


def check_rounds(inner_steps: int, fragments: int) -> None:
    """Refuse H and P (DiLoCo's and asynchronous DiLoCo's) that cannot hold."""
    if inner_steps < 1:
        raise ValueError(f"inner_steps must be at least 1, got {inner_steps}")
    if not 1 <= fragments <= inner_steps:
        raise ValueError(
            f"fragments must be between 1 and inner_steps ({inner_steps}), got {fragments}"
        )


def few_steps(steps: int, inner_steps: int, *, took: bool = False) -> str:
    """What to say of a run of ``steps`` local steps per worker, fewer than ``inner_steps``:
    no outer step before its last."""
    rounds = f" (--inner-steps {steps // 4} gives 4 rounds)" if steps >= 4 else ""
    return (
        f"diloco: each worker {'took' if took else 'takes'} {steps} local steps, fewer than "
        f"--inner-steps {inner_steps}, so the replicas train apart until the run's final outer "
        f"step; lower --inner-steps to at most {steps}{rounds}, or raise --steps or --epochs"
    )


def fragment_of(num_tensors: int, fragments: int) -> list[int]:
    """Each tensor's fragment: ``fragments`` runs of consecutive tensors, as equal as possible."""
    return [i * fragments // num_tensors for i in range(num_tensors)]


class DilocoRules(WorkerRules):
    uses_parameter_servers = False
    options: DilocoOptions

    def check_config(self, config: TrainConfig) -> None:
        super().check_config(config)
        self.refuse_pull_dtype(config, "diloco")

    def check_steps(self, steps: int) -> None:
        """A run shorter than one round would average the replicas only once, at its end
        (the first outer step comes after ``inner_steps`` steps)."""
        if steps < self.options.inner_steps:
            raise ValueError(few_steps(steps, self.options.inner_steps))


SPEC = SchemeSpec(
    name="diloco",
    summary="DiLoCo: H inner AdamW steps, then an outer Nesterov step on the averaged change",
    options=DilocoOptions,
    rules=DilocoRules,
    worker="distsgd.workers.diloco:DilocoWorker",
    step_size=("inner_lr", "outer_lr"),
    traffic=Traffic(kind="collective", period_option="inner_steps", overlap_option="overlap_steps"),
)
