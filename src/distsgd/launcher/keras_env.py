"""The environment a worker needs for Keras 3 models: ``KERAS_BACKEND`` and
``KERAS_TORCH_DEVICE``.

Keras reads both once, when it is imported (the script's ``import keras``, before
``distsgd.train`` runs), and makes every tensor it creates on ``KERAS_TORCH_DEVICE``; a worker
whose model trains elsewhere fails at its first step. So the launcher sets them in each
worker's environment, unless the user set them (theirs are kept), whatever the script (a
script without Keras never reads them):

* ``KERAS_BACKEND=torch``: distsgd trains PyTorch modules;
* ``KERAS_TORCH_DEVICE``: ``cuda`` for a worker the launcher gave a GPU
  (``CUDA_VISIBLE_DEVICES``: ``--device auto`` or ``cuda`` on a machine with GPUs), ``cpu`` for
  ``--device cpu`` and for ``--device auto`` where no GPU was given, ``cuda:N`` for
  ``--device cuda:N``; unset for ``--device ''`` (the default: the model stays where the
  script built it, where Keras puts it) and under Ray for ``auto`` / ``cuda`` (Ray hands out
  the GPUs; Keras picks a GPU where the worker sees one, as ``--device auto`` does).
"""

from __future__ import annotations

from collections.abc import Mapping

BACKEND_VAR = "KERAS_BACKEND"
DEVICE_VAR = "KERAS_TORCH_DEVICE"


def keras_device(device: str, *, gpu: bool | None) -> str | None:
    """``KERAS_TORCH_DEVICE`` for a worker of ``--device device``; ``gpu``: whether the
    launcher gave it a GPU (None: not known here, as under Ray). None: leave it to Keras."""
    if device == "cpu" or device.startswith("cuda:"):
        return device
    if device in ("auto", "cuda") and gpu is not None:
        return "cuda" if gpu else "cpu"
    return None


def keras_environment(
    device: str, *, gpu: bool | None, environ: Mapping[str, str]
) -> dict[str, str]:
    """The variables to add to a worker's environment ``environ`` (those it lacks)."""
    out = {}
    if BACKEND_VAR not in environ:
        out[BACKEND_VAR] = "torch"
    target = keras_device(device, gpu=gpu)
    if target is not None and DEVICE_VAR not in environ:
        out[DEVICE_VAR] = target
    return out
