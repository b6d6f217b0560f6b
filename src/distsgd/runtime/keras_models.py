"""Keras 3 models (``KERAS_BACKEND=torch``) as the ``nn.Module`` distsgd trains.

On the PyTorch backend a Keras layer is a ``torch.nn.Module``, but three things differ from an
ordinary module, and :class:`KerasModule` (which :func:`distsgd.runtime.modules.as_torch_module`
puts around a Keras model) handles them:

* **The training flag.** Keras ignores torch's ``module.training``: ``Layer.__call__`` takes
  ``training`` from (1) the call's own ``training=`` argument, (2) the call context of an outer
  Keras call, (3) the default in the layer's ``call`` signature (``False`` for Dropout and
  BatchNormalization), (4) else None (inference). ``model.train()`` alone leaves Dropout and
  BatchNormalization in inference mode. :meth:`KerasModule.forward` passes
  ``training=self.training``, which the call context hands down to every sublayer (a layer whose
  ``call`` takes no ``training`` gets none), so ``train()`` / ``eval()`` work as in torch.
* **Parameters.** Every Keras variable is a ``torch.nn.Parameter`` in a ``ParameterDict`` of
  the model (``_torch_params``, keyed by the variable's path), repeated in the inner
  ``_functional`` of a ``Sequential`` (``state_dict`` lists each twice). They include the
  non-trainable ones: BatchNormalization's ``moving_mean`` / ``moving_variance`` (float,
  ``requires_grad=False``, updated in place by ``assign`` during training calls) and each
  SeedGenerator's int32 ``seed_generator_state``. distsgd exchanges only the trainable ones
  (:func:`~distsgd.runtime.modules.exchanged_parameters`); the rest is each worker's own.
* **Names.** Keras's paths carry auto-numbered layer names (``sequential_1/conv2d_3/kernel``
  in a process that built a model before; a copy drops the model's prefix) and ``/``, and a
  ``ParameterDict`` sorts its plain-dict keys, so neither names nor order match across
  processes. :class:`KerasModule` registers the same ``Parameter`` objects under names by
  position: ``layers.<i>`` for the i-th sublayer of a layer (``Layer._layers``, the input layer
  of a ``Sequential`` included), then the variable's own name (``kernel``, ``moving_mean``),
  ``seed_generator_state`` for a seed generator's state, ``var<k>`` where the name is Keras's
  auto-numbered ``variable_N`` or not a plain identifier. E.g. ``layers.2.moving_mean``.
  Those names are what the servers, checkpoints and ``final_model.pt`` use.

The Keras model itself is not a submodule of the wrapper (its parameters would be listed again
under Keras's names); it is :attr:`KerasModule.keras_model`, and shares its parameters with the
wrapper, so training the wrapper trains the user's model in place.

Keras puts the tensors it creates on the device of ``KERAS_TORCH_DEVICE``, read once when keras
is imported (default: a GPU when torch sees one). The launcher sets it for each worker
(:mod:`distsgd.launcher.keras_env`); moving a :class:`KerasModule` to another kind of device
than Keras's is refused.
"""

from __future__ import annotations

import copy
import keyword
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

AUTO_NAME = re.compile(r"variable(_\d+)?")
"""Keras's name for a variable made without one (numbered per process)."""

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
RESERVED = frozenset({"layers", "extra", "training"})
"""Names a variable cannot take in its layer's module (the sublayers' list, nn.Module's)."""


class KerasModule(nn.Module):
    """A built Keras 3 layer or model (PyTorch backend) as an ordinary ``nn.Module``:
    ``forward`` passes ``training=self.training``, and its parameters (Keras's variables, the
    same tensors) have stable names by position. See the module docstring.

    Args:
        model: a built ``keras.Layer`` (``keras.Model``, ``keras.Sequential``, ...).

    Raises:
        ValueError: Keras is not on the PyTorch backend, or the model is not built.
    """

    def __init__(self, model: Any) -> None:
        super().__init__()
        _check_usable(model)
        object.__setattr__(self, "_keras_model", model)  # not a submodule: see the docstring
        seen: set[int] = set()
        self.layers = nn.ModuleList(_mirror(sub, seen) for sub in _sublayers(model))
        _register_own(self, model, seen)
        missing = [v for v in model.variables if id(v.value) not in seen]
        if missing:  # state a custom layer keeps elsewhere: kept too, by position
            extra = nn.Module()
            for k, variable in enumerate(missing):
                extra.register_parameter(f"var{k}", _parameter(variable))
            self.extra = extra

    @property
    def keras_model(self) -> Any:
        """The Keras model this module trains (its variables are this module's parameters)."""
        return self._keras_model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``keras_model(*args, training=self.training, **kwargs)`` (a ``training`` keyword
        given in ``kwargs`` wins)."""
        kwargs.setdefault("training", self.training)
        return self.keras_model(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> KerasModule:
        """A copy over a deep copy of the Keras model (its own variables, the same names)."""
        clone = KerasModule(copy.deepcopy(self._keras_model, memo))
        clone.train(self.training)
        return clone

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        result = super()._apply(fn, recurse)
        _check_device(self)
        return result

    def extra_repr(self) -> str:
        return f"keras_model={type(self._keras_model).__name__}"


def _check_usable(model: Any) -> None:
    import keras  # imported already: the model is one of its layers

    backend = keras.backend.backend()
    if backend != "torch":
        raise ValueError(
            f"the Keras model runs on the {backend} backend; set KERAS_BACKEND=torch before "
            "importing keras (distsgd trains PyTorch modules)"
        )
    if not model.built:
        raise ValueError(
            f"the Keras model {model.name!r} is not built (it has no weights yet); start it "
            "with keras.Input(shape) or call model.build(input_shape) before distsgd.train"
        )


def _sublayers(layer: Any) -> list[Any]:
    return list(getattr(layer, "_layers", []))


def _own_variables(layer: Any) -> Iterator[tuple[str | None, Any]]:
    """(name or None, variable) of the variables ``layer`` holds itself, as
    ``Layer.variables`` lists them: trainable, non-trainable, then the seed generators'."""
    for variable in [*layer._trainable_variables, *layer._non_trainable_variables]:
        yield variable.name, variable
    for j, generator in enumerate(getattr(layer, "_seed_generators", [])):
        yield "seed_generator_state" + (f"_{j}" if j else ""), generator.state


def _register_own(node: nn.Module, layer: Any, seen: set[int]) -> None:
    used: set[str] = set()
    for k, (name, variable) in enumerate(_own_variables(layer)):
        param = _parameter(variable)
        if id(param) in seen:  # shared with a layer listed before
            continue
        seen.add(id(param))
        if (
            name is None
            or AUTO_NAME.fullmatch(name)
            or not IDENTIFIER.fullmatch(name)
            or keyword.iskeyword(name)
            or name in RESERVED
            or name in used
            or hasattr(node, name)
        ):
            name = f"var{k}"
        used.add(name)
        node.register_parameter(name, param)


def _mirror(layer: Any, seen: set[int]) -> nn.Module:
    """An empty module holding ``layer``'s own variables and, as ``layers``, its sublayers'."""
    node = nn.Module()
    subs = _sublayers(layer)
    if subs:
        node.layers = nn.ModuleList(_mirror(sub, seen) for sub in subs)
    _register_own(node, layer, seen)
    return node


def _parameter(variable: Any) -> nn.Parameter:
    value = variable.value
    if not isinstance(value, nn.Parameter):
        raise ValueError(
            f"Keras variable {variable.path!r} is a {type(value).__name__}, not a torch "
            "Parameter; set KERAS_BACKEND=torch before importing keras"
        )
    return value


def _check_device(module: KerasModule) -> None:
    """Refuse a module moved to another kind of device than Keras creates tensors on."""
    try:
        from keras.src.backend.torch.core import get_device
    except ImportError:  # another layout of keras: nothing to compare with
        return
    wanted = torch.device(get_device())
    first = next(module.parameters(), None)
    if first is not None and first.device.type != wanted.type:
        raise ValueError(
            f"the Keras model's weights are on {first.device} but Keras makes its tensors on "
            f"{wanted} (KERAS_TORCH_DEVICE when keras was imported); set "
            f"KERAS_TORCH_DEVICE={first.device.type} before importing keras, or train on "
            f"--device {wanted.type}"
        )
