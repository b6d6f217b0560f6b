"""What a scheme sends, as the cost model reads it (each scheme declares its ``Traffic``).

A scheme's communication, for the model in :mod:`distsgd.plan.cost`, is one of three kinds:

- ``async``: through parameter servers, each worker on its own: pull the model, compute, push
  an update (Hogwild, DynSGD, DOWNPOUR, AGN, EASGD, EAMSGD). No worker waits for another.
- ``sync``: through parameter servers, in rounds: every worker pushes, the servers apply once
  all have, then every worker pulls (sync, SAGN).
- ``collective``: no servers; the workers all-reduce among themselves (allreduce, local SGD,
  DiLoCo), so every exchange waits for the slowest.

An exchange happens every ``period`` steps: 1, or the value of the scheme option that
``period_option`` names (DOWNPOUR's ``window``, EASGD's ``tau``, DiLoCo's ``inner_steps``).
``overlap_option`` names a switch under which the exchange runs in the background while the
next steps compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["async", "sync", "collective"]
KINDS: tuple[Kind, ...] = ("async", "sync", "collective")


@dataclass(frozen=True, kw_only=True)
class Exchange:
    """One scheme's communication with its options applied: what the cost model takes."""

    kind: Kind
    """``async``, ``sync`` or ``collective`` (see the module docstring)."""
    period: int = 1
    """Steps between exchanges (at least 1)."""
    overlap: bool = False
    """Whether the exchange runs in the background while the next steps compute."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"exchange kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.period < 1:
            raise ValueError(f"an exchange period must be at least 1 step, got {self.period}")


@dataclass(frozen=True, kw_only=True)
class Traffic:
    """A scheme's communication pattern, before its options are known."""

    kind: Kind
    """``async``, ``sync`` or ``collective``."""
    period_option: str | None = None
    """The option holding the steps between exchanges; None: every step."""
    overlap_option: str | None = None
    """The switch that overlaps the exchange with compute; None: the scheme has none."""

    def __post_init__(self) -> None:
        Exchange(kind=self.kind)  # the kind's one check

    def resolve(self, options: Any) -> Exchange:
        """The :class:`Exchange` of a scheme whose parsed options are ``options``."""
        period = int(getattr(options, self.period_option)) if self.period_option else 1
        overlap = bool(getattr(options, self.overlap_option)) if self.overlap_option else False
        return Exchange(kind=self.kind, period=period, overlap=overlap)
