"""One worker's part of a run, step by step: what every training loop runs inside.

The loop itself, distsgd's own (:func:`distsgd.runtime.loop.run_worker`) or the user's
(:class:`distsgd.Worker`), does forward and backward; the session does everything around
them. It connects to the parameter servers or joins the process group, registers, resumes
from a checkpoint, calls the scheme's hooks, writes metrics, checkpoints, evaluates on the
chief, injects faults, watches for divergence, and at the end waits for the others and saves
the result::

    session.open()                       connect, register, resume, wrap the model
    for raw in session.batches():        (optional) this worker's shard of the training set
        session.begin_step()             checkpoint, faults, lr schedule, scheme.before_step
        loss = loss_fn(session.module(inputs), target); loss.backward()
        session.end_step(loss)           scheme.after_backward, metrics, evaluation, callbacks
    result = session.finish()            scheme.finish, leave, wait, final evaluation, result
    session.close()                      (always, in finally) sockets, heartbeat, files

``open`` is :func:`~distsgd.runtime.setup.open_worker`; what the worker is connected to (the
servers, the process group, no one) is its :class:`~distsgd.runtime.connection.Connection`,
and the chief's evaluations and end of the run are :class:`~distsgd.runtime.chief.Chief`'s.
Schemes never see sockets, files or the data loader.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from distsgd.control.config import LrScaling, TrainConfig, lr_factor
from distsgd.control.divergence import Diverged, DivergenceMonitor
from distsgd.control.errors import SetupError
from distsgd.control.faults import FaultInjector
from distsgd.control.folder import METRICS_FILE, LocalFiles, RunFiles
from distsgd.control.metrics import MetricsWriter
from distsgd.control.remote_files import from_environ
from distsgd.control.task import TaskEnv
from distsgd.runtime.amp import ScaledGradients
from distsgd.runtime.callbacks import Callback, StepInfo, check_user_values
from distsgd.runtime.checkpoint import Checkpointer, replica_state
from distsgd.runtime.chief import Chief, log_work
from distsgd.runtime.connection import Connection
from distsgd.runtime.data import BatchFn
from distsgd.runtime.evaluate import LossFn, MetricFns
from distsgd.runtime.modules import as_torch_module
from distsgd.runtime.rates import (
    ServerRate,
    distsgd_sets_rate,
    has_scheduler,
    refuse_scheduler,
)
from distsgd.runtime.result import TrainResult, work_counts
from distsgd.runtime.scheme import WorkerScheme
from distsgd.runtime.setup import UNBOUNDED, checkpointer, open_worker, stop_on, stop_on_sigterm
from distsgd.runtime.step_log import StepLog
from distsgd.runtime.stream import Batches  # streaming
from distsgd.runtime.work import LeasedBatches
from distsgd.transport.inflight import CALLS
from distsgd.util.probe import FOLDER, Probe, start_probe

log = logging.getLogger(__name__)


class WorkerSession:
    """One worker's part of a run, driven step by step (see the module docstring).

    ``train_set`` None: the loop brings its own data (:meth:`batches` is then unavailable);
    the run lasts ``config.steps`` local steps when given, else until the loop calls
    :meth:`finish`. ``stop`` (``--world-size dynamic``): once set, :attr:`done` turns true and
    :meth:`batches` ends; the loop's :meth:`finish` then pushes what the scheme holds, reports
    the work units and leaves (``TrainResult.left``). In the main thread of an elastic run
    SIGTERM sets it (the launcher shrinks a run so).
    """

    saving = False
    """Asked to stop and save (SIGINT: the launcher's Ctrl-C): the worker ends after its step,
    saves its state and leaves; the chief then ends with a checkpoint (the servers, then the
    manifest of every worker's newest state)."""

    rate: torch.optim.Optimizer | None = None
    """The optimizer whose ``lr`` the updates follow (``worker.optimizer``, set by
    :meth:`open`): the scheme's local one, or a :class:`ServerRate` for the servers' rate."""

    def __init__(
        self,
        *,
        model: nn.Module,
        loss_fn: LossFn | None,
        train_set: Dataset[Any] | None,
        test_set: Dataset[Any] | None,
        config: TrainConfig,
        env: TaskEnv,
        scheme: WorkerScheme,
        batch_fn: BatchFn | None = None,
        stop: threading.Event | None = None,
        callbacks: Sequence[Callback] = (),
        metric_fns: MetricFns | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if test_set is not None and loss_fn is None:
            raise ValueError("test_data needs loss_fn= to evaluate with; pass both or neither")
        # a Keras 3 model: wrapped (runtime/keras_models.py); any other as it is
        self.model = model = as_torch_module(model)
        self.train_set = train_set
        self.given_config = config
        """The config as the script and the command line gave it (``result.json``'s)."""
        self.lr_scaling, self.config = applied(config, scheme, env.num_workers)
        """What the run applies: ``lr`` (and, for Hogwild, ``momentum``) the scheme's on this
        many workers."""
        self.env = env
        self.scheme = scheme
        self.batch_fn = batch_fn
        self.callbacks, self.metric_fns = tuple(callbacks), dict(metric_fns or {})
        self.optimizer, self.scaled = optimizer, ScaledGradients.of(grad_scaler)
        self.rank = env.task_index
        self.chief = self.rank == 0
        self.name = f"worker{self.rank}"
        self.dynamic = config.world_size == "dynamic"
        self.stop = stop if stop is not None or not self.dynamic else threading.Event()
        self.run_dir = Path(env.run_dir) if env.run_dir else None
        self.files, self.metrics = _run_folder(env, self.name)
        self.module: nn.Module = model
        """What forward runs through: the model, or the scheme's wrapper of it (allreduce:
        ``DistributedDataParallel``), training the same parameters."""
        self.steps = UNBOUNDED
        """This worker's local steps in the run (:data:`UNBOUNDED`: the loop decides)."""
        self.start_step = 0
        """The local step this process began at (a resumed or restarted worker's)."""
        self.started = 0.0
        """When its training loop began (``time.monotonic``)."""
        self.left = False
        self.loss_value = float("nan")
        self.samples = 0
        self.faults = FaultInjector([])
        self.watch = DivergenceMonitor(self.name)
        self._restores: list[Callable[[], None] | None] = []  # the old signal handlers
        self._conn = Connection()
        """What this worker is connected to (set up by :meth:`open`)."""
        self._batches: Batches | LeasedBatches | None = None  # streaming: Batches
        self._ckpt: Checkpointer | None = None
        self._chief = (
            Chief(
                test_set=test_set,
                loss_fn=loss_fn,
                batch_fn=batch_fn,
                metric_fns=self.metric_fns,
                config=self.config,
                given_config=config,
                lr_scaling=self.lr_scaling,
                files=self.files,
                metrics=self.metrics,
            )
            if self.chief
            else None
        )
        """Worker 0's evaluations and end of the run (None on the other workers)."""
        self._prepared = self._in_step = False  # a step is drawn / begun and not ended
        self._forwards = self._forwards_at_begin = 0  # through self.module: all / at begin
        self._opened = self._finished = False
        self._log = StepLog(self.metrics, alone=env.standalone_run)
        self._stepped = time.monotonic()  # when its last step ended (distsgd doctor reads it)
        self._probe: Probe | None = None

    # -- start ----------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._ctx.device

    @property
    def local_step(self) -> int:
        return self._ctx.local_step

    @property
    def done(self) -> bool:
        """True once this worker has taken its steps, or it was asked to stop."""
        stopped = self.stop is not None and self.stop.is_set()
        return stopped or self._ctx.local_step >= self.steps

    def open(self) -> None:
        """Connect, register (chief), join, resume, and make the scheme ready for step 1.

        Raises:
            SetupError: (a ValueError) settings or data this run cannot honour.
        """
        assert not self._opened, "a session opens once"
        self._opened = True
        with setup_errors():
            self._open()

    def _open(self) -> None:
        local = self.run_dir if isinstance(self.files, LocalFiles) else None
        self._probe = start_probe(self.name, None if local is None else local / FOLDER)
        if self._probe is not None:
            self._probe.add("worker", self._doctor_state)
        env = self.env = self.env.with_ps_addresses(self.env.startup_timeout, files=self.files)
        if self.dynamic and self.stop is not None:
            self._restores.append(stop_on_sigterm(self.stop))
        opened = open_worker(
            env=env,
            config=self.config,
            scheme=self.scheme,
            model=self.model,
            train_set=self.train_set,
            optimizer=self.optimizer,
            stop=self.stop,
            metrics=self.metrics,
            lr_scaling=self.lr_scaling,
            files=self.files,
        )
        self._conn, self._ctx, self._batches = opened.conn, opened.ctx, opened.batches
        self.steps, self.start_step, self.samples = opened.steps, opened.start_step, opened.samples
        self.module, self.faults = opened.module, opened.faults
        made = self._ctx.optimizers
        self.rate = made[0] if made else ServerRate(self._ctx.params.values(), self.config.lr)
        self._ctx.checks_gradients = self.scaled is not None
        if self.module is not self.model:
            self.module.register_forward_pre_hook(self._count_forward)
        self._ckpt = checkpointer(env, self.run_dir, self.scheme)
        if self._ckpt is not None and not env.standalone_run and self._conn.shard_checkpoint:
            self.stop = self.stop or threading.Event()
            said = "SIGINT: stopping after this step to save a checkpoint"
            self._restores.append(
                stop_on(signal.SIGINT, self.stop, said, self._save_on_stop, once=True)
            )
        self.watch = DivergenceMonitor(
            self.name, from_start=self.start_step == 0, spikes=self.env.rollbacks_left > 0
        )
        if self._chief is not None:
            self._chief.start(self.model, from_start=self.start_step == 0)
        self.started = time.monotonic()
        self._ctx.clock.start_loop()
        self.model.train()

    def _save_on_stop(self) -> None:
        self.saving = True

    def _count_forward(self, module: nn.Module, args: Any) -> None:
        self._forwards += 1

    def worker_state(self) -> dict[str, Any]:
        """What a checkpoint saves of this worker (read back by ``load_worker_state``)."""
        ctx = self._ctx
        from_servers = self.scheme.replica_from_servers
        return {
            "worker": self.rank,
            "local_step": ctx.local_step,
            "global_step": ctx.global_step,
            "position": None if self._batches is None else self._batches.position,
            "samples": self.samples,
            "model": replica_state(self.model, ctx.params if from_servers else {}),
            "replica_from_servers": from_servers,
            "scheme": self.scheme.state_dict(),
            "scheme_name": self.env.scheme,
            "steps": self.steps,
        }

    # -- steps ----------------------------------------------------------------------------------
    def progress(self) -> tuple[int, int] | None:
        """(done, total) of the run for the lr schedule and the progress line; None when the
        loop decides the end."""
        if self._conn.leased is not None:
            return self._conn.leased.progress
        if self.steps == UNBOUNDED:
            return None
        return self._ctx.local_step, self.steps

    def _prepare(self) -> None:
        """Before a step's batch is drawn: checkpoint (its position is the batch to come),
        faults at this step, the lr schedule, and the work units whose pushes landed."""
        ctx = self._ctx
        if self._ckpt is not None:
            with ctx.clock.measure("checkpoint"):
                self._ckpt.maybe_save_worker(ctx.local_step, self.start_step, self.worker_state)
        self.faults.before_step(ctx.global_step)
        self._set_rate()
        self._conn.settle(ctx.push_outcomes)
        self._prepared = True

    def _set_rate(self) -> None:
        """This step's rate: distsgd's schedule when it has one (a scheduler of the loop's
        own is then refused), else the rate the loop's scheduler gave ``worker.optimizer``
        (the local optimizer keeps it; the servers get it as each push's ``lr_scale``); both
        times a rollback's ``lr_cut``, which a scheduler of the loop's own leaves to it."""
        ctx, progress, rate = self._ctx, self.progress(), self.rate
        assert rate is not None
        cut = self.config.lr_cut  # below 1 after a rollback (control/rollback.py)
        if not distsgd_sets_rate(self.config) or progress is None:
            if isinstance(rate, ServerRate):
                ctx.lr_scale = rate.scale() * cut
            elif ctx.lr_scale != cut and not has_scheduler(rate):  # else its scheduler's
                ctx.set_lr_scale(cut)
            return
        refuse_scheduler(self.config, rate)
        done, total = progress
        scale = lr_factor(self.config.lr_schedule, done, total, self.config.warmup) * cut
        if self.config.world_size == "dynamic":  # the rule follows the live workers
            scale *= self.lr_scaling.at(ctx.live_workers)
        ctx.set_lr_scale(scale)

    def batches(self) -> Iterator[Any]:
        """This worker's batches of the training set, as ``default_collate`` made them (on the
        CPU), until its steps are done or it is asked to stop."""
        if self._batches is None:
            raise ValueError(
                "batches() reads the training set distsgd shards: pass train_data= (or loop "
                "over your own data and call step() around each batch)"
            )
        source = iter(self._batches)
        while not self.done:
            self._prepare()
            with self._ctx.clock.measure("data"):
                self.faults.before_fetch()
                raw = next(source, None)
            if raw is None:  # leased: the queue has no more work for this worker
                self._prepared = False
                return
            yield raw

    def begin_step(self) -> None:
        """Just before forward: the scheme's ``before_step`` (e.g. pull fresh parameters), the
        servers' checkpoint (chief), and zeroed gradients."""
        assert self._opened and not self._finished, "begin_step outside an open session"
        if self._in_step:
            raise RuntimeError("step() inside a step: end the previous step first")
        if not self._prepared:
            self._prepare()
        ctx = self._ctx
        ctx.push_step = ctx.local_step  # a push before this step's backward reflects the others
        self.scheme.before_step(ctx)
        if self._ckpt is not None and self.chief:
            with ctx.clock.measure("checkpoint"):
                self._ckpt.maybe_checkpoint_servers(
                    self._conn.shard_checkpoint, {"scheme": self.env.scheme, "steps": self.steps}
                )
        # zeroed, not set to None: some schemes keep gradients in place in shared memory
        self.model.zero_grad(set_to_none=False)
        self._forwards_at_begin = self._forwards
        self._in_step = True

    @contextmanager
    def forward_backward(self) -> Iterator[None]:
        """:meth:`begin_step`, then the loop's forward and backward; if they raise, the step did
        not happen, and a RuntimeError comes with the scheme's hint added (where it has one)."""
        self.begin_step()
        try:
            yield
        except BaseException as exc:
            self._in_step = self._prepared = False
            hint = self.scheme.explain(exc) if isinstance(exc, RuntimeError) else None
            if hint is None:
                raise
            raise RuntimeError(f"{exc}; {hint}") from exc

    def end_step(self, loss: float | torch.Tensor | None, samples: int | None = None) -> None:
        """After backward, gradients in ``param.grad``: the scheme's ``after_backward`` (push,
        or a local optimizer step), then metrics, evaluation and callbacks on their steps.

        ``loss`` (the step's loss; None if the loop does not say) feeds the metrics lines and
        the divergence watch; ``samples`` is the batch's size (default ``batch_size``)."""
        if not self._in_step:
            raise RuntimeError("end of a step that did not begin: call step() around each batch")
        self._in_step = self._prepared = False
        ctx, config = self._ctx, self.config
        if self.module is not self.model and self._forwards == self._forwards_at_begin:
            raise SetupError(
                f"under {self.env.scheme} forward must run through worker.model (the "
                f"{type(self.module).__name__} around your model, which exchanges the "
                "gradients), not through your model itself; call worker.model(inputs)"
            )
        self._conn.trained(ctx.pushes_started)  # its update is in the pushes begun after
        if loss is not None:
            self.loss_value = (
                float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
            )
            self.watch.observe(self.loss_value, ctx.local_step)
        ctx.push_step = ctx.local_step + 1  # its push holds this step's update
        self._update()
        ctx.local_step += 1
        self._stepped = time.monotonic()
        self.samples += config.batch_size if samples is None else int(samples)
        self._conn.after_step(ctx)
        if ctx.local_step % config.log_every == 0 or ctx.local_step == self.steps:
            self._log_step()
        scores = None if self._chief is None else self._chief.every_step(ctx, self.scheme)
        for callback in self.callbacks:
            if callback.every_steps and ctx.local_step % callback.every_steps == 0:
                callback.on_step(self._info())
            if scores is not None:
                callback.on_evaluate(self._info(), scores)

    def _update(self) -> None:
        """The scheme's update (``after_backward``); gradients the loop's loss scaler scaled
        are unscaled first, and not used when they are not finite (:mod:`.amp`)."""
        ctx, rate, scaled = self._ctx, self.rate, self.scaled
        assert rate is not None
        if scaled is not None:
            scaled.unscale(ctx, rate)
        self.scheme.after_backward(ctx)
        if isinstance(rate, ServerRate):
            ctx.step_optimizer(rate)  # nothing to update: a scheduler over it sees it stepped
        if scaled is not None:
            scaled.update(ctx)

    def _log_step(self) -> None:
        ctx = self._ctx
        self._log.step(
            ctx,
            progress=self.progress(),
            loss=self.loss_value,
            samples=self.samples,
            last=ctx.local_step == self.steps,
            epoch=None if self._batches is None else self._batches.epoch,
            extra={
                **self._conn.step_fields(ctx),
                **self.scheme.stats(),
                **({} if self.scaled is None else self.scaled.fields()),
            },
        )

    def log_values(self, values: Mapping[str, Any]) -> None:
        """The loop's own values into the metrics lines, as ``{"user": {...}}``."""
        checked = check_user_values(values)
        self.metrics.log(step=self._ctx.global_step, local_step=self._ctx.local_step, user=checked)

    def _info(self) -> StepInfo:
        ctx = self._ctx
        return StepInfo(
            rank=self.rank,
            is_chief=self.chief,
            local_step=ctx.local_step,
            global_step=ctx.global_step,
            loss=self.loss_value,
            samples=self.samples,
            seconds=time.monotonic() - self.started,
            model=self.model,
        )

    # -- end ------------------------------------------------------------------------------------
    def finish(self) -> TrainResult:
        """After the last step: the scheme's ``finish``, leave, (chief) wait for the others,
        evaluate and save ``result.json`` and the final parameters."""
        assert self._opened and not self._finished, "finish once, after open"
        if self._in_step:
            raise RuntimeError("finish() inside a step: end the step first")
        self._finished = True
        ctx, conn, ckpt = self._ctx, self._conn, self._ckpt
        self.left = self.stop is not None and self.stop.is_set()  # (stop is never cleared)
        ctx.push_step = ctx.local_step
        self.scheme.finish(ctx)
        ctx.clock.stop_loop()
        seconds = time.monotonic() - self.started
        work_status = conn.work_report(ctx.push_outcomes)
        if ckpt is not None:
            ckpt.save_worker(self.worker_state(), ctx.local_step)
        conn.leave()
        if self.left:
            log.info("%s: asked to stop; left the run after %d steps", self.name, ctx.local_step)
            self.metrics.log(step=ctx.global_step, local_step=ctx.local_step, event="left")
        self._log.finished(ctx, seconds=seconds, checkpoints=ckpt, extra=conn.finish_fields())
        if self.chief:
            work_status = conn.wait_for_others(self.env, None if ckpt is None else ckpt.root)
        if ckpt is not None:
            if self.saving:  # every worker saved and left: the servers now, then the manifest
                extra = {"scheme": self.env.scheme, "steps": self.steps}
                ckpt.checkpoint_on_stop(ctx.local_step, conn.shard_checkpoint, extra)
            ckpt.close()
        result = TrainResult(
            scheme=self.env.scheme,
            worker=self.rank,
            local_steps=ctx.local_step,
            global_step=ctx.global_step,
            seconds=seconds,
            samples=self.samples,
            bytes_sent=ctx.bytes_sent,
            bytes_received=ctx.bytes_received,
            time_split={k: round(v, 4) for k, v in ctx.clock.totals().items()},
            work=work_counts(work_status) if self.chief and work_status is not None else None,
            left=self.left,
        )
        if result.work is not None:
            log_work(result.work, self.metrics, ctx.global_step, ctx.local_step)
        verdict = self.watch.loss_verdict(left=self.left)
        if verdict is not None:
            log.warning("diverged: %s", verdict)
            self.metrics.log(step=ctx.global_step, event="diverged", reason=verdict)
            result = dataclasses.replace(result, diverged=True, divergence=verdict)
        if self._chief is not None and not self.left:
            result = self._chief.finish(
                result, ctx=ctx, conn=conn, scheme=self.scheme, on_evaluate=self._on_evaluate
            )
        log.info("%s: done, %d steps in %.1fs", self.name, ctx.local_step, seconds)
        conn.part()
        return result

    def _on_evaluate(self, scores: dict[str, float]) -> None:
        for callback in self.callbacks:
            callback.on_evaluate(self._info(), scores)

    def failed(self, exc: BaseException) -> None:
        """The loop raised: a divergence is logged as such (the launcher reports it)."""
        if isinstance(exc, Diverged):
            self.metrics.log(event="diverged", reason=str(exc), good_until=exc.good_until)

    def _doctor_state(self) -> dict[str, Any]:
        """What ``distsgd doctor`` reads of this worker (:mod:`distsgd.util.probe`)."""
        ctx = getattr(self, "_ctx", None)
        doing = None if ctx is None else ctx.clock.doing
        now = time.monotonic()
        return {
            "scheme": self.env.scheme,
            "opened": ctx is not None,
            "step": None if ctx is None else ctx.local_step,
            "steps": self.steps,
            "since_step_s": round(now - self._stepped, 3),
            "phase": ("opening" if ctx is None else "compute") if doing is None else doing[0],
            "phase_s": None if doing is None else round(now - doing[1], 3),
            "collective": self._conn.collective is not None,
            "servers": list(self.env.cluster.get("ps", [])),
            "calls": CALLS.snapshot(),
        }

    def close(self) -> None:
        """Always, after finish or a failure: signal handler, heartbeat, sockets, files."""
        if self._probe is not None:
            self._probe.close()
        while self._restores:
            restore = self._restores.pop()
            if restore is not None:
                restore()
        conn, self._conn = self._conn, Connection()  # closed once
        conn.close()
        if self._chief is not None:
            self._chief.close()
        self.metrics.close()
        if self.files is not None:
            self.files.close()


@contextmanager
def setup_errors() -> Iterator[None]:
    """A ValueError raised while a task sets itself up is a user mistake: a
    :class:`SetupError`, which the launcher reports in one line and does not restart."""
    try:
        yield
    except SetupError:
        raise
    except ValueError as exc:
        raise SetupError(str(exc)) from exc


def _run_folder(env: TaskEnv, name: str) -> tuple[RunFiles | None, MetricsWriter]:
    """The task's run folder (on this disk, or the launcher's over the network; None: none)
    and its metrics lines' writer into it."""
    files = from_environ(env.run_dir, env.control)
    path = Path(env.run_dir) / METRICS_FILE if env.run_dir else None
    remote = None if isinstance(files, LocalFiles) else files
    return files, MetricsWriter(path, name, remote=remote)


def applied(
    config: TrainConfig, scheme: WorkerScheme, workers: int
) -> tuple[LrScaling, TrainConfig]:
    """The scheme's rule on ``workers`` workers, and ``config`` with the rate and the momentum
    it applies."""
    scaling = LrScaling.resolve(
        config, scheme.lr_rule, workers, asynchronous=scheme.implicit_momentum
    )
    return scaling, config.replace(lr=scaling.effective_lr, momentum=scaling.effective_momentum)
