"""The public entry points: ``distsgd.train`` and ``distsgd.Worker``.

A script builds its model, loss and data and calls :func:`train`, or runs a training loop of
its own through a :class:`Worker`; the scheme, the cluster and this process's place in it come
from the launcher (``distsgd run`` / ``distsgd worker``) through the ``DISTSGD_TASK``
environment variable. Run plainly (``python script.py``), the same script trains alone in this
process.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import numpy as np
import torch
from torch import nn

from distsgd import schemes
from distsgd.control.errors import SetupError
from distsgd.control.folder import new_run_folder, runs_root
from distsgd.control.task import TaskInfo
from distsgd.runtime import TaskEnv, TrainConfig, TrainResult, run_worker
from distsgd.runtime.amp import check_grad_scaler
from distsgd.runtime.callbacks import Callback
from distsgd.runtime.data import BatchFn, as_dataset, check_data, micro_batches, to_device
from distsgd.runtime.evaluate import LossFn, MetricFns, check_metric_names
from distsgd.runtime.first_step import try_first_step
from distsgd.runtime.modules import as_torch_module
from distsgd.runtime.scheme import WorkerScheme
from distsgd.runtime.session import WorkerSession, setup_errors
from distsgd.runtime.validation import split_validation
from distsgd.util import private_dir

log = logging.getLogger(__name__)

calls = 0
"""How many times :func:`train` ran or a :class:`Worker` was made in this process (the
bootstrap checks the script called one)."""

trained = False
"""True once the last :func:`train` returned or the last :class:`Worker` finished: this
process's training is over (an error the script raises now is its own, after training: the
bootstrap does not have it restarted, see ``launcher/bootstrap.py``)."""

unfinished = 0
""":class:`Worker` objects set up in this process and neither finished nor closed (the
bootstrap refuses a script that ends with one: its result would never be saved)."""


def _interrupted(run_dir: str) -> KeyboardInterrupt:
    """Ctrl-C stopped :func:`train` in a script run alone (``python script.py``): a plain
    ``KeyboardInterrupt``, so a script's own ``except KeyboardInterrupt`` still catches it and,
    left uncaught, the process ends as Python ends on Ctrl-C (by SIGINT: 130 in the shell), as
    ``distsgd run`` does; but the interpreter reports it in one line, not a traceback."""
    _say_uncaught_interruptions()
    where = f"; its files so far are in {run_dir}" if run_dir else ""
    exc = KeyboardInterrupt(f"distsgd: interrupted; training stopped{where}")
    exc.distsgd_said = True  # type: ignore[attr-defined]
    return exc


def _say_uncaught_interruptions() -> None:
    """Make the interpreter's report of an uncaught :func:`_interrupted` its one line (any
    other exception goes to the hook that was there before, once installed)."""
    previous = sys.excepthook
    if getattr(previous, "distsgd_said", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if getattr(value, "distsgd_said", False):
            print(value, file=sys.stderr)  # in place of the traceback the interpreter prints
        else:
            previous(kind, value, tb)

    hook.distsgd_said = True  # type: ignore[attr-defined]
    sys.excepthook = hook


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


def _prepare(
    model: nn.Module,
    train_data: Any,
    test_data: Any,
    config: TrainConfig | None,
    batch_fn: BatchFn | None,
    metrics: MetricFns | None,
) -> tuple[TaskEnv, TrainConfig, WorkerScheme, Any, Any]:
    """This task's environment, its config (the command line's flags over the script's),
    its scheme's worker half, and the data sets checked against the model; a mistake in them
    raises ValueError (under :func:`setup_errors`: a :class:`SetupError`)."""
    global calls, trained
    calls += 1  # the bootstrap checks that the script called train or made a Worker
    trained = False
    env = TaskEnv.from_environ() or _alone()
    config = (config or TrainConfig()).replace(**env.overrides)
    spec = schemes.get(env.scheme)
    scheme = spec.make_worker(spec.parse_options(env.scheme_options), env.num_workers)
    model = as_torch_module(model)  # a Keras 3 model: checked (built, torch backend), wrapped
    train_set = None if train_data is None else as_dataset(train_data, "train_data")
    test_set = None if test_data is None else as_dataset(test_data, "test_data")
    if config.validation:  # tuning: evaluate on a held-out part of train_data, not test_data
        if train_set is None:
            raise ValueError("validation needs train_data to hold a part of it out; pass it")
        train_set, test_set = split_validation(train_set, config.validation)
    if train_set is not None:
        # streaming: train_data may be an IterableDataset (runtime/stream.py)
        check_data(train_set, "train_data", batch_fn=batch_fn, model=model, stream=True)
    if test_set is not None:
        check_data(test_set, "test_data", batch_fn=batch_fn, model=model)
    check_metric_names(metrics or {})
    return env, config, scheme, train_set, test_set


def _try_loss(
    model: nn.Module,
    loss_fn: LossFn,
    data: dict[str, Any],
    config: TrainConfig,
    batch_fn: BatchFn | None,
) -> None:
    """The loss of the first few items of each data set given (name -> set or None), before
    training: a model, loss or shapes that do not fit raise ValueError now, on every worker,
    instead of at a step or at the chief's evaluation (:mod:`distsgd.runtime.first_step`)."""
    module = as_torch_module(model)
    for name, dataset in data.items():
        if dataset is not None:
            size = config.batch_size
            try_first_step(module, loss_fn, dataset, batch_size=size, batch_fn=batch_fn, name=name)


def _alone() -> TaskEnv:
    """The task of a script run alone: one worker, with a run folder of its own (under
    ``$DISTSGD_RUNS``, default ``./distsgd-runs``; none when it says ``off``)."""
    env = TaskEnv.standalone()
    root = runs_root()
    if root is None:
        return env
    folder = new_run_folder("alone", root)
    private_dir(folder.parent)
    folder.mkdir(mode=0o700)
    log.info("run folder %s", folder)
    return dataclasses.replace(env, run_dir=str(folder))


def train(
    *,
    model: nn.Module,
    loss_fn: LossFn,
    train_data: Any,
    test_data: Any = None,
    config: TrainConfig | None = None,
    batch_fn: BatchFn | None = None,
    callbacks: Sequence[Callback] = (),
    metrics: MetricFns | None = None,
) -> TrainResult:
    """Train ``model`` on ``train_data`` under the scheme the command line chose.

    Args:
        model: an ordinary ``torch.nn.Module``; every worker must build the same architecture.
            A built Keras 3 model on the PyTorch backend works too (docs/keras.md).
        loss_fn: ``loss_fn(model(inputs), targets)`` -> scalar tensor.
        train_data: a ``torch.utils.data.Dataset`` or an ``(inputs, targets)`` pair; each worker
            trains on its own disjoint shard of it. An item is ``(inputs, target)``,
            ``(x1, ..., target)`` (``model(x1, ...)``) or a dict with a ``"target"`` key (also
            ``"targets"``, ``"label"``, ``"labels"`` or ``"y"``) whose other keys are the
            model's keyword arguments (:mod:`distsgd.runtime.data`). Larger than memory: a
            :class:`distsgd.ShardFolder`, or an ``IterableDataset`` (each worker reads its part,
            ``--steps`` required; :mod:`distsgd.runtime.stream`, docs/large-data.md).
        test_data: held-out data the chief evaluates (loss, and accuracy for class labels).
        config: the script's defaults; flags given to ``distsgd run`` override them.
        batch_fn: reads any other batch: ``batch_fn(batch) -> (inputs, target)``, the batch
            as ``torch.utils.data.default_collate`` made it, ``inputs`` a tuple of positional
            arguments, a dict of keyword arguments, or one input.
        callbacks: :class:`~distsgd.Callback` objects called every N steps
            (``on_step``) and after each evaluation on the chief (``on_evaluate``);
            ``distsgd.Every(100, fn)`` calls ``fn(info)`` every 100 steps.
        metrics: ``{name: fn(output, target) -> number}``, evaluated with the loss on
            ``test_data`` (averaged over samples); in ``metrics.jsonl`` under ``"user"`` and
            in ``TrainResult.metrics``.

    Raises:
        ValueError: before training, when the first item of ``train_data`` or ``test_data``
            is of a shape distsgd cannot read, or its inputs do not fit ``model.forward``; or
            ``model`` is a Keras model not built yet or not on the PyTorch backend.

    Returns:
        This worker's :class:`TrainResult`; on the chief it carries the test scores.
    """
    with setup_errors():
        env, config, scheme, train_set, test_set = _prepare(
            model, train_data, test_data, config, batch_fn, metrics
        )
        _try_loss(
            model, loss_fn, {"train_data": train_set, "test_data": test_set}, config, batch_fn
        )
    try:
        result = run_worker(
            model=model,
            loss_fn=loss_fn,
            train_set=train_set,
            test_set=test_set,
            config=config,
            env=env,
            scheme=scheme,
            batch_fn=batch_fn,
            callbacks=callbacks,
            metric_fns=metrics,
        )
    except KeyboardInterrupt as exc:
        if not env.standalone_run or getattr(exc, "distsgd_said", False):
            raise
        raise _interrupted(env.run_dir) from None
    global trained
    trained = True
    return result


class Step:
    """One step of a :class:`Worker`'s loop, as ``with worker.step() as step:`` gives it."""

    def __init__(self, module: nn.Module | None = None) -> None:
        self.loss: float | torch.Tensor | None = None
        """Set it to the step's loss: it feeds the metrics lines, the progress line and
        divergence detection (unset: the step has no loss on record)."""
        self._samples: int | None = None
        self._module = module

    @property
    def samples(self) -> int | None:
        """The step's samples, when they are not ``batch_size`` (a last short batch, or
        several batches accumulated into one step): the samples/s figures count them."""
        return self._samples

    @samples.setter
    def samples(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"step.samples must be a whole number, got {value!r}")
        if value is not None and value < 1:
            raise ValueError(f"step.samples must be 1 or more, the step's samples; got {value}")
        self._samples = value

    def micro_batches(self, batch: Any, parts: int) -> Iterator[Any]:
        """Gradient accumulation: ``batch`` in ``parts`` micro-batches (cut along the first
        dimension, sizes differing by at most one), one forward and backward each; the
        gradients add up, and the step updates once. Divide each micro-batch's mean loss by
        ``parts`` for the batch's mean. Under allreduce the gradients travel once, after the
        last backward (DDP's ``no_sync`` around the others)."""
        pieces = micro_batches(batch, parts)
        no_sync = getattr(self._module, "no_sync", None)
        if getattr(self._module, "static_graph", False):
            no_sync = None  # DDP's static graph fails under no_sync: every backward travels
        for index, piece in enumerate(pieces):
            if no_sync is None or index == len(pieces) - 1:
                yield piece
            else:
                with no_sync():
                    yield piece


class Worker:
    """A training loop of your own, run as a distsgd worker under any scheme.

    distsgd does everything around forward and backward, exactly as under :func:`train`:
    the scheme's update (a push to the servers, or a local optimizer step), fresh parameters
    before each step, checkpoints and resuming, metrics, evaluation on the chief, fault
    injection, divergence detection, and at the end waiting for the others and saving the
    result. The loop does forward and backward, and leaves the update to distsgd::

        worker = distsgd.Worker(model, train_data=(x, y))
        for inputs, target in worker.batches():      # this worker's shard, on its device
            with worker.step() as step:              # e.g. pulls fresh parameters
                loss = F.cross_entropy(worker.model(inputs), target)
                loss.backward()                      # no optimizer.step(): the scheme updates
                step.loss = loss
        result = worker.finish()                     # (or use Worker as a context manager)

    Args:
        model: the ``torch.nn.Module`` to train; every worker must build the same one.
            A built Keras 3 model (PyTorch backend) too: run forward through
            :attr:`model`, which passes Keras's ``training`` flag (docs/keras.md).
        train_data: the training set (as for :func:`train`) for :meth:`batches` to shard;
            None when the loop reads data of its own: each worker then must read its own part
            (``distsgd.task().rank`` of ``.num_workers``) and the run lasts ``--steps`` local
            steps (``config.steps``), or until :meth:`finish`.
        test_data, loss_fn: held-out data the chief evaluates with ``loss_fn`` every
            ``--eval-every`` steps and at the end (both or neither).
        config: the script's defaults; flags given to ``distsgd run`` override them.
        batch_fn: how to read a batch for evaluation (as for :func:`train`).
        optimizer: (schemes that step a local optimizer: allreduce, downpour, easgd, localsgd,
            diloco's inner one) your own optimizer over the model's parameters, stepped by the
            scheme instead of the SGD of ``--lr`` / ``--momentum``. Under the other schemes the
            parameter servers apply every update: passing one is refused.
        grad_scaler: a ``torch.amp.GradScaler`` the loop scales its loss with
            (``scaler.scale(loss).backward()``): on leaving each step the gradients are
            unscaled, a step whose gradients hold inf or NaN is skipped (nothing sent, no
            optimizer step; the step still counts) and the scale updated.
        callbacks, metrics: as for :func:`train`.

    Collective schemes (allreduce, localsgd, diloco) need every worker to take the same
    number of steps: :meth:`batches` gives every worker the same number; a loop over data of
    its own must see to it.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        train_data: Any = None,
        test_data: Any = None,
        loss_fn: LossFn | None = None,
        config: TrainConfig | None = None,
        batch_fn: BatchFn | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        callbacks: Sequence[Callback] = (),
        metrics: MetricFns | None = None,
    ) -> None:
        if (test_data is None) != (loss_fn is None):
            raise SetupError(
                "Worker(test_data=..., loss_fn=...): the chief evaluates test_data with "
                "loss_fn; pass both or neither"
            )
        with setup_errors():
            env, self.config, scheme, train_set, test_set = _prepare(
                model, train_data, test_data, config, batch_fn, metrics
            )
            if loss_fn is not None:  # the chief's evaluation; the loop's own loss is the user's
                _try_loss(model, loss_fn, {"test_data": test_set}, self.config, batch_fn)
            if grad_scaler is not None:
                check_grad_scaler(grad_scaler)
        self._session = WorkerSession(
            model=model,
            loss_fn=loss_fn,
            train_set=train_set,
            test_set=test_set,
            config=self.config,
            env=env,
            scheme=scheme,
            batch_fn=batch_fn,
            callbacks=callbacks,
            metric_fns=metrics,
            optimizer=optimizer,
            grad_scaler=grad_scaler,
        )
        self.result: TrainResult | None = None
        """What :meth:`finish` returned (None before)."""
        try:
            self._session.open()
        except BaseException as exc:
            self._session.failed(exc)
            self._session.close()
            raise
        global unfinished
        unfinished += 1
        self._open = True
        """Neither finished nor closed yet (counted in ``unfinished``)."""

    @property
    def model(self) -> nn.Module:
        """What to run forward through: your model, or the scheme's wrapper around it
        (allreduce: ``DistributedDataParallel``, which exchanges the gradients); the same
        parameters either way."""
        return self._session.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer whose learning rate this worker's updates follow: a
        ``torch.optim.lr_scheduler`` over it schedules the run. Under schemes that step a local
        optimizer, that one (yours, ``optimizer=``, or distsgd's); under the others a stand-in
        that updates nothing and holds the parameter servers' rate: each push carries its
        ``lr`` over the starting one, and the servers scale their step by it. Refused with
        ``--lr-schedule``/``--warmup``, which set the rate themselves."""
        rate = self._session.rate
        assert rate is not None, "set when the session opened"
        return rate

    @property
    def device(self) -> torch.device:
        """Where this worker trains (``--device``): put your batches there."""
        return self._session.device

    @property
    def task(self) -> TaskInfo:
        """Who this worker is: ``.rank``, ``.num_workers``, ``.is_chief`` ..."""
        return task()

    @property
    def local_step(self) -> int:
        """Steps this worker has taken (after a resume, counting those before it)."""
        return self._session.local_step

    @property
    def start_step(self) -> int:
        """The local step this process began at: 0, or where a resumed worker's checkpoint
        (or a restarted worker's servers) left off; a loop over its own data skips so many
        batches."""
        return self._session.start_step

    @property
    def done(self) -> bool:
        """True once this worker's steps (``--steps``, or the epochs of ``train_data``) are
        taken, or the worker was asked to leave an elastic run: end the loop then."""
        return self._session.done

    def batches(self) -> Iterator[Any]:
        """This worker's batches of ``train_data`` (its disjoint shard, reshuffled each epoch,
        resumed where a checkpoint left off), on :attr:`device`, until :attr:`done`; each
        one as ``default_collate`` made it (a tuple ``(inputs, target)`` for pairs)."""
        for raw in self._session.batches():
            yield to_device(raw, self._session.device)

    @contextmanager
    def step(self) -> Iterator[Step]:
        """Around one step's forward and backward: on entry the scheme prepares the step (e.g.
        pulls fresh parameters) and the gradients are zeroed; on exit it applies the update
        and the metrics, evaluation and checkpoints of this step follow. An exception inside
        leaves the step untaken."""
        step = Step(self._session.module)
        with self._session.forward_backward():
            yield step
        self._session.end_step(step.loss, step.samples)

    def log(self, **values: float | torch.Tensor) -> None:
        """Your own values into ``metrics.jsonl`` (as ``{"user": {...}}``, at this step)."""
        self._session.log_values(values)

    def finish(self) -> TrainResult:
        """End this worker's part: push what the scheme holds, leave, (chief) wait for the
        others, evaluate and save the result; then close the connections."""
        if self.result is not None:
            return self.result
        global trained
        try:
            self.result = self._session.finish()
            self._ended()
            trained = unfinished == 0
            return self.result
        except BaseException as exc:
            self._session.failed(exc)
            raise
        finally:
            self._session.close()

    def close(self) -> None:
        """Close the connections without finishing (after a failure)."""
        self._ended()
        self._session.close()

    def _ended(self) -> None:
        global unfinished
        if self._open:
            self._open = False
            unfinished -= 1

    def __enter__(self) -> Worker:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.finish()
        else:
            self._session.failed(exc)
            self.close()
