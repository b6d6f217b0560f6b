"""What a scheme's workers must honour, decided without PyTorch: :class:`WorkerRules`.

A scheme is two halves. This one is read by every process: the launcher and ``distsgd plan``
validate a run with it before any task starts, and the chief sends :meth:`server_options` to the
servers. The torch half (``distsgd.workers.<name>``) subclasses both this scheme's rules and
:class:`~distsgd.runtime.scheme.WorkerScheme`, so a worker reads the same rules.
"""

from __future__ import annotations

from typing import Any, ClassVar

from distsgd.control.config import TrainConfig


class WorkerRules:
    """A scheme's rules for its workers: its options checked against the number of workers
    (in ``__init__``), the training settings it refuses, the learning-rate rule it applies and
    what its servers are told."""

    uses_parameter_servers: ClassVar[bool] = True
    """False for schemes that only use collectives (all-reduce, local SGD, DiLoCo)."""

    lr_rule: ClassVar[str] = "none"
    """What ``--lr-rule auto`` makes of ``--lr`` on N workers: a rule of
    :func:`~distsgd.control.config.lr_multiplier` (none, sqrt, linear, inverse-sqrt,
    elastic). Each scheme sets its own in its module; its guide page says what the default
    guarantees."""

    implicit_momentum: ClassVar[bool] = False
    """Whether its workers apply stale gradients as they come (Hogwild): under its default
    ``lr_rule`` the momentum applied is then lowered by asynchrony's own
    (:func:`~distsgd.control.config.momentum_after_asynchrony`)."""

    def __init__(self, options: Any, num_workers: int) -> None:
        """``options``: the scheme's options dataclass; a setting that cannot hold on
        ``num_workers`` workers raises a one-line ValueError (cause and fix)."""
        self.options = options

    def server_options(self, config: TrainConfig) -> dict[str, Any]:
        """Options sent to the scheme's server rule at registration (JSON-serialisable)."""
        return {"lr": config.lr, "momentum": config.momentum}

    def check_config(self, config: TrainConfig) -> None:
        """Refuse, with a one-line ValueError (cause and fix), training settings this scheme
        cannot honour. The launcher calls it with the command line's settings before it starts
        any task, and every worker with its whole config before it starts.

        The default refuses ``powersgd_rank``: PowerSGD is a hook of PyTorch's DDP, which only
        the ``allreduce`` scheme trains through.
        """
        if config.powersgd_rank:
            raise ValueError(
                "--powersgd-rank is a gradient compression hook of PyTorch's DDP, which only "
                "the allreduce scheme trains through; use --scheme allreduce or drop "
                "--powersgd-rank"
            )

    def refuse_compression(self, config: TrainConfig, scheme: str) -> None:
        """(For schemes that average with plain collectives) refuse ``--wire-dtype`` and
        ``--topk``, which only parameter-server pushes and DDP's hooks apply (and
        ``--pull-dtype``, see :meth:`refuse_pull_dtype`)."""
        self.refuse_pull_dtype(config, scheme)
        if config.wire_dtype != "float32" or config.topk:
            flag = "--topk" if config.topk else f"--wire-dtype {config.wire_dtype}"
            raise ValueError(
                f"{flag} under {scheme}: its averages travel uncompressed (compression applies "
                "to parameter-server pushes, and to allreduce through DDP); drop the flag"
            )

    def refuse_pull_dtype(self, config: TrainConfig, scheme: str) -> None:
        """(For schemes without parameter servers) refuse ``--pull-dtype``: nothing is pulled."""
        if config.pull_dtype != "float32":
            raise ValueError(
                f"--pull-dtype {config.pull_dtype} under {scheme}: it has no parameter servers "
                "to pull from (--pull-dtype applies to parameter-server pulls); drop the flag"
            )

    def check_steps(self, steps: int) -> None:
        """Refuse, with a one-line ValueError (cause and fix), a run in which each worker takes
        ``steps`` local steps, when this scheme cannot honour it (a period longer than the run);
        called before the worker connects. ``steps`` is ``runtime.setup.UNBOUNDED`` when the
        loop decides (its own data, or leased work)."""
