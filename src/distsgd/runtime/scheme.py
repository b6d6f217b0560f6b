"""The worker half of a training scheme: hooks the runtime calls around each step.

The runtime owns the loop (data, forward, backward, metrics, evaluation) and all communication;
a scheme only decides *what* to exchange and *when*, through the :class:`WorkerContext` it is
given. Hooks, in the order the runtime calls them::

    check_config(config)         before anything starts: refuse settings it cannot honour
    check_steps(steps)           before it connects: refuse a run of that many local steps
    start(ctx)                   once, after the parameters are registered / broadcast
    wrap_model(ctx, model)       once, after start (and a resume): the module forward runs
                                 through (e.g. DistributedDataParallel; default the model)
    for each local step:
        before_step(ctx)         e.g. pull fresh parameters, or an elastic exchange
        forward, loss, backward  (runtime)
        after_backward(ctx)      e.g. push the gradient, or take a local optimizer step
    finish(ctx)                  once, e.g. push what is left of a window
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from distsgd.runtime.checkpoint import plain_state
from distsgd.schemes.base import WorkerRules

if TYPE_CHECKING:
    from torch import nn

    from distsgd.runtime.context import WorkerContext


class WorkerScheme(WorkerRules, ABC):
    """Base class of every scheme's worker half: the torch hooks, over the scheme's
    torch-free :class:`~distsgd.schemes.base.WorkerRules` (which it subclasses through the
    scheme's own rules)."""

    evaluate_on: ClassVar[Literal["server", "local"]] = "server"
    """Which parameters the chief evaluates: the servers' (the center) or its own replica."""

    replica_from_servers: ClassVar[bool] = False
    """Whether every step starts by pulling the servers' parameters into the replica (Hogwild,
    DynSGD, sync): a checkpoint then leaves the exchanged parameters out of the worker's state
    (the shards hold them, and a resumed worker pulls them before its first step), keeping the
    model's other entries (buffers, frozen parameters)."""

    transient: ClassVar[tuple[str, ...]] = ()
    """Attributes that are not state (an exchange running in the background): the default
    :meth:`state_dict` leaves them out, and :meth:`load_state_dict` leaves them as they are."""

    def stats(self) -> dict[str, float]:
        """Scheme-specific counters added to each metrics line (e.g. dropped gradients)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The scheme's worker state for a checkpoint.

        The default takes every attribute except ``options`` and :attr:`transient`: optimizers
        by their own ``state_dict``, everything else as a deep copy. A new scheme is
        checkpointable without writing anything, as long as its state lives in attributes of
        plain types: torch
        tensors, numpy arrays of numbers, dict (str or int keys), list, tuple, str, int, float,
        bool, None. Any other value (a set, an object, a numpy float128) raises
        :class:`~distsgd.runtime.checkpoint.UnsavableStateError` naming the attribute, at the
        first checkpoint: a state file never holds Python objects (it is read with
        ``torch.load(weights_only=True)``). Override this and :meth:`load_state_dict` to save
        such state as plain values.
        """
        out: dict[str, Any] = {}
        for name, value in vars(self).items():
            if name == "options" or name in self.transient:
                continue
            where = f"{type(self).__name__}.{name}"
            if isinstance(value, torch.optim.Optimizer):
                out[name] = {"__optimizer__": plain_state(value.state_dict(), where, copy=False)}
            else:
                out[name] = plain_state(value, where)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (called after :meth:`start`, which built the optimizers)."""
        for name, value in state.items():
            current = getattr(self, name, None)
            if isinstance(value, dict) and "__optimizer__" in value:
                assert isinstance(current, torch.optim.Optimizer), f"{name} is not an optimizer"
                current.load_state_dict(value["__optimizer__"])
            else:
                setattr(self, name, value)

    def start(self, ctx: WorkerContext) -> None:
        """Called once before the first step."""

    def wrap_model(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        """The module the runtime runs forward through, made once after :meth:`start` (and
        after a resume has loaded the replica). It must train ``model``'s own parameters
        (``ctx.params``): checkpoints, evaluation and the final parameters read ``model``. The
        default is ``model`` itself; the allreduce scheme returns PyTorch's
        ``DistributedDataParallel`` around it."""
        return model

    def before_step(self, ctx: WorkerContext) -> None:
        """Called before each forward pass."""

    def explain(self, exc: Exception) -> str | None:
        """A hint for an error that forward or backward raised under this scheme (e.g. a
        choice of :meth:`wrap_model` that a model may break), added to its message; None:
        nothing to add."""
        return None

    @abstractmethod
    def after_backward(self, ctx: WorkerContext) -> None:
        """Called after each backward pass, with gradients in ``param.grad``."""

    def finish(self, ctx: WorkerContext) -> None:
        """Called once after the last step."""
