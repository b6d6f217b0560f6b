"""The public entry point: ``distsgd.train``.

A script builds its model, loss and data and calls :func:`train`; the scheme, the cluster and
this process's place in it come from the launcher (``distsgd run`` / ``distsgd worker``) through
the ``DISTSGD_TASK`` environment variable. Run plainly (``python script.py``), the same script
trains alone in this process.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch
from torch import nn

from distsgd import schemes
from distsgd.runtime import TaskEnv, TrainConfig, TrainResult, run_worker
from distsgd.runtime.data import BatchFn, as_dataset, check_data
from distsgd.runtime.evaluate import LossFn
from distsgd.runtime.task import TaskInfo

log = logging.getLogger(__name__)

calls = 0
"""How many times :func:`train` ran in this process (the bootstrap checks the script called it)."""


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch, so every task builds the same initial model."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def task() -> TaskInfo:
    """Who this process is: ``.rank``, ``.num_workers``, ``.is_chief``, ``.scheme``,
    ``.run_dir``; run alone (``python script.py``), rank 0 of 1.

    Call it anywhere in a script, before or after :func:`train`, e.g. to print or save only on
    the chief: ``if distsgd.task().is_chief: print(result.test_accuracy)``.
    """
    env = TaskEnv.from_environ()
    return TaskEnv.standalone().info(standalone=True) if env is None else env.info()


def train(
    *,
    model: nn.Module,
    loss_fn: LossFn,
    train_data: Any,
    test_data: Any = None,
    config: TrainConfig | None = None,
    batch_fn: BatchFn | None = None,
) -> TrainResult:
    """Train ``model`` on ``train_data`` under the scheme the command line chose.

    Args:
        model: an ordinary ``torch.nn.Module``; every worker must build the same architecture.
        loss_fn: ``loss_fn(model(inputs), targets)`` -> scalar tensor.
        train_data: a ``torch.utils.data.Dataset`` or an ``(inputs, targets)`` pair; each worker
            trains on its own disjoint shard of it. An item is ``(inputs, target)``,
            ``(x1, ..., target)`` (``model(x1, ...)``) or a dict with a ``"target"`` key (also
            ``"targets"``, ``"label"``, ``"labels"`` or ``"y"``) whose other keys are the
            model's keyword arguments (:mod:`distsgd.runtime.data`).
        test_data: held-out data the chief evaluates (loss, and accuracy for class labels).
        config: the script's defaults; flags given to ``distsgd run`` override them.
        batch_fn: reads any other batch: ``batch_fn(batch) -> (inputs, target)``, the batch
            as ``torch.utils.data.default_collate`` made it, ``inputs`` a tuple of positional
            arguments, a dict of keyword arguments, or one input.

    Raises:
        ValueError: before training, when the first item of ``train_data`` or ``test_data``
            is of a shape distsgd cannot read, or its inputs do not fit ``model.forward``.

    Returns:
        This worker's :class:`TrainResult`; on the chief it carries the test scores.
    """
    global calls
    calls += 1
    env = TaskEnv.from_environ() or TaskEnv.standalone()
    config = (config or TrainConfig()).replace(**env.overrides)
    spec = schemes.get(env.scheme)
    options = spec.parse_options(env.scheme_options)
    scheme = spec.worker(options, env.num_workers)
    train_set = as_dataset(train_data, "train_data")
    test_set = None if test_data is None else as_dataset(test_data, "test_data")
    check_data(train_set, "train_data", batch_fn=batch_fn, model=model)
    if test_set is not None:
        check_data(test_set, "test_data", batch_fn=batch_fn, model=model)
    return run_worker(
        model=model,
        loss_fn=loss_fn,
        train_set=train_set,
        test_set=test_set,
        config=config,
        env=env,
        scheme=scheme,
        batch_fn=batch_fn,
    )
