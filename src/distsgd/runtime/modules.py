"""What distsgd trains and exchanges of a model.

* :func:`as_torch_module`: the module the loop trains: the model itself, or, for a Keras 3
  model on the PyTorch backend, a :class:`~distsgd.runtime.keras_models.KerasModule` around it
  (Keras's training flag and stable parameter names; see that module). Keras is never imported
  here: a model counts as a Keras one only when ``keras`` is already imported (the script
  built the model with it) and the model is one of its layers.
* :func:`exchanged_parameters`: the parameters every scheme exchanges (with the servers, by
  all-reduce, in the local optimizers): the floating-point ones that require a gradient. The
  rest (a frozen parameter, Keras's BatchNorm statistics and seed-generator state, which it
  keeps as non-trainable parameters) stays each worker's own, as buffers do; checkpoints and
  ``final_model.pt`` (``state_dict``) keep all of it.
* :func:`load_eval_state`: the copy the chief evaluates: its own replica's whole state
  (BatchNorm statistics, buffers), then the servers' exchanged weights over it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn


def is_keras_model(model: object) -> bool:
    """True when ``model`` is a Keras 3 layer or model (keras is not imported to tell)."""
    keras = sys.modules.get("keras")
    layer = getattr(keras, "Layer", None) if keras is not None else None
    return isinstance(layer, type) and isinstance(model, layer)


def as_torch_module(model: nn.Module) -> nn.Module:
    """The module distsgd trains for ``model``: a Keras 3 model wrapped in a
    :class:`~distsgd.runtime.keras_models.KerasModule`, an ``nn.Module`` as it is (an already
    wrapped one too).

    Raises:
        ValueError: a Keras model on another backend than PyTorch, or not built yet.
    """
    if is_keras_model(model):
        from distsgd.runtime.keras_models import KerasModule

        return KerasModule(model)
    return model


def is_exchanged(param: torch.Tensor) -> bool:
    """Whether a scheme exchanges ``param``: floating point and ``requires_grad``."""
    return param.is_floating_point() and param.requires_grad


def exchanged_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters a scheme exchanges, by ``named_parameters()`` name, in its order.

    For a model whose parameters are all float and require a gradient: all of them, as
    ``dict(model.named_parameters())``. A frozen parameter (``requires_grad=False``) is not
    exchanged: it keeps the value each worker built (the same on every worker of a seeded
    script), like a buffer.
    """
    return {name: p for name, p in model.named_parameters() if is_exchanged(p)}


def load_eval_state(
    target: nn.Module, source: nn.Module, server: Mapping[str, np.ndarray] | None = None
) -> None:
    """Make ``target`` (the chief's evaluation copy) the model to evaluate: ``source``'s whole
    state (the replica's trained BatchNorm statistics and other buffers or non-exchanged
    parameters), then, when given, the servers' arrays for the exchanged parameters."""
    target.load_state_dict(source.state_dict())
    if server is None:
        return
    with torch.no_grad():
        for name, p in exchanged_parameters(target).items():
            p.copy_(torch.from_numpy(np.asarray(server[name])))
