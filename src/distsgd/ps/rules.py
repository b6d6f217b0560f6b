"""The server half of a scheme: an update rule applied to a shard when a worker pushes.

Rules are numpy code and know nothing of PyTorch or gRPC. A scheme module defines its rule as a
subclass of :class:`UpdateRule`; the parameter-server process is handed a factory that maps a
scheme name to its rule (dependency injection keeps this layer below the schemes).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    from distsgd.ps.shard import Shard


@dataclass(frozen=True, kw_only=True)
class PushMeta:
    """Who pushed, and on which version of the parameters the payload was computed."""

    worker: int
    incarnation: int
    base_version: int
    lr_scale: float = 1.0
    """The worker's learning-rate schedule factor; server-side optimizers scale their rate."""


@dataclass(frozen=True)
class PushOutcome:
    """Whether the shard applied a push, and if not, why."""

    accepted: bool
    reason: str = ""


ACCEPTED = PushOutcome(True)


class UpdateRule(ABC):
    """How a shard applies pushed payloads.

    ``locked`` rules run under the shard's lock (consistent reads and writes); a rule with
    ``locked = False`` (Hogwild) updates the arrays in place with no lock across workers.
    A rule bumps the shard version (``shard.bump()``) each time the parameters change.
    """

    locked: ClassVar[bool] = True

    def __init__(self, *, options: Mapping[str, Any], num_workers: int) -> None:
        self.options = dict(options)
        self.num_workers = num_workers

    @abstractmethod
    def apply(self, shard: Shard, payload: dict[str, np.ndarray], meta: PushMeta) -> PushOutcome:
        """Apply one push of piece arrays to ``shard.values``."""

    def on_leave(self, shard: Shard, worker: int) -> None:  # noqa: B027 - optional hook
        """A worker finished or left; synchronous rules adjust how many pushes close a step."""

    def tick(self, shard: Shard, now: float) -> None:  # noqa: B027 - optional hook
        """Called about twice a second under the shard's lock (timeouts, e.g. a dead worker)."""

    def state_dict(self) -> dict[str, Any]:
        """The rule's state for a checkpoint: numpy arrays and JSON values, by name.

        The default saves every :class:`ServerSGD` attribute's momentum buffers; a rule with
        more state (an open synchronous step) extends it. Keys must not contain "/"-prefixed
        names of other entries.
        """
        out: dict[str, Any] = {}
        for name, value in vars(self).items():
            if isinstance(value, ServerSGD):
                for key, buf in value.buffers.items():
                    out[f"{name}.buffers/{key}"] = buf
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        for name, value in vars(self).items():
            if isinstance(value, ServerSGD):
                prefix = f"{name}.buffers/"
                value.buffers = {
                    k[len(prefix) :]: np.array(v, copy=True)
                    for k, v in state.items()
                    if k.startswith(prefix)
                }


RuleFactory = Callable[[str, Mapping[str, Any], int], UpdateRule]
"""(scheme name, options, number of workers) -> the scheme's rule; raises ValueError if unknown."""


class ServerSGD:
    """SGD with optional heavy-ball momentum on numpy arrays (PyTorch's ``torch.optim.SGD`` form):

    ``b <- mu * b + g`` (``b = g`` at first), ``w <- w - lr * scale * b``.
    """

    def __init__(self, *, lr: float, momentum: float = 0.0) -> None:
        self.lr = lr
        self.momentum = momentum
        self.buffers: dict[str, np.ndarray] = {}

    def step(
        self, values: dict[str, np.ndarray], grads: Mapping[str, np.ndarray], scale: float = 1.0
    ) -> None:
        for key, grad in grads.items():
            direction = grad
            if self.momentum:
                buf = self.buffers.get(key)
                if buf is None:
                    buf = self.buffers[key] = np.array(grad, dtype=values[key].dtype, copy=True)
                else:
                    buf *= self.momentum
                    buf += grad
                direction = buf
            values[key] -= (self.lr * scale) * direction
