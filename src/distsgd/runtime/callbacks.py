"""What a training loop hands back to the user's code: callbacks and the user's own values.

``distsgd.train(callbacks=[...])`` calls each :class:`Callback` every ``every_steps`` local
steps (:meth:`Callback.on_step`) and after each evaluation of the chief
(:meth:`Callback.on_evaluate`, with the scores). A loop of the user's own logs its values with
``worker.log(name=value)``; they reach ``metrics.jsonl`` as ``{"user": {"name": value}}``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

USER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]{0,63}")
"""What the name of a user value may be (a TensorBoard tag, a JSON key)."""


@dataclass(frozen=True, kw_only=True)
class StepInfo:
    """Where this worker stands, as a callback sees it."""

    rank: int
    """This worker's index (0 is the chief)."""
    is_chief: bool
    """Whether this is worker 0, the one that evaluates."""
    local_step: int
    """Steps this worker has taken."""
    global_step: int
    """Updates the cluster has applied, as last heard."""
    loss: float
    """The training loss of the last step (nan before the first)."""
    samples: int
    """Samples this worker has trained on."""
    seconds: float
    """Seconds since this worker's first step."""
    model: nn.Module
    """This worker's replica (e.g. to save it); do not change its parameters."""


class Callback:
    """Subclass and override what you need; ``distsgd.train(callbacks=[MyCallback()])``.

    Callbacks run on every worker, in the training loop's thread: what they cost, the step
    costs. Use ``info.is_chief`` to act once per run.
    """

    every_steps: int = 0
    """Call :meth:`on_step` every this many local steps (0: never)."""

    def on_step(self, info: StepInfo) -> None:
        """Every ``every_steps`` local steps, after the step's update."""

    def on_evaluate(self, info: StepInfo, scores: Mapping[str, float]) -> None:
        """(Chief) after each evaluation, mid-run (``--eval-every``) and the final one:
        ``scores`` has ``loss``, ``accuracy`` for class labels, and each ``metrics=``
        function's value."""


class Every(Callback):
    """``Every(100, fn)``: ``fn(info)`` every 100 local steps."""

    def __init__(self, steps: int, fn: Callable[[StepInfo], Any]) -> None:
        if steps < 1:
            raise ValueError(f"Every(steps, fn): steps must be at least 1, got {steps}")
        self.every_steps = steps
        self.fn = fn

    def on_step(self, info: StepInfo) -> None:
        self.fn(info)


def check_user_values(values: Mapping[str, Any]) -> dict[str, float]:
    """The values a loop logs, as finite-or-not floats; ValueError names a bad one."""
    out: dict[str, float] = {}
    for name, value in values.items():
        if not USER_NAME.fullmatch(name):
            raise ValueError(
                f"log({name!r}=...): a name is letters, digits and _ . / - (up to 64, not "
                "starting with a digit); rename it"
            )
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"log({name}=...): {type(value).__name__} is not a number; log a float "
                "(e.g. loss.item())"
            ) from None
        out[name] = number if math.isfinite(number) else float("nan")
    return out
