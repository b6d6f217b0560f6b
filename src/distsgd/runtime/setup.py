"""Setting a worker up (:func:`open_worker`): where it trains, whether its settings hold,
what it connects to (:func:`connect`), where a resumed or restarted worker starts, and the
scheme started on it.

:meth:`~distsgd.runtime.session.WorkerSession.open` calls :func:`open_worker`, which decides
once what the session then only uses (:class:`Opened`).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from distsgd.control.checkpoint.errors import CheckpointError
from distsgd.control.config import LrScaling, TrainConfig
from distsgd.control.faults import FaultInjector
from distsgd.control.folder import RunFiles
from distsgd.control.metrics import MetricsWriter
from distsgd.control.task import TaskEnv
from distsgd.runtime.checkpoint import Checkpointer, load_replica, load_worker_state
from distsgd.runtime.collective_connection import CollectiveConnection
from distsgd.runtime.connection import Connection
from distsgd.runtime.context import WorkerContext
from distsgd.runtime.ps_connection import PsConnection
from distsgd.runtime.scheme import WorkerScheme
from distsgd.runtime.stream import UNKNOWN_LENGTH, Batches, make_batches  # streaming
from distsgd.runtime.work import LeasedBatches
from distsgd.util.signals import setter

log = logging.getLogger(__name__)

UNBOUNDED = 1 << 62
"""The step count of a run whose end the loop decides (leased work units, or the user's own
loop over data of its own with no ``--steps``)."""


@dataclass(kw_only=True)
class Opened:
    """What :func:`open_worker` set up, at the step the worker starts at."""

    conn: Connection
    """What the worker is connected to."""
    ctx: WorkerContext
    """What its scheme sees of it."""
    batches: Batches | LeasedBatches | None
    """Its batches (its own shard, or leased work units), at the place it starts; None: the
    loop brings its own data."""
    steps: int
    """Its local steps in the run (:data:`UNBOUNDED`: the loop decides)."""
    module: nn.Module
    """What forward runs through: the model, or the scheme's wrapper of it."""
    faults: FaultInjector
    """The faults injected into it."""
    start_step: int = 0
    """The local step it starts at (a resumed or restarted worker's)."""
    samples: int = 0
    """The samples it trained on before (a resumed worker's)."""


def open_worker(
    *,
    env: TaskEnv,
    config: TrainConfig,
    scheme: WorkerScheme,
    model: nn.Module,
    train_set: Dataset[Any] | None,
    optimizer: torch.optim.Optimizer | None,
    stop: threading.Event | None,
    metrics: MetricsWriter,
    lr_scaling: LrScaling,
    files: RunFiles | None = None,
) -> Opened:
    """Put ``model`` on its device, check the settings, connect (the chief registers), join,
    resume (``env.resume``), start ``scheme`` and continue past the steps a restarted worker
    pushed before. On an error the connection is closed again.

    Raises:
        ValueError: settings or data this run cannot honour.
    """
    rank = env.task_index
    device = resolve_device(config.device, next(model.parameters()).device, rank)
    model.to(device)
    leased = leases_work(config, scheme, train_set)
    own = None if train_set is None else _own_batches(train_set, env, config, leased)
    check_setup(env, config, scheme, own_data=train_set is None)
    total = run_steps(config, own)
    scheme.check_steps(total)  # every worker alike, before any joins the others
    conn = connect(
        env=env,
        config=config,
        scheme=scheme,
        model=model,
        device=device,
        work=train_set if leased else None,
        stop=stop,
    )
    try:
        ctx = WorkerContext(
            model=model,
            config=config,
            rank=rank,
            num_workers=env.num_workers,
            device=device,
            ps=conn.ps,
            collective=conn.collective,
        )
        if optimizer is not None:
            ctx.adopt_optimizer(optimizer)
        opened = Opened(
            conn=conn,
            ctx=ctx,
            batches=own if conn.leased is None else conn.leased,
            steps=total,
            module=model,
            faults=FaultInjector([]),
        )
        conn.join(ctx, metrics)
        if rank == 0:
            log.info("%s", lr_scaling.describe())
        steps = describe_steps(opened.steps, config.batch_size, opened.batches)
        log.info("worker%d: scheme %s, %s", rank, env.scheme, steps)
        opened.faults = ctx.faults = FaultInjector(env.faults, files=files)
        _start_scheme(opened, env, scheme, optimizer, metrics)
    except BaseException:
        conn.close()
        raise
    return opened


def _own_batches(
    train_set: Dataset[Any], env: TaskEnv, config: TrainConfig, leased: bool
) -> Batches | None:
    """This worker's own shard of the training set (None when it leases its batches)."""
    rank, world = env.task_index, env.num_workers
    if rank >= world:  # a worker joined past the registered ones: the cluster's number
        world = env.spec.num_workers
    # streaming: a stream, loader workers or a shard folder (runtime/stream.py)
    return make_batches(train_set, rank=rank, world=world, config=config, leased=leased)


def _start_scheme(
    opened: Opened,
    env: TaskEnv,
    scheme: WorkerScheme,
    optimizer: torch.optim.Optimizer | None,
    metrics: MetricsWriter,
) -> None:
    """Resume from ``env.resume``, start ``scheme``, let it wrap the model, and continue past
    the steps a restarted worker pushed before."""
    ctx = opened.ctx
    resumed = load_resume(env)
    if resumed is not None:
        opened.start_step = ctx.local_step = resume_at(resumed, env, opened.steps, opened.batches)
        ctx.global_step = int(resumed["global_step"])
        opened.samples = int(resumed.get("samples", opened.start_step * ctx.config.batch_size))
    scheme.start(ctx)
    if optimizer is not None and not ctx.adopted_optimizer_taken:
        raise ValueError(
            f"optimizer= under {env.scheme}: its parameter servers apply every update "
            "(with --lr and --momentum there); drop optimizer=, or use a scheme that steps "
            "a local optimizer (allreduce, downpour, easgd, localsgd, diloco)"
        )
    if resumed is not None:
        load_replica(ctx.model, resumed, ctx.params)
        scheme.load_state_dict(resumed["scheme"])
        log.info(
            "worker%d: resumed from %s at local step %d", ctx.rank, env.resume, opened.start_step
        )
        metrics.log(
            step=ctx.global_step, local_step=opened.start_step, event="resumed", file=env.resume
        )
    opened.module = scheme.wrap_model(ctx, ctx.model)  # e.g. DDP around it; same parameters
    _continue_at(opened, opened.conn.continue_at(env), metrics)


def _continue_at(opened: Opened, step: int, metrics: MetricsWriter) -> None:
    """Restarted after a fault: the steps from its saved state up to ``step``, where it died,
    were pushed already (the servers hold their updates), so it goes on from there."""
    if step <= opened.start_step:
        return
    ctx, batches = opened.ctx, opened.batches
    skipped = min(step, opened.steps) - opened.start_step
    opened.start_step = ctx.local_step = opened.start_step + skipped
    opened.samples += skipped * ctx.config.batch_size
    if batches is not None:  # leased: nothing to seek
        batches.seek(divmod(opened.start_step, batches.steps_per_epoch))
    log.info(
        "worker%d: continues at local step %d (%d steps pushed before)",
        ctx.rank,
        opened.start_step,
        skipped,
    )
    metrics.log(
        step=ctx.global_step, local_step=opened.start_step, event="continued", skipped=skipped
    )


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


def stop_on_sigterm(stop: threading.Event) -> Callable[[], None] | None:
    """In the main thread: SIGTERM sets ``stop``; returns what restores the old handler (None
    elsewhere: signals reach the main thread only)."""
    return stop_on(signal.SIGTERM, stop, "SIGTERM: leaving the run after this step")


def stop_on(
    signum: signal.Signals,
    stop: threading.Event,
    said: str,
    before: Callable[[], None] | None = None,
    *,
    once: bool = False,
) -> Callable[[], None] | None:
    """In the main thread: ``signum`` logs ``said``, calls ``before`` and sets ``stop``
    (``once``: the first time; the next is handled as before, e.g. a second Ctrl-C
    interrupts); returns what restores the old handler (None elsewhere: signals reach the
    main thread only). SIGINT so is how the launcher asks its workers to stop and save."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def noted() -> None:
        if once:
            signal.signal(signum, previous)
        log.info("%s", said)
        if before is not None:
            before()

    previous = signal.signal(signum, setter(stop, before=noted))

    def restore() -> None:
        signal.signal(signum, previous)

    return restore


def leases_work(config: TrainConfig, scheme: WorkerScheme, train_set: Dataset[Any] | None) -> bool:
    """Whether the worker leases its batches from shard 0's work queue (runtime/work.py): an
    elastic run counted in epochs does; --steps counts each worker's steps, so such a run
    shards as before, and a loop over its own data has no units to lease."""
    return (
        config.world_size == "dynamic"
        and scheme.uses_parameter_servers
        and config.steps == 0
        and train_set is not None
    )


def check_setup(env: TaskEnv, config: TrainConfig, scheme: WorkerScheme, *, own_data: bool) -> None:
    """Settings this run cannot honour: ValueError. ``own_data``: the loop brings its data
    (no ``train_data``)."""
    scheme.check_config(config)
    if config.world_size == "dynamic" and not scheme.uses_parameter_servers:
        raise ValueError(
            f"--world-size dynamic under {env.scheme}: only parameter-server schemes follow "
            "the live membership yet; use --world-size fixed"
        )
    if own_data and not config.steps and (config.lr_schedule != "constant" or config.warmup):
        raise ValueError(
            f"--lr-schedule {config.lr_schedule} / --warmup {config.warmup} need the run's "
            "length: give steps= (--steps), or train_data= so distsgd counts the epochs"
        )


def connect(
    *,
    env: TaskEnv,
    config: TrainConfig,
    scheme: WorkerScheme,
    model: nn.Module,
    device: torch.device,
    work: Dataset[Any] | None,
    stop: threading.Event | None,
) -> Connection:
    """This worker's connection to the run: the parameter servers (a parameter-server
    scheme; ``work``: the training set whose batches it leases), the other workers' process
    group (a collective scheme on two or more workers), or nothing (one worker alone)."""
    if scheme.uses_parameter_servers:
        return PsConnection.open(
            env=env, config=config, scheme=scheme, model=model, work=work, stop=stop
        )
    if env.num_workers > 1:
        return CollectiveConnection.open(env, device)
    return Connection()


def run_steps(config: TrainConfig, own: Batches | None) -> int:
    """This worker's local steps in the run: ``--steps``, else the epochs of its own
    batches; :data:`UNBOUNDED` when the loop decides (leased work, data of its own)."""
    if config.steps:
        return config.steps
    if own is not None:  # streaming
        return max(1, math.ceil(config.epochs * own.steps_per_epoch))
    return UNBOUNDED


def describe_steps(steps: int, batch_size: int, batches: Batches | LeasedBatches | None) -> str:
    """The start-up log's account of this worker's steps."""
    count = (
        "leased"
        if isinstance(batches, LeasedBatches)
        else ("the loop's" if steps == UNBOUNDED else str(steps))
    )
    per_epoch = (
        ""
        if batches is None or batches.steps_per_epoch == UNKNOWN_LENGTH
        else f" ({batches.steps_per_epoch} per epoch)"
    )
    return f"{count} steps of batch {batch_size}{per_epoch}"


def load_resume(env: TaskEnv) -> dict[str, Any] | None:
    """The worker state ``env.resume`` names, checked to be this task's (None: a fresh
    start); CheckpointError when it was saved for another worker or scheme."""
    if not env.resume:
        return None
    state = load_worker_state(Path(env.resume))
    checks = () if env.reshard else (("worker", env.task_index),)
    for key, want in (*checks, ("scheme_name", env.scheme)):
        if state.get(key) != want:
            raise CheckpointError(
                f"{env.resume}: saved for {key} {state.get(key)!r}, this task is "
                f"{want!r}; resume each worker from its own state"
            )
    return state


def resume_at(
    state: Mapping[str, Any], env: TaskEnv, steps: int, batches: Batches | LeasedBatches | None
) -> int:
    """The local step a worker resumed from ``state`` starts at, with ``batches`` moved to
    its place: at another world size (``env.reshard``) the same fraction of the run, the data
    resharded; else where the state left off."""
    start, saved_steps = int(state["local_step"]), int(state["steps"])
    if env.reshard and steps != UNBOUNDED and saved_steps != UNBOUNDED:
        start = min(steps, round(start * steps / max(1, saved_steps)))
        if batches is not None:
            batches.seek(divmod(start, batches.steps_per_epoch))
    elif batches is not None and state.get("position") is not None:
        batches.seek(state["position"])
    return start


def checkpointer(env: TaskEnv, run_dir: Path | None, scheme: WorkerScheme) -> Checkpointer | None:
    """What saves this worker's state (and, on the chief, the servers') on the run's
    checkpoint schedule; None without a run folder or a schedule."""
    if run_dir is None or not (env.checkpoint_every or env.checkpoint_seconds):
        return None
    scheme.state_dict()  # a state that cannot be saved fails now, not at a checkpoint
    return Checkpointer(
        run_dir=run_dir,
        rank=env.task_index,
        num_workers=env.num_workers,
        every_steps=env.checkpoint_every,
        every_seconds=env.checkpoint_seconds,
        wait=env.wait_timeout,
    )
