"""Typed configuration of a training run (what the user's script and the CLI set)."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from distsgd.ps.compression import encoding_for
from distsgd.ps.partition import PLACEMENTS
from distsgd.ps.pull_encoding import pull_encoding_for

LR_SCHEDULES = ("constant", "cosine")
LR_RULES = ("auto", "none", "sqrt", "linear", "inverse-sqrt", "elastic")
"""What ``TrainConfig.lr_rule`` may be: auto (the scheme's default) or a rule by name."""
SHARED_MEMORY = ("auto", "off")
"""What ``TrainConfig.shared_memory`` may be."""
WORLD_SIZES = ("fixed", "dynamic")
"""What ``TrainConfig.world_size`` may be."""
DEVICE = re.compile(r"|auto|cpu|cuda(:[0-9]+)?")
"""What ``TrainConfig.device`` may be."""


def lr_factor(schedule: str, step: int, total: int, warmup: float = 0.0) -> float:
    """The schedule's multiplier of the learning rate at ``step`` (0-based) of ``total``.

    The first ``warmup * total`` steps rise linearly to 1; the schedule (constant, or a cosine
    decay to 0) runs over the steps after them.
    """
    ramp = int(warmup * total)
    if step < ramp:
        return (step + 1) / ramp
    if schedule == "cosine":
        progress = min(step - ramp, total - ramp) / max(1, total - ramp)
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


def lr_multiplier(rule: str, workers: int) -> float:
    """The factor a rule of ``TrainConfig.lr_rule`` puts on ``lr`` at ``workers`` workers.

    ``none``: 1. ``sqrt``: sqrt(N), for schemes whose N workers together take 1/N of the
    steps on N-fold batches (sync, allreduce; Krizhevsky 2014, Hoffer et al. 2017). ``linear``:
    N (Goyal et al. 2017). ``inverse-sqrt``: 1/sqrt(N), for Hogwild, whose N workers take all
    the steps but each on parameters about N - 1 updates old. ``elastic``: sqrt(N) x (N + 1) / N,
    for EASGD: its elastic exchanges move x_i and the center by opposite amounts, so the mean of
    the N + 1 variables moves only by the workers' gradient steps, at N / (N + 1) of their rate;
    the factor (N + 1) / N gives that consensus sqrt's rate (x 2.5 on 4 workers). One worker: 1
    under every rule.
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if rule == "none":
        return 1.0
    if rule == "sqrt":
        return math.sqrt(workers)
    if rule == "linear":
        return float(workers)
    if rule == "inverse-sqrt":
        return 1.0 / math.sqrt(workers)
    if rule == "elastic":
        return math.sqrt(workers) * (workers + 1) / workers if workers > 1 else 1.0
    raise ValueError(f"lr_rule must be one of {', '.join(LR_RULES[1:])}, got {rule!r}")


def momentum_after_asynchrony(momentum: float, workers: int) -> float:
    """The momentum to apply on ``workers`` asynchronous workers for ``momentum`` tuned alone.

    Asynchrony begets momentum (Mitliagkas, Zhang, Hadjis and Re, "Asynchrony begets Momentum,
    with an Application to Deep Learning", Allerton 2016, arXiv:1605.09774): N workers that
    apply gradients of parameters about N - 1 updates old behave, in expectation, like SGD with
    an implicit momentum of 1 - 1/N on top of the explicit one. Lowering the explicit momentum
    by it keeps the total near the tuned value: ``max(0, momentum - (1 - 1/N))`` (0.9 becomes
    0.4 on 2 workers, 0.15 on 4, 0 from 10). One worker: ``momentum`` as given.
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    return max(0.0, momentum - (1.0 - 1.0 / workers))


@dataclass(frozen=True, kw_only=True)
class LrScaling:
    """How a run's ``lr`` became the rate its scheme applies (``result.json``'s
    ``lr_scaling``)."""

    lr: float
    """``TrainConfig.lr``: the rate as given, the one that trains a single process."""
    rule: str
    """The rule applied (``auto`` resolved to the scheme's default)."""
    workers: int
    """The workers the run started with."""
    by_default: bool
    """Whether the rule is the scheme's default (``lr_rule`` auto) rather than chosen."""
    momentum: float = 0.0
    """``TrainConfig.momentum`` as given."""
    implicit_momentum: bool = False
    """Whether the momentum applied is lowered by asynchrony's implicit momentum
    (:func:`momentum_after_asynchrony`): a scheme that asks for it, under its default rule."""

    @classmethod
    def resolve(
        cls, config: TrainConfig, default_rule: str, workers: int, *, asynchronous: bool = False
    ) -> LrScaling:
        """The rule of ``config.lr_rule``, ``default_rule`` (the scheme's) when it is auto;
        ``asynchronous``: the scheme's workers apply stale gradients (Hogwild), so under its
        default rule the momentum applied is lowered by their implicit momentum."""
        auto = config.lr_rule == "auto"
        rule = default_rule if auto else config.lr_rule
        lr_multiplier(rule, workers)  # a rule by its name, or ValueError
        return cls(
            lr=config.lr,
            rule=rule,
            workers=workers,
            by_default=auto,
            momentum=config.momentum,
            implicit_momentum=auto and asynchronous,
        )

    @property
    def effective_momentum(self) -> float:
        """The momentum the run applies."""
        if not self.implicit_momentum:
            return self.momentum
        return momentum_after_asynchrony(self.momentum, self.workers)

    @property
    def factor(self) -> float:
        return lr_multiplier(self.rule, self.workers)

    @property
    def effective_lr(self) -> float:
        return self.lr * self.factor

    def at(self, workers: int) -> float:
        """The factor on :attr:`effective_lr` that makes it the rule's rate at ``workers``
        workers rather than at the :attr:`workers` the run started with: what a run of
        ``--world-size dynamic`` applies while its live workers differ from its start."""
        return lr_multiplier(self.rule, max(1, workers)) / self.factor

    def describe(self) -> str:
        """One line for the log: what was applied, and how to turn it off."""
        if self.factor == 1.0:
            line = f"lr {self.lr:g} as given (--lr-rule {self.rule}, {self.workers} worker(s))"
        else:
            whose = "the scheme's default" if self.by_default else "chosen"
            line = (
                f"lr {self.lr:g} x {self.factor:.4g} ({self.rule}, {self.workers} workers) = "
                f"{self.effective_lr:.4g} (--lr-rule {self.rule}, {whose}; --lr-rule none keeps "
                f"{self.lr:g})"
            )
        if self.effective_momentum != self.momentum:
            line += (
                f"; momentum {self.momentum:g} - {1 - 1 / self.workers:.4g} (asynchrony's own "
                f"on {self.workers} workers) = {self.effective_momentum:.4g} (a chosen --lr-rule "
                "keeps it)"
            )
        return line

    def to_dict(self) -> dict[str, Any]:
        names = "lr rule workers factor effective_lr by_default momentum effective_momentum"
        return {name: getattr(self, name) for name in names.split()}


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How to train; the same fields are CLI flags of ``distsgd run`` (``--batch-size`` ...).

    Values given on the command line override those the script passes to ``distsgd.train``.
    """

    batch_size: int = field(default=32, metadata={"help": "mini-batch size on each worker"})
    epochs: float = field(
        default=10.0,
        metadata={
            "help": "passes over the training set by all workers together (ignored with --steps)"
        },
    )
    steps: int = field(
        default=0, metadata={"help": "local steps per worker; 0 = derive from --epochs"}
    )
    lr: float = field(
        default=0.05, metadata={"help": "learning rate of the worker (or server) optimizer"}
    )
    lr_rule: str = field(
        default="auto",
        metadata={
            "help": "how --lr, the rate that trains one process, becomes the rate applied on N "
            "workers: auto (the scheme's default rule, see its guide page), none (as given), "
            "sqrt (x sqrt N), linear (x N), inverse-sqrt (/ sqrt N) or elastic (x sqrt N x "
            "(N + 1) / N, EASGD's)"
        },
    )
    momentum: float = field(default=0.0, metadata={"help": "heavy-ball momentum of that optimizer"})
    lr_schedule: str = field(
        default="constant",
        metadata={"help": "learning-rate schedule over the run: constant or cosine (decays to 0)"},
    )
    warmup: float = field(
        default=0.0,
        metadata={
            "help": "fraction of the run whose learning rate rises linearly from 0 (e.g. 0.1)"
        },
    )
    lr_cut: float = field(
        default=1.0,
        metadata={
            "help": "factor on every rate the run applies, in (0, 1]: the launcher halves it "
            "each time it rolls a diverged run back (0.5, then 0.25; docs/fault-tolerance.md); "
            "giving it yourself is a lower --lr that also lowers DiLoCo's inner rate"
        },
    )
    nonfinite: str = field(
        default="skip",
        metadata={
            "help": "a gradient with NaN/Inf refused by the servers: skip it, or stop the run"
        },
    )
    wire_dtype: str = field(
        default="float32",
        metadata={
            "help": "dtype of pushed updates on the wire: float32, bf16, fp16, int8 (a scale per "
            "piece), int4 or int2 (a scale per 128 values); servers keep and apply float32. "
            "Under allreduce: DDP's fp16 or bf16 hook"
        },
    )
    pull_dtype: str = field(
        default="float32",
        metadata={
            "help": "dtype pulled parameters travel in where a pull crosses a network (the "
            "gRPC stream, a tensor socket): float32, bf16 or fp16 (half the bytes; workers "
            "compute on the servers' values rounded to it). Shared-memory pulls stay float32"
        },
    )
    param_placement: str = field(
        default="balanced",
        metadata={
            "help": "how parameters go on the servers: balanced (by bytes, large ones cut in "
            "pieces; ps/partition.py) or round-robin (whole parameters in turn, TensorFlow 1's "
            "replica_device_setter)"
        },
    )
    topk: float = field(
        default=0.0,
        metadata={
            "help": "push only this fraction of each update's largest entries (e.g. 0.01); the "
            "rest is kept on the worker and added to its next push (error feedback); 0 = off"
        },
    )
    powersgd_rank: int = field(
        default=0,
        metadata={
            "help": "(allreduce) compress gradients by PowerSGD of this rank (DDP's hook); 0 = off"
        },
    )
    shared_memory: str = field(
        default="auto",
        metadata={
            "help": "tensor bytes between a worker and a parameter server on the same host: auto "
            "(through shared memory; gRPC carries the rest) or off (everything over gRPC)"
        },
    )
    tensor_socket: str = field(
        default="auto",
        metadata={
            "help": "tensor bytes to a parameter server without shared memory: auto (a plain "
            "TCP connection beside gRPC, not with TLS) or off (in gRPC streams)"
        },
    )
    device: str = field(
        default="",
        metadata={
            "help": "where each worker trains: auto (a GPU when the worker sees one, else CPU; "
            "distsgd run gives each worker its own), cpu, cuda or cuda:N; '' = where the script "
            "put the model. Parameter servers stay on CPU"
        },
    )
    world_size: str = field(
        default="fixed",
        metadata={
            "help": "how parameter-server rules count workers: fixed (the registered number; "
            "missing workers contribute nothing) or dynamic (the live members the servers see: "
            "sync's replicas to aggregate, DOWNPOUR's default server rate, EASGD's moving rate)"
        },
    )
    loader_workers: int = field(
        default=0,
        metadata={
            "help": "DataLoader worker processes that read and collate each worker's batches "
            "ahead of training (0 = read in the worker itself); they end with the worker"
        },
    )
    seed: int = field(default=0, metadata={"help": "seed for model init, data order and sharding"})
    eval_every: int = field(
        default=0, metadata={"help": "chief evaluates every N local steps (0 = only at the end)"}
    )
    log_every: int = field(default=10, metadata={"help": "metrics line every N local steps"})
    eval_batch_size: int = field(default=512, metadata={"help": "batch size for evaluation"})
    validation: float = field(
        default=0.0,
        metadata={
            "help": "hold out this fraction of train_data (fixed samples, the same on every "
            "worker and seed) and evaluate on it instead of test_data, which is then not read; "
            "0 = off (distsgd compare --tune sets it)"
        },
    )

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_rates()
        self._check_choices()

    def _check_counts(self) -> None:
        """The step and batch counts."""
        for name in ("batch_size", "log_every", "eval_batch_size"):
            _at_least(name, getattr(self, name), 1)
        for name in ("steps", "eval_every", "loader_workers"):
            _at_least(name, getattr(self, name), 0)
        if self.steps == 0 and not self.epochs > 0:
            raise ValueError(f"epochs must be positive (or set steps), got {self.epochs}")

    def _check_rates(self) -> None:
        """The learning rate and the fractions."""
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        _one_of("lr_rule", self.lr_rule, LR_RULES)
        _one_of("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _fraction("warmup", self.warmup, "a fraction in [0, 1)")
        if not 0.0 < self.lr_cut <= 1.0:
            raise ValueError(f"lr_cut must be in (0, 1], got {self.lr_cut}")
        _either("nonfinite", self.nonfinite, ("skip", "stop"))
        encoding_for(self.wire_dtype)  # the flag's one check, the parameter server's
        pull_encoding_for(self.pull_dtype)  # the same for pulls
        _one_of("param_placement", self.param_placement, PLACEMENTS)
        _fraction("topk", self.topk, "a fraction in [0, 1) (0 = off, e.g. 0.01)")
        if self.powersgd_rank < 0:
            raise ValueError(f"powersgd_rank must be 0 (off) or more, got {self.powersgd_rank}")

    def _check_choices(self) -> None:
        """The transport, the world size, the held-out fraction and the device."""
        _either("tensor_socket", self.tensor_socket, SHARED_MEMORY)
        _either("shared_memory", self.shared_memory, SHARED_MEMORY)
        _fraction("momentum", self.momentum, "in [0, 1)")
        _either("world_size", self.world_size, WORLD_SIZES)
        _fraction("validation", self.validation, "a fraction in [0, 1) (0 = off, e.g. 0.2)")
        if not DEVICE.fullmatch(self.device):
            raise ValueError(
                f"device must be auto, cpu, cuda or cuda:N ('' = the model's), got {self.device!r}"
            )

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _at_least(name: str, value: int, low: int) -> None:
    """ValueError unless ``value`` (the field ``name``) is ``low`` (0 or 1) or more."""
    if value < low:
        more = "at least 1" if low == 1 else "0 or more"
        raise ValueError(f"{name} must be {more}, got {value}")


def _one_of(name: str, value: str, choices: tuple[str, ...]) -> None:
    """ValueError unless ``value`` is one of ``choices`` (listed in the message)."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _either(name: str, value: str, choices: tuple[str, str]) -> None:
    """ValueError unless ``value`` is one of the two ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be {choices[0]} or {choices[1]}, got {value!r}")


def _fraction(name: str, value: float, what: str) -> None:
    """ValueError unless 0 <= ``value`` < 1; ``what`` says so in the message."""
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be {what}, got {value}")
