"""The one training loop every scheme runs in.

It shards the data, connects to the parameter servers or joins the process group, calls the
scheme's hooks around forward/backward, writes metrics, and on the chief evaluates and saves
the final parameters. Schemes never see sockets, files or the data loader.
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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from distsgd.ps.client import Heartbeat, ParameterClient
from distsgd.ps.partition import PartitionPlan
from distsgd.ps.rules import WORLD_SIZE_OPTION
from distsgd.runtime.checkpoint import (
    SHARDS_PREFIX,
    Checkpointer,
    CheckpointError,
    load_worker_state,
    prune_shard_dirs,
)
from distsgd.runtime.collective import Collective
from distsgd.runtime.config import TrainConfig, lr_factor
from distsgd.runtime.context import WorkerContext
from distsgd.runtime.data import BatchFn, ShardedBatches, split_batch
from distsgd.runtime.divergence import Diverged, DivergenceMonitor, accuracy_verdict
from distsgd.runtime.evaluate import LossFn, evaluate
from distsgd.runtime.faults import FaultInjector
from distsgd.runtime.metrics import MetricsWriter
from distsgd.runtime.run_folder import FINAL_PARAMS_FILE, METRICS_FILE, RESULT_FILE
from distsgd.runtime.scheme import WorkerScheme
from distsgd.runtime.task import TaskEnv
from distsgd.runtime.work import LeasedBatches, wait_members_gone, work_spec
from distsgd.transport.security import TlsConfig, load_secret
from distsgd.util import write_atomic, write_bytes_atomic

log = logging.getLogger(__name__)


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
    """True when training diverged (see :mod:`distsgd.runtime.divergence`)."""
    divergence: str | None = None
    """Why it counts as diverged, or None."""
    time_split: dict[str, float] = dataclasses.field(default_factory=dict)
    """This worker's seconds per phase (see :mod:`distsgd.runtime.timing`): compute, pull, ..."""
    work: dict[str, Any] | None = None
    """(Chief of a run with work units) per epoch, the units trained once, twice, never."""
    left: bool = False
    """True when the worker was asked to stop (SIGTERM, ``stop``) and left the run early."""


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


def run_worker(
    *,
    model: nn.Module,
    loss_fn: LossFn,
    train_set: Dataset[Any],
    test_set: Dataset[Any] | None,
    config: TrainConfig,
    env: TaskEnv,
    scheme: WorkerScheme,
    batch_fn: BatchFn | None = None,
    stop: threading.Event | None = None,
) -> TrainResult:
    """Train this worker's part of the run under ``scheme``; see the module docstring.

    ``stop`` (``--world-size dynamic``): once set, the worker finishes its step, pushes what
    its scheme holds, reports its work units, leaves and returns (``TrainResult.left``). In the
    main thread of an elastic run SIGTERM sets it (the launcher shrinks a run so)."""
    env = env.with_ps_addresses(env.startup_timeout)
    spec = env.spec
    rank, world = env.task_index, env.num_workers
    chief = rank == 0
    dynamic = config.world_size == "dynamic"
    if stop is None and dynamic:
        stop = threading.Event()
    restore_sigterm = _stop_on_sigterm(stop) if dynamic and stop is not None else None
    device = resolve_device(config.device, next(model.parameters()).device, rank)
    model.to(device)
    run_dir = Path(env.run_dir) if env.run_dir else None
    name = f"worker{rank}"
    # Work units: an elastic run counted in epochs leases its batches from shard 0's queue
    # (see runtime/work.py); --steps counts each worker's steps, so such a run shards as before.
    leased = dynamic and scheme.uses_parameter_servers and config.steps == 0
    batches: ShardedBatches | LeasedBatches | None = None
    if not leased:
        batches = ShardedBatches(  # a worker joined past the registered ones: the cluster's
            train_set,
            rank=rank,
            world=world if rank < world else spec.num_workers,
            batch_size=config.batch_size,
            seed=config.seed,
        )
    metrics = MetricsWriter(run_dir / METRICS_FILE if run_dir else None, name)
    ps: ParameterClient | None = None
    heartbeat: Heartbeat | None = None
    collective: Collective | None = None
    try:
        scheme.check_config(config)
        if config.world_size == "dynamic" and not scheme.uses_parameter_servers:
            raise ValueError(
                f"--world-size dynamic under {env.scheme}: only parameter-server schemes follow "
                "the live membership yet; use --world-size fixed"
            )
        if scheme.uses_parameter_servers:
            if spec.num_ps == 0:
                raise ValueError(
                    f"scheme {env.scheme!r} needs parameter servers; run with --ps 1 or more"
                )
            arrays = {n: p.detach().cpu().numpy() for n, p in model.named_parameters()}
            plan = PartitionPlan.from_arrays(arrays, spec.num_ps)
            ps = ParameterClient(
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
            if chief:
                ps.register(
                    arrays,
                    scheme=env.scheme,
                    options=_server_options(scheme, config),
                    num_workers=world,
                    work=work_spec(
                        len(train_set),  # type: ignore[arg-type]
                        batch_size=config.batch_size,
                        epochs=config.epochs,
                        seed=config.seed,
                    )
                    if leased
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
                batches = LeasedBatches(
                    train_set, ps=ps, batch_size=config.batch_size, seed=config.seed, stop=stop
                )
        elif world > 1:
            rendezvous = env.rendezvous or spec.worker[0]
            collective = Collective(
                rendezvous=rendezvous,
                rank=rank,
                world_size=world,
                host_store=chief and not env.rendezvous,
                timeout=env.startup_timeout,
                device=device,
                run_id=env.run_id,
                address=spec.worker[rank],
            )
        ctx = WorkerContext(
            model=model,
            config=config,
            rank=rank,
            num_workers=world,
            device=device,
            ps=ps,
            collective=collective,
        )
        assert batches is not None
        steps = (
            1 << 62  # the queue says when the run ends
            if isinstance(batches, LeasedBatches)
            else config.steps or max(1, math.ceil(config.epochs * batches.steps_per_epoch))
        )
        if ps is not None:
            heartbeat = _join(ps, metrics, ctx)
        log.info(
            "%s: scheme %s, %s steps of batch %d (%d per epoch)",
            name,
            env.scheme,
            "leased" if isinstance(batches, LeasedBatches) else steps,
            config.batch_size,
            batches.steps_per_epoch,
        )
        faults = FaultInjector(env.faults)
        ctx.faults = faults
        start_step = 0
        resumed = load_worker_state(Path(env.resume)) if env.resume else None
        if resumed is not None:
            checks = () if env.reshard else (("worker", rank),)
            for key, want in (*checks, ("scheme_name", env.scheme)):
                if resumed.get(key) != want:
                    raise CheckpointError(
                        f"{env.resume}: saved for {key} {resumed.get(key)!r}, this task is "
                        f"{want!r}; resume each worker from its own state"
                    )
            start_step = int(resumed["local_step"])
            if env.reshard:  # another world size: the same fraction of the run, resharded
                start_step = min(steps, round(start_step * steps / max(1, resumed["steps"])))
                batches.seek(divmod(start_step, batches.steps_per_epoch))
            else:
                batches.seek(resumed["position"])
            ctx.local_step = start_step
            ctx.global_step = int(resumed["global_step"])
        scheme.start(ctx)
        if resumed is not None:
            model.load_state_dict(resumed["model"])
            scheme.load_state_dict(resumed["scheme"])
            log.info("%s: resumed from %s at local step %d", name, env.resume, start_step)
            metrics.log(
                step=ctx.global_step, local_step=start_step, event="resumed", file=env.resume
            )
        forward_model = scheme.wrap_model(ctx, model)  # e.g. DDP around it; same parameters
        if scheme.uses_parameter_servers and env.continue_at > start_step:
            # Restarted after a fault: the steps from its saved state up to where it died were
            # pushed already (the servers hold their updates), so it goes on from there.
            skipped = min(env.continue_at, steps) - start_step
            start_step = ctx.local_step = start_step + skipped
            batches.seek(divmod(start_step, batches.steps_per_epoch))  # leased: nothing to seek
            log.info(
                "%s: continues at local step %d (%d steps pushed before)", name, start_step, skipped
            )
            metrics.log(
                step=ctx.global_step, local_step=start_step, event="continued", skipped=skipped
            )
        ckpt = None
        if run_dir is not None and (env.checkpoint_every or env.checkpoint_seconds):
            scheme.state_dict()  # a state that cannot be saved fails now, not at a checkpoint
            ckpt = Checkpointer(
                run_dir=run_dir,
                rank=rank,
                num_workers=world,
                every_steps=env.checkpoint_every,
                every_seconds=env.checkpoint_seconds,
                wait=env.wait_timeout,
            )

        def worker_state() -> dict[str, Any]:
            return {
                "worker": rank,
                "local_step": ctx.local_step,
                "global_step": ctx.global_step,
                "position": batches.position,
                "model": model.state_dict(),
                "scheme": scheme.state_dict(),
                "scheme_name": env.scheme,
                "steps": steps,
            }

        watch = DivergenceMonitor(name, from_start=start_step == 0)
        eval_model = (
            copy.deepcopy(model) if chief and test_set is not None and config.eval_every else None
        )
        started = time.monotonic()
        clock = ctx.clock
        clock.start_loop()
        batch_iter = iter(batches)
        model.train()
        loss_value = float("nan")
        left = False
        while ctx.local_step < steps:
            if stop is not None and stop.is_set():
                left = True
                break
            if ckpt is not None:
                with clock.measure("checkpoint"):
                    ckpt.maybe_save_worker(ctx.local_step, start_step, worker_state)
            faults.before_step(ctx.global_step)
            done, total = (
                batches.progress if isinstance(batches, LeasedBatches) else (ctx.local_step, steps)
            )
            ctx.set_lr_scale(lr_factor(config.lr_schedule, done, total, config.warmup))
            if isinstance(batches, LeasedBatches):
                batches.settle(ctx.push_outcomes)
            raw = next(batch_iter, None)
            if raw is None:  # leased: the queue has no more work for this worker
                left = stop is not None and stop.is_set()
                break
            batch = split_batch(raw, batch_fn).to(device)
            scheme.before_step(ctx)
            if ckpt is not None and chief:
                with clock.measure("checkpoint"):
                    ckpt.maybe_checkpoint_servers(
                        None if ps is None else ps.checkpoint,
                        {"scheme": env.scheme, "steps": steps},
                    )
            model.zero_grad(set_to_none=False)
            try:
                loss = loss_fn(batch.forward(forward_model), batch.target)
                loss.backward()
            except RuntimeError as exc:
                hint = scheme.explain(exc)
                if hint is None:
                    raise
                raise RuntimeError(f"{exc}; {hint}") from exc
            if isinstance(batches, LeasedBatches):
                batches.trained(ctx.pushes_started)  # its update is in the pushes begun after
            loss_value = float(loss.detach())
            watch.observe(loss_value, ctx.local_step)
            scheme.after_backward(ctx)
            ctx.local_step += 1
            if not scheme.uses_parameter_servers:
                ctx.global_step = ctx.local_step
            if ctx.local_step % config.log_every == 0 or ctx.local_step == steps:
                done, total = (
                    batches.progress
                    if isinstance(batches, LeasedBatches)
                    else (ctx.local_step, steps)
                )
                metrics.log(
                    step=ctx.global_step,
                    local_step=ctx.local_step,
                    progress=round(min(1.0, done / max(1, total)), 4),
                    loss=round(loss_value, 6),
                    samples=ctx.local_step * config.batch_size,
                    epoch=batches.epoch,
                    bytes_sent=ctx.bytes_sent,
                    lost_pushes=ctx.lost_pushes,
                    nonfinite_skipped=ctx.nonfinite_skipped,
                    **({"mean_staleness": round(ctx.mean_staleness, 4)} if ps is not None else {}),
                    **scheme.stats(),
                    **clock.metrics(),
                )
            if (
                eval_model is not None
                and test_set is not None
                and ctx.local_step % config.eval_every == 0
            ):
                with clock.measure("eval"):
                    _load_eval_params(ctx, scheme, eval_model)
                    scores = evaluate(
                        eval_model,
                        test_set,
                        loss_fn,
                        batch_size=config.eval_batch_size,
                        device=device,
                        batch_fn=batch_fn,
                    )
                metrics.log(
                    step=ctx.global_step,
                    local_step=ctx.local_step,
                    test_loss=scores["loss"],
                    accuracy=scores.get("accuracy"),
                )
        scheme.finish(ctx)
        clock.stop_loop()
        seconds = time.monotonic() - started
        work_status = (
            batches.report(ctx.push_outcomes) if isinstance(batches, LeasedBatches) else None
        )
        if ckpt is not None:
            ckpt.save_worker(worker_state(), ctx.local_step)
        if heartbeat is not None:
            heartbeat.stop()  # before the leave: a heartbeat after it would join again
        if ps is not None:
            ps.leave()  # before waiting on checkpoints: a sync step may wait for this leave
        if left:
            log.info("%s: asked to stop; left the run after %d steps", name, ctx.local_step)
            metrics.log(step=ctx.global_step, local_step=ctx.local_step, event="left")
        metrics.log(
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
            **clock.metrics(),
        )
        if ps is not None and chief and isinstance(batches, LeasedBatches):
            work_status = wait_members_gone(ps, rank, env.wait_timeout)
        elif ps is not None and chief:
            _wait_all_finished(
                ps,
                world,
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
            samples=ctx.local_step * config.batch_size,
            bytes_sent=ctx.bytes_sent,
            time_split={k: round(v, 4) for k, v in clock.totals().items()},
            work=_work_counts(work_status) if chief and work_status is not None else None,
            left=left,
        )
        if result.work is not None:
            _log_work(result.work, metrics, ctx)
        verdict = watch.loss_verdict()
        if verdict is not None:
            log.warning("diverged: %s", verdict)
            metrics.log(step=ctx.global_step, event="diverged", reason=verdict)
            result = dataclasses.replace(result, diverged=True, divergence=verdict)
        if chief and not left:
            result = _finish_chief(
                ctx,
                scheme,
                result,
                model,
                loss_fn,
                test_set,
                config,
                env,
                run_dir,
                metrics,
                ps,
                device,
                batch_fn,
            )
        log.info("%s: done, %d steps in %.1fs", name, ctx.local_step, seconds)
        if collective is not None:
            collective.leave()  # every rank done; see Collective.leave for why not destroyed
        return result
    except Diverged as exc:
        metrics.log(event="diverged", reason=str(exc))
        raise
    finally:
        if restore_sigterm is not None:
            restore_sigterm()
        if heartbeat is not None:
            heartbeat.stop()
        if ps is not None:
            ps.close()
        if collective is not None:
            collective.close()
        metrics.close()


def _stop_on_sigterm(stop: threading.Event) -> Callable[[], None] | None:
    """In the main thread: SIGTERM sets ``stop``; returns what restores the old handler (None
    elsewhere: signals reach the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handle(signum: int, frame: object) -> None:
        log.info("SIGTERM: leaving the run after this step")
        stop.set()

    previous = signal.signal(signal.SIGTERM, handle)

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


def _result_fields(result: TrainResult) -> dict[str, Any]:
    """result.json's fields: ``work`` and ``left`` only where they say something."""
    fields = asdict(result)
    if fields["work"] is None:
        del fields["work"]
    if not fields["left"]:
        del fields["left"]
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
    if scheme.evaluate_on == "server":
        _, arrays = ctx.ps.pull(record=False)
        with torch.no_grad():
            for n, p in target.named_parameters():
                p.copy_(torch.from_numpy(arrays[n]))
    else:
        target.load_state_dict(ctx.model.state_dict())


def _finish_chief(
    ctx: WorkerContext,
    scheme: WorkerScheme,
    result: TrainResult,
    model: nn.Module,
    loss_fn: LossFn,
    test_set: Dataset[Any] | None,
    config: TrainConfig,
    env: TaskEnv,
    run_dir: Path | None,
    metrics: MetricsWriter,
    ps: ParameterClient | None,
    device: torch.device,
    batch_fn: BatchFn | None,
) -> TrainResult:
    if ps is not None and scheme.evaluate_on == "server":
        version, arrays = ps.pull(record=False)
        ctx.load(arrays)
        ctx.global_step = max(ctx.global_step, version)
        result = TrainResult(**{**asdict(result), "global_step": ctx.global_step})
    if test_set is not None:
        scores = evaluate(
            model,
            test_set,
            loss_fn,
            batch_size=config.eval_batch_size,
            device=device,
            batch_fn=batch_fn,
        )
        result = TrainResult(
            **{
                **asdict(result),
                "test_loss": scores["loss"],
                "test_accuracy": scores.get("accuracy"),
            }
        )
        verdict = (
            f"the final test loss is {scores['loss']}"
            if not math.isfinite(scores["loss"])
            else accuracy_verdict(scores.get("accuracy"), scores.get("chance"))
        )
        if verdict is not None and not result.diverged:
            log.warning("diverged: %s", verdict)
            metrics.log(step=ctx.global_step, event="diverged", reason=verdict)
            result = dataclasses.replace(result, diverged=True, divergence=verdict)
        metrics.log(
            step=ctx.global_step,
            local_step=ctx.local_step,
            test_loss=scores["loss"],
            accuracy=scores.get("accuracy"),
            final=True,
        )
        log.info("test loss %.4f, accuracy %s", scores["loss"], scores.get("accuracy"))
    if run_dir is not None:
        buf = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buf)
        write_bytes_atomic(run_dir / FINAL_PARAMS_FILE, buf.getvalue())
        write_atomic(
            run_dir / RESULT_FILE,
            json.dumps({**_result_fields(result), "config": config.to_dict()}, indent=2) + "\n",
        )
    return result
