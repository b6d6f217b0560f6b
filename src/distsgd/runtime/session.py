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

Schemes never see sockets, files or the data loader.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import logging
import math
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from distsgd.control.checkpoint.errors import CheckpointError
from distsgd.control.checkpoint.store import SHARDS_PREFIX, prune_shard_dirs
from distsgd.control.config import LrScaling, TrainConfig, lr_factor
from distsgd.control.divergence import (
    MOVEMENT_SAMPLE,
    STALL_MOVEMENT,
    Diverged,
    DivergenceMonitor,
    accuracy_verdict,
    relative_movement,
    stalled_verdict,
)
from distsgd.control.errors import SetupError
from distsgd.control.faults import FaultInjector
from distsgd.control.folder import FINAL_PARAMS_FILE, METRICS_FILE, RESULT_FILE
from distsgd.control.metrics import MetricsWriter
from distsgd.control.progress import AloneProgress
from distsgd.control.task import TaskEnv
from distsgd.ps.client import Heartbeat, ParameterClient
from distsgd.ps.partition import PartitionPlan
from distsgd.ps.rules import WORLD_SIZE_OPTION
from distsgd.runtime.callbacks import Callback, StepInfo, check_user_values
from distsgd.runtime.checkpoint import Checkpointer, load_worker_state
from distsgd.runtime.collective import Collective
from distsgd.runtime.context import WorkerContext
from distsgd.runtime.data import BatchFn
from distsgd.runtime.evaluate import LossFn, MetricFns, evaluate
from distsgd.runtime.modules import as_torch_module, exchanged_parameters, load_eval_state
from distsgd.runtime.scheme import WorkerScheme
from distsgd.runtime.stream import UNKNOWN_LENGTH, Batches, make_batches  # streaming
from distsgd.runtime.work import LeasedBatches, wait_members_gone, work_spec
from distsgd.transport.security import TlsConfig, load_secret
from distsgd.util import write_atomic, write_bytes_atomic
from distsgd.util.signals import setter

log = logging.getLogger(__name__)

UNBOUNDED = 1 << 62
"""The step count of a run whose end the loop decides (leased work units, or the user's own
loop over data of its own with no ``--steps``)."""


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """What one worker's run produced (evaluation fields on the chief only)."""

    scheme: str
    worker: int
    local_steps: int
    global_step: int
    seconds: float
    samples: int
    bytes_sent: int
    test_loss: float | None = None
    test_accuracy: float | None = None
    diverged: bool = False
    """True when training diverged (see :mod:`distsgd.control.divergence`)."""
    divergence: str | None = None
    """Why it counts as diverged, or None."""
    stalled: bool = False
    """(Chief) True when the run ended at chance while its parameters barely moved: it did not
    diverge but did not learn (steps too small or too few); ``diverged`` is True too (a failed
    run)."""
    time_split: dict[str, float] = dataclasses.field(default_factory=dict)
    """This worker's seconds per phase (see :mod:`distsgd.control.timing`): compute, pull, ..."""
    work: dict[str, Any] | None = None
    """(Chief of a run with work units) per epoch, the units trained once, twice, never."""
    left: bool = False
    """True when the worker was asked to stop (SIGTERM, ``stop``) and left the run early."""
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    """(Chief) the final evaluation's values of the ``metrics=`` functions given to train."""


def _wait_all_finished(
    ps: ParameterClient,
    num_workers: int,
    timeout: float,
    save: Callable[[int], None] | None = None,
    every_versions: int = 0,
    every_seconds: float = 0.0,
) -> None:
    """(Chief, after its last step) wait until every worker has left the servers.

    Fails only when nothing moves for ``timeout`` seconds (no push, no leave): a slow worker is
    waited for as long as it makes progress. A server that restarted meanwhile has forgotten
    that this worker left, so it is told again. While it waits the chief keeps the servers'
    checkpoints going (``save(version)``): whenever a worker leaves, and every
    ``every_versions`` updates or ``every_seconds`` seconds, so a server that dies now loses
    no more than it would have mid-run.
    """
    infos = ps.info()
    incarnations = [info.server_incarnation for info in infos]
    last_state: tuple[int, int] | None = None
    last_change = saved_at = time.monotonic()
    saved_version = sum(info.version for info in infos)
    saved_finished = sum(info.finished_workers for info in infos)
    while True:
        infos = ps.info()
        now = time.monotonic()
        if [info.server_incarnation for info in infos] != incarnations:
            log.info("a parameter server restarted; telling it again that this worker left")
            ps.leave()
            infos = ps.info()
            incarnations = [info.server_incarnation for info in infos]
        if all(info.finished_workers >= num_workers for info in infos):
            return
        version = sum(info.version for info in infos)
        finished = sum(info.finished_workers for info in infos)
        if (version, finished) != last_state:
            last_state, last_change = (version, finished), now
        if save is not None and (
            finished != saved_finished
            or (every_versions and version - saved_version >= every_versions)
            or (every_seconds and now - saved_at >= every_seconds and version != saved_version)
        ):
            save(version)
            saved_version, saved_finished, saved_at = version, finished, now
        if now - last_change > timeout:
            done = min(info.finished_workers for info in infos)
            raise TimeoutError(
                f"only {done} of {num_workers} workers finished, and nothing moved for "
                f"{timeout:.0f}s; see the other workers' logs"
            )
        time.sleep(0.05)


def resolve_device(text: str, current: torch.device, rank: int = 0) -> torch.device:
    """Where a worker trains, from ``TrainConfig.device``: '' the model's ``current`` device,
    auto a GPU when this process sees one (the first it sees: the launcher gives each worker its
    own through ``CUDA_VISIBLE_DEVICES``), else the CPU; cuda (:N) must exist."""
    if not text:
        return current
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(text)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = device.index or 0
        if index >= count:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            seen = f"{count} GPU(s)" + (f", CUDA_VISIBLE_DEVICES={visible!r}" if visible else "")
            raise ValueError(
                f"--device {text}: worker{rank} sees {seen}; use --device auto (a GPU where "
                "there is one) or cpu"
            )
    return device


class WorkerSession:
    """One worker's part of a run, driven step by step (see the module docstring).

    ``train_set`` None: the loop brings its own data (:meth:`batches` is then unavailable);
    the run lasts ``config.steps`` local steps when given, else until the loop calls
    :meth:`finish`. ``stop`` (``--world-size dynamic``): once set, :attr:`done` turns true and
    :meth:`batches` ends; the loop's :meth:`finish` then pushes what the scheme holds, reports
    the work units and leaves (``TrainResult.left``). In the main thread of an elastic run
    SIGTERM sets it (the launcher shrinks a run so).
    """

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
    ) -> None:
        if test_set is not None and loss_fn is None:
            raise ValueError("test_data needs loss_fn= to evaluate with; pass both or neither")
        # a Keras 3 model: wrapped (runtime/keras_models.py); any other as it is
        self.model = model = as_torch_module(model)
        self.loss_fn = loss_fn
        self.train_set = train_set
        self.test_set = test_set
        self.given_config = config
        """The config as the script and the command line gave it (``result.json``'s)."""
        self.lr_scaling = LrScaling.resolve(config, scheme.lr_rule, env.num_workers)
        self.config = config.replace(lr=self.lr_scaling.effective_lr)
        """What the run applies: ``lr`` is the scheme's rate on this many workers."""
        self.env = env
        self.scheme = scheme
        self.batch_fn = batch_fn
        self.callbacks = tuple(callbacks)
        self.metric_fns = dict(metric_fns or {})
        self.optimizer = optimizer
        self.rank = env.task_index
        self.chief = self.rank == 0
        self.name = f"worker{self.rank}"
        self.dynamic = config.world_size == "dynamic"
        self.stop = stop if stop is not None or not self.dynamic else threading.Event()
        self.run_dir = Path(env.run_dir) if env.run_dir else None
        self.metrics = MetricsWriter(
            self.run_dir / METRICS_FILE if self.run_dir else None, self.name
        )
        self.module: nn.Module = model
        """What forward runs through: the model, or the scheme's wrapper of it (allreduce:
        ``DistributedDataParallel``), training the same parameters."""
        self.steps = UNBOUNDED
        """This worker's local steps in the run (:data:`UNBOUNDED`: the loop decides)."""
        self.left = False
        self.loss_value = float("nan")
        self.samples = 0
        self._restore_sigterm: Callable[[], None] | None = None
        self._ps: ParameterClient | None = None
        self._heartbeat: Heartbeat | None = None
        self._collective: Collective | None = None
        self._batches: Batches | LeasedBatches | None = None  # streaming: Batches
        self._ckpt: Checkpointer | None = None
        self._eval_model: nn.Module | None = None
        self._prepared = False
        self._in_step = False
        self._forwards = 0
        self._forwards_at_begin = 0
        self._opened = False
        self._finished = False
        self._alone = AloneProgress() if env.standalone_run else None

    # -- start ----------------------------------------------------------------------------------
    @property
    def ctx(self) -> WorkerContext:
        return self._ctx

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
        try:
            self._open()
        except SetupError:
            raise
        except ValueError as exc:
            raise SetupError(str(exc)) from exc

    def _open(self) -> None:
        env = self.env = self.env.with_ps_addresses(self.env.startup_timeout)
        config, scheme, model, rank = self.config, self.scheme, self.model, self.rank
        spec, world = env.spec, env.num_workers
        if self.dynamic and self.stop is not None:
            self._restore_sigterm = _stop_on_sigterm(self.stop)
        device = resolve_device(config.device, next(model.parameters()).device, rank)
        model.to(device)
        # Work units: an elastic run counted in epochs leases its batches from shard 0's queue
        # (see runtime/work.py); --steps counts each worker's steps, so such a run shards as
        # before. A loop over its own data has no units to lease.
        leased = (
            self.dynamic
            and scheme.uses_parameter_servers
            and config.steps == 0
            and self.train_set is not None
        )
        if self.train_set is not None:
            # streaming: a stream, loader workers or a shard folder (runtime/stream.py); None
            # when leased (built once registered)
            self._batches = make_batches(
                self.train_set,  # a worker joined past the registered ones: the
                rank=rank,  # cluster's number of workers
                world=world if rank < world else spec.num_workers,
                config=config,
                leased=leased,
            )
        scheme.check_config(config)
        if self.dynamic and not scheme.uses_parameter_servers:
            raise ValueError(
                f"--world-size dynamic under {env.scheme}: only parameter-server schemes follow "
                "the live membership yet; use --world-size fixed"
            )
        if (
            self.train_set is None
            and not config.steps
            and (config.lr_schedule != "constant" or config.warmup)
        ):
            raise ValueError(
                f"--lr-schedule {config.lr_schedule} / --warmup {config.warmup} need the run's "
                "length: give steps= (--steps), or train_data= so distsgd counts the epochs"
            )
        ps = collective = None
        if scheme.uses_parameter_servers:
            if spec.num_ps == 0:
                raise ValueError(
                    f"scheme {env.scheme!r} needs parameter servers; run with --ps 1 or more"
                )
            arrays = {n: p.detach().cpu().numpy() for n, p in exchanged_parameters(model).items()}
            plan = PartitionPlan.from_arrays(arrays, spec.num_ps)
            ps = self._ps = ParameterClient(
                list(spec.ps),
                plan,
                worker=rank,
                incarnation=secrets.randbits(63),
                run_id=env.run_id,
                timeout=env.rpc_timeout,
                retry_seconds=env.wait_timeout,
                secret=load_secret(),
                shared_memory=config.shared_memory == "auto",
                tensor_socket=config.tensor_socket == "auto",
                wire_dtype=config.wire_dtype,
                topk=config.topk,
                tls=TlsConfig(cert=Path(env.tls[0]), key=Path(env.tls[1]), ca=Path(env.tls[2]))
                if env.tls
                else None,
            )
            if self.chief:
                ps.register(
                    arrays,
                    scheme=env.scheme,
                    options=_server_options(scheme, config),
                    num_workers=world,
                    work=work_spec(
                        len(self.train_set),  # type: ignore[arg-type]
                        batch_size=config.batch_size,
                        epochs=config.epochs,
                        seed=config.seed,
                    )
                    if leased and self.train_set is not None
                    else None,
                )
                log.info(
                    "registered %d parameters on %d ps (bytes per shard: %s)",
                    len(arrays),
                    spec.num_ps,
                    plan.shard_bytes,
                )
            ps.wait_registered(env.startup_timeout)
            if leased:
                assert self.train_set is not None
                self._batches = LeasedBatches(
                    self.train_set,
                    ps=ps,
                    batch_size=config.batch_size,
                    seed=config.seed,
                    stop=self.stop,
                )
        elif world > 1:
            rendezvous = env.rendezvous or spec.worker[0]
            collective = self._collective = Collective(
                rendezvous=rendezvous,
                rank=rank,
                world_size=world,
                host_store=self.chief and not env.rendezvous,
                timeout=env.startup_timeout,
                device=device,
                run_id=env.run_id,
                address=spec.worker[rank],
            )
        ctx = self._ctx = WorkerContext(
            model=model,
            config=config,
            rank=rank,
            num_workers=world,
            device=device,
            ps=ps,
            collective=collective,
        )
        if self.optimizer is not None:
            ctx.adopt_optimizer(self.optimizer)
        batches = self._batches
        if config.steps:
            self.steps = config.steps
        elif batches is not None and not isinstance(batches, LeasedBatches):  # streaming
            self.steps = max(1, math.ceil(config.epochs * batches.steps_per_epoch))
        if ps is not None:
            self._heartbeat = _join(ps, self.metrics, ctx)
        if self.chief:
            log.info("%s", self.lr_scaling.describe())
        log.info(
            "%s: scheme %s, %s steps of batch %d%s",
            self.name,
            env.scheme,
            "leased"
            if isinstance(batches, LeasedBatches)
            else ("the loop's" if self.steps == UNBOUNDED else self.steps),
            config.batch_size,
            ""
            if batches is None or batches.steps_per_epoch == UNKNOWN_LENGTH
            else f" ({batches.steps_per_epoch} per epoch)",
        )
        self.faults = FaultInjector(env.faults)
        ctx.faults = self.faults
        self.start_step = 0
        resumed = load_worker_state(Path(env.resume)) if env.resume else None
        if resumed is not None:
            checks = () if env.reshard else (("worker", rank),)
            for key, want in (*checks, ("scheme_name", env.scheme)):
                if resumed.get(key) != want:
                    raise CheckpointError(
                        f"{env.resume}: saved for {key} {resumed.get(key)!r}, this task is "
                        f"{want!r}; resume each worker from its own state"
                    )
            self.start_step = int(resumed["local_step"])
            saved_steps = int(resumed["steps"])
            if env.reshard and self.steps != UNBOUNDED and saved_steps != UNBOUNDED:
                # another world size: the same fraction of the run, resharded
                self.start_step = min(
                    self.steps, round(self.start_step * self.steps / max(1, saved_steps))
                )
                if batches is not None:
                    batches.seek(divmod(self.start_step, batches.steps_per_epoch))
            elif batches is not None and resumed.get("position") is not None:
                batches.seek(resumed["position"])
            ctx.local_step = self.start_step
            ctx.global_step = int(resumed["global_step"])
            self.samples = int(resumed.get("samples", self.start_step * config.batch_size))
        scheme.start(ctx)
        if self.optimizer is not None and not ctx.adopted_optimizer_taken:
            raise ValueError(
                f"optimizer= under {env.scheme}: its parameter servers apply every update "
                "(with --lr and --momentum there); drop optimizer=, or use a scheme that steps "
                "a local optimizer (allreduce, downpour, easgd, localsgd, diloco)"
            )
        if resumed is not None:
            model.load_state_dict(resumed["model"])
            scheme.load_state_dict(resumed["scheme"])
            log.info("%s: resumed from %s at local step %d", self.name, env.resume, self.start_step)
            self.metrics.log(
                step=ctx.global_step, local_step=self.start_step, event="resumed", file=env.resume
            )
        self.module = scheme.wrap_model(ctx, model)  # e.g. DDP around it; same parameters
        if self.module is not model:
            self.module.register_forward_pre_hook(self._count_forward)
        if scheme.uses_parameter_servers and env.continue_at > self.start_step:
            # Restarted after a fault: the steps from its saved state up to where it died were
            # pushed already (the servers hold their updates), so it goes on from there.
            skipped = min(env.continue_at, self.steps) - self.start_step
            self.start_step = ctx.local_step = self.start_step + skipped
            self.samples += skipped * config.batch_size
            if batches is not None:  # leased: nothing to seek
                batches.seek(divmod(self.start_step, batches.steps_per_epoch))
            log.info(
                "%s: continues at local step %d (%d steps pushed before)",
                self.name,
                self.start_step,
                skipped,
            )
            self.metrics.log(
                step=ctx.global_step,
                local_step=self.start_step,
                event="continued",
                skipped=skipped,
            )
        if self.run_dir is not None and (env.checkpoint_every or env.checkpoint_seconds):
            scheme.state_dict()  # a state that cannot be saved fails now, not at a checkpoint
            self._ckpt = Checkpointer(
                run_dir=self.run_dir,
                rank=rank,
                num_workers=world,
                every_steps=env.checkpoint_every,
                every_seconds=env.checkpoint_seconds,
                wait=env.wait_timeout,
            )
        self.watch = DivergenceMonitor(self.name, from_start=self.start_step == 0)
        # where training started (the chief's, from step 0): a run at chance that barely
        # moved from here stalled rather than diverged
        self._start_point = (
            _parameter_sample(model) if self.chief and self.start_step == 0 else None
        )
        if self.chief and self.test_set is not None and config.eval_every:
            self._eval_model = copy.deepcopy(model)
        self.started = time.monotonic()
        ctx.clock.start_loop()
        model.train()

    def _count_forward(self, module: nn.Module, args: Any) -> None:
        self._forwards += 1

    def worker_state(self) -> dict[str, Any]:
        """What a checkpoint saves of this worker (read back by ``load_worker_state``)."""
        ctx = self._ctx
        return {
            "worker": self.rank,
            "local_step": ctx.local_step,
            "global_step": ctx.global_step,
            "position": None if self._batches is None else self._batches.position,
            "samples": self.samples,
            "model": self.model.state_dict(),
            "scheme": self.scheme.state_dict(),
            "scheme_name": self.env.scheme,
            "steps": self.steps,
        }

    # -- steps ----------------------------------------------------------------------------------
    def progress(self) -> tuple[int, int] | None:
        """(done, total) of the run for the lr schedule and the progress line; None when the
        loop decides the end."""
        if isinstance(self._batches, LeasedBatches):
            return self._batches.progress
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
        progress = self.progress()
        if progress is not None:
            done, total = progress
            ctx.set_lr_scale(lr_factor(self.config.lr_schedule, done, total, self.config.warmup))
        if isinstance(self._batches, LeasedBatches):
            self._batches.settle(ctx.push_outcomes)
        self._prepared = True

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
            raw = next(source, None)
            if raw is None:  # leased: the queue has no more work for this worker
                self.left = self.stop is not None and self.stop.is_set()
                self._prepared = False
                return
            yield raw
        self.left = self.stop is not None and self.stop.is_set()

    def begin_step(self) -> None:
        """Just before forward: the scheme's ``before_step`` (e.g. pull fresh parameters), the
        servers' checkpoint (chief), and zeroed gradients."""
        assert self._opened and not self._finished, "begin_step outside an open session"
        if self._in_step:
            raise RuntimeError("step() inside a step: end the previous step first")
        if not self._prepared:
            self._prepare()
        ctx = self._ctx
        self.scheme.before_step(ctx)
        if self._ckpt is not None and self.chief:
            with ctx.clock.measure("checkpoint"):
                self._ckpt.maybe_checkpoint_servers(
                    None if self._ps is None else self._ps.checkpoint,
                    {"scheme": self.env.scheme, "steps": self.steps},
                )
        # zeroed, not set to None: some schemes keep gradients in place in shared memory
        self.model.zero_grad(set_to_none=False)
        self._forwards_at_begin = self._forwards
        self._in_step = True

    def explain(self, exc: RuntimeError) -> RuntimeError | None:
        """The error forward or backward raised, with the scheme's hint added (None: none)."""
        hint = self.scheme.explain(exc)
        return None if hint is None else RuntimeError(f"{exc}; {hint}")

    def abandon_step(self) -> None:
        """Forward or backward failed: the step did not happen."""
        self._in_step = self._prepared = False

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
        if isinstance(self._batches, LeasedBatches):
            self._batches.trained(ctx.pushes_started)  # its update is in the pushes begun after
        if loss is not None:
            self.loss_value = (
                float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
            )
            self.watch.observe(self.loss_value, ctx.local_step)
        self.scheme.after_backward(ctx)
        ctx.local_step += 1
        self.samples += config.batch_size if samples is None else int(samples)
        if not self.scheme.uses_parameter_servers:
            ctx.global_step = ctx.local_step
        if ctx.local_step % config.log_every == 0 or ctx.local_step == self.steps:
            self._log_step()
        scores = None
        if self._eval_model is not None and ctx.local_step % config.eval_every == 0:
            with ctx.clock.measure("eval"):
                _load_eval_params(ctx, self.scheme, self._eval_model)
                scores = self._evaluate(self._eval_model)
            self._log_scores(scores)
        for callback in self.callbacks:
            if callback.every_steps and ctx.local_step % callback.every_steps == 0:
                callback.on_step(self._info())
            if scores is not None:
                callback.on_evaluate(self._info(), scores)

    def _log_step(self) -> None:
        ctx = self._ctx
        progress = self.progress()
        batches = self._batches
        if self._alone is not None:
            self._alone.update(
                step=ctx.local_step,
                fraction=None if progress is None else progress[0] / max(1, progress[1]),
                loss=self.loss_value if math.isfinite(self.loss_value) else None,
                samples=self.samples,
                last=ctx.local_step == self.steps,
            )
        self.metrics.log(
            step=ctx.global_step,
            local_step=ctx.local_step,
            **(
                {"progress": round(min(1.0, progress[0] / max(1, progress[1])), 4)}
                if progress is not None
                else {}
            ),
            **({"loss": round(self.loss_value, 6)} if math.isfinite(self.loss_value) else {}),
            samples=self.samples,
            **({"epoch": batches.epoch} if batches is not None else {}),
            bytes_sent=ctx.bytes_sent,
            lost_pushes=ctx.lost_pushes,
            nonfinite_skipped=ctx.nonfinite_skipped,
            **({"mean_staleness": round(ctx.mean_staleness, 4)} if self._ps is not None else {}),
            **self.scheme.stats(),
            **ctx.clock.metrics(),
        )

    def _evaluate(self, model: nn.Module) -> dict[str, float]:
        assert self.test_set is not None and self.loss_fn is not None
        return evaluate(
            model,
            self.test_set,
            self.loss_fn,
            batch_size=self.config.eval_batch_size,
            device=self._ctx.device,
            batch_fn=self.batch_fn,
            metric_fns=self.metric_fns,
        )

    def _log_scores(self, scores: Mapping[str, float], **extra: Any) -> None:
        user = {k: scores[k] for k in self.metric_fns if k in scores}
        self.metrics.log(
            step=self._ctx.global_step,
            local_step=self._ctx.local_step,
            test_loss=scores["loss"],
            accuracy=scores.get("accuracy"),
            **({"user": user} if user else {}),
            **extra,
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
        ctx, env, rank, ps = self._ctx, self.env, self.rank, self._ps
        batches, ckpt = self._batches, self._ckpt
        self.left = self.left or (self.stop is not None and self.stop.is_set())
        self.scheme.finish(ctx)
        ctx.clock.stop_loop()
        seconds = time.monotonic() - self.started
        work_status = (
            batches.report(ctx.push_outcomes) if isinstance(batches, LeasedBatches) else None
        )
        if ckpt is not None:
            ckpt.save_worker(self.worker_state(), ctx.local_step)
        if self._heartbeat is not None:
            self._heartbeat.stop()  # before the leave: a heartbeat after it would join again
        if ps is not None:
            ps.leave()  # before waiting on checkpoints: a sync step may wait for this leave
        if self.left:
            log.info("%s: asked to stop; left the run after %d steps", self.name, ctx.local_step)
            self.metrics.log(step=ctx.global_step, local_step=ctx.local_step, event="left")
        self.metrics.log(
            step=ctx.global_step,
            local_step=ctx.local_step,
            event="finished_steps",
            seconds=round(seconds, 3),
            checkpoints=0 if ckpt is None else ckpt.count,
            checkpoint_seconds=0.0 if ckpt is None else round(ckpt.seconds, 4),
            **(
                {
                    "shared_memory_shards": ps.shared_memory_shards,
                    "tensor_socket_shards": ps.tensor_socket_shards,
                }
                if ps is not None
                else {}
            ),
            **ctx.clock.metrics(),
        )
        if ps is not None and self.chief and isinstance(batches, LeasedBatches):
            work_status = wait_members_gone(ps, rank, env.wait_timeout)
        elif ps is not None and self.chief:
            _wait_all_finished(
                ps,
                env.num_workers,
                env.wait_timeout,
                save=None if ckpt is None else _shard_saver(ps, ckpt.root),
                every_versions=env.checkpoint_every,
                every_seconds=env.checkpoint_seconds or 10.0,
            )
        if ckpt is not None:
            ckpt.close()
        result = TrainResult(
            scheme=env.scheme,
            worker=rank,
            local_steps=ctx.local_step,
            global_step=ctx.global_step,
            seconds=seconds,
            samples=self.samples,
            bytes_sent=ctx.bytes_sent,
            time_split={k: round(v, 4) for k, v in ctx.clock.totals().items()},
            work=_work_counts(work_status) if self.chief and work_status is not None else None,
            left=self.left,
        )
        if result.work is not None:
            _log_work(result.work, self.metrics, ctx)
        verdict = self.watch.loss_verdict()
        if verdict is not None:
            log.warning("diverged: %s", verdict)
            self.metrics.log(step=ctx.global_step, event="diverged", reason=verdict)
            result = dataclasses.replace(result, diverged=True, divergence=verdict)
        if self.chief and not self.left:
            result = self._finish_chief(result)
        log.info("%s: done, %d steps in %.1fs", self.name, ctx.local_step, seconds)
        if self._collective is not None:
            self._collective.leave()  # every rank done; see Collective.leave for why not destroyed
        return result

    def _finish_chief(self, result: TrainResult) -> TrainResult:
        ctx, ps, model = self._ctx, self._ps, self.model
        if ps is not None and self.scheme.evaluate_on == "server":
            version, arrays = ps.pull(record=False)
            ctx.load(arrays)
            ctx.global_step = max(ctx.global_step, version)
            result = dataclasses.replace(result, global_step=ctx.global_step)
        if self.test_set is not None:
            scores = self._evaluate(model)
            result = dataclasses.replace(
                result,
                test_loss=scores["loss"],
                test_accuracy=scores.get("accuracy"),
                metrics={k: scores[k] for k in self.metric_fns if k in scores},
            )
            verdict = (
                f"the final test loss is {scores['loss']}"
                if not math.isfinite(scores["loss"])
                else accuracy_verdict(scores.get("accuracy"), scores.get("chance"))
            )
            if verdict is not None and not result.diverged:
                moved = (
                    relative_movement(self._start_point, _parameter_sample(model))
                    if self._start_point is not None and math.isfinite(scores["loss"])
                    else math.inf
                )
                stalled = moved < STALL_MOVEMENT
                if stalled:
                    verdict = stalled_verdict(verdict, moved)
                log.warning("diverged: %s", verdict)
                self.metrics.log(
                    step=ctx.global_step, event="diverged", reason=verdict, stalled=stalled
                )
                result = dataclasses.replace(
                    result, diverged=True, divergence=verdict, stalled=stalled
                )
            self._log_scores(scores, final=True)
            log.info("test loss %.4f, accuracy %s", scores["loss"], scores.get("accuracy"))
            for callback in self.callbacks:
                callback.on_evaluate(self._info(), scores)
        if self.run_dir is not None:
            buf = io.BytesIO()
            torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buf)
            write_bytes_atomic(self.run_dir / FINAL_PARAMS_FILE, buf.getvalue())
            write_atomic(
                self.run_dir / RESULT_FILE,
                json.dumps(
                    {
                        **_result_fields(result),
                        "config": self.given_config.to_dict(),
                        "lr_scaling": self.lr_scaling.to_dict(),
                    },
                    indent=2,
                )
                + "\n",
            )
        return result

    def failed(self, exc: BaseException) -> None:
        """The loop raised: a divergence is logged as such (the launcher reports it)."""
        if isinstance(exc, Diverged):
            self.metrics.log(event="diverged", reason=str(exc))

    def close(self) -> None:
        """Always, after finish or a failure: signal handler, heartbeat, sockets, files."""
        if self._restore_sigterm is not None:
            self._restore_sigterm()
            self._restore_sigterm = None
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._ps is not None:
            self._ps.close()
            self._ps = None
        if self._collective is not None:
            self._collective.close()
            self._collective = None
        self.metrics.close()


def _stop_on_sigterm(stop: threading.Event) -> Callable[[], None] | None:
    """In the main thread: SIGTERM sets ``stop``; returns what restores the old handler (None
    elsewhere: signals reach the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def said() -> None:
        log.info("SIGTERM: leaving the run after this step")

    previous = signal.signal(signal.SIGTERM, setter(stop, before=said))

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)

    return restore


def _work_counts(status: Any) -> dict[str, Any]:
    """result.json's ``work``: the queue's per-epoch counts and their totals."""
    return {
        "epochs": int(status.epochs),
        "units_per_epoch": int(status.units_per_epoch),
        "unit_size": int(status.unit_size),
        "samples": int(status.samples),
        "total_units": int(status.total_units),
        "units_done": int(status.units_done),
        "finished": bool(status.finished),
        "trained_once": sum(status.trained_once),
        "trained_twice": sum(status.trained_twice),
        "never_trained": sum(status.never_trained),
        "per_epoch": {
            "trained_once": list(status.trained_once),
            "trained_twice": list(status.trained_twice),
            "never_trained": list(status.never_trained),
        },
    }


def _parameter_sample(model: nn.Module) -> list[np.ndarray]:
    """Up to MOVEMENT_SAMPLE evenly strided elements of each exchanged parameter (float64)."""
    out = []
    for p in exchanged_parameters(model).values():
        flat = p.detach().reshape(-1)
        stride = max(1, flat.numel() // MOVEMENT_SAMPLE)
        out.append(flat[::stride][:MOVEMENT_SAMPLE].double().cpu().numpy().copy())
    return out


def _result_fields(result: TrainResult) -> dict[str, Any]:
    """result.json's fields: ``work`` and ``left`` only where they say something."""
    fields = asdict(result)
    if fields["work"] is None:
        del fields["work"]
    if not fields["left"]:
        del fields["left"]
    if not fields["metrics"]:
        del fields["metrics"]
    if not fields["stalled"]:
        del fields["stalled"]
    return fields


def _log_work(work: dict[str, Any], metrics: MetricsWriter, ctx: WorkerContext) -> None:
    log.info(
        "work units: %d epochs of %d units; trained once %d, twice or more %d, never %d",
        work["epochs"],
        work["units_per_epoch"],
        work["trained_once"],
        work["trained_twice"],
        work["never_trained"],
    )
    metrics.log(
        step=ctx.global_step,
        local_step=ctx.local_step,
        event="work",
        **{k: v for k, v in work.items() if k != "per_epoch"},
    )


def _server_options(scheme: WorkerScheme, config: TrainConfig) -> dict[str, Any]:
    """What the chief registers as the rule's options: the scheme's, and ``world_size`` when
    dynamic (a fixed run's options stay exactly as before)."""
    options = scheme.server_options(config)
    if config.world_size == "dynamic":
        options = {**options, WORLD_SIZE_OPTION: "dynamic"}
    return options


def _join(ps: ParameterClient, metrics: MetricsWriter, ctx: WorkerContext) -> Heartbeat:
    """Join every shard's membership, log it, and keep it with a :class:`Heartbeat` that logs
    a ``membership`` event (at the worker's step as last heard) whenever a shard's epoch
    changes."""
    joined = ps.join()

    def changed(shard: int, epoch: int, members: list[int]) -> None:
        log.info("ps%d: membership epoch %d, members %s", shard, epoch, members)
        metrics.log(
            step=ctx.global_step,
            local_step=ctx.local_step,
            event="membership",
            ps=shard,
            epoch=epoch,
            members=members,
        )

    for i, reply in enumerate(joined):
        changed(i, reply.epoch, list(reply.members))
    return Heartbeat(ps, joined, changed)


def _shard_saver(ps: ParameterClient, root: Path) -> Callable[[int], None]:
    """Saves every shard under ``shards-<version>`` (server state only, no manifest): what a
    restarted server restores from once the chief no longer steps. The newest two are kept."""

    def save(version: int) -> None:
        try:
            ps.checkpoint(f"{SHARDS_PREFIX}{version:012d}")
        except Exception as exc:  # a server down right now: the next change tries again
            log.warning("server checkpoint at version %d skipped: %s", version, exc)
            return
        prune_shard_dirs(root)

    return save


def _load_eval_params(ctx: WorkerContext, scheme: WorkerScheme, target: nn.Module) -> None:
    # the replica's whole state (its BatchNorm statistics), then the servers' weights over it
    server = ctx.ps.pull(record=False)[1] if scheme.evaluate_on == "server" else None
    load_eval_state(target, ctx.model, server)
