"""What worker 0, the chief, does besides training: the evaluations on the test set and the
end of the run (:class:`Chief`).

Every ``eval_every`` steps it evaluates a copy of the model (:meth:`Chief.every_step`), its
BatchNorm statistics re-estimated at the parameters evaluated (:mod:`~distsgd.runtime.batchnorm`;
so are the final model's). After
its last step it waits until every other worker has left the servers, checkpointing the
servers meanwhile (:func:`wait_all_finished`); then :meth:`Chief.finish` evaluates, judges
whether the run diverged or stalled (:func:`final_verdict`), and saves what the run produced
(:func:`save_result`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from distsgd.control.checkpoint.store import SHARDS_PREFIX, prune_shard_dirs
from distsgd.control.config import LrScaling, TrainConfig
from distsgd.control.divergence import (
    BLOWUP_MOVEMENT,
    MOVEMENT_SAMPLE,
    STALL_MOVEMENT,
    accuracy_verdict,
    relative_movement,
    stalled_verdict,
    unclear_verdict,
)
from distsgd.control.folder import FINAL_PARAMS_FILE, RESULT_FILE, RunFiles
from distsgd.control.metrics import MetricsWriter
from distsgd.ps.client import ParameterClient
from distsgd.runtime.batchnorm import RecentInputs, recalibrate, running_stats_modules
from distsgd.runtime.connection import Connection
from distsgd.runtime.context import WorkerContext
from distsgd.runtime.data import BatchFn
from distsgd.runtime.evaluate import LossFn, MetricFns, evaluate
from distsgd.runtime.modules import exchanged_parameters, load_eval_state
from distsgd.runtime.result import TrainResult, recorded_result, result_fields
from distsgd.runtime.scheme import WorkerScheme

log = logging.getLogger(__name__)


class Chief:
    """Worker 0's evaluations on the test set (none without one) and its end of the run."""

    def __init__(
        self,
        *,
        test_set: Dataset[Any] | None,
        loss_fn: LossFn | None,
        batch_fn: BatchFn | None,
        metric_fns: MetricFns,
        config: TrainConfig,
        given_config: TrainConfig,
        lr_scaling: LrScaling,
        files: RunFiles | None,
        metrics: MetricsWriter,
    ) -> None:
        self.test_set = test_set
        self.loss_fn = loss_fn
        self.batch_fn = batch_fn
        self.metric_fns = metric_fns
        self.config = config
        self.given_config = given_config
        """The config as the script and the command line gave it (``result.json``'s)."""
        self.lr_scaling = lr_scaling
        self.files = files
        """The run folder (on this disk or the launcher's); None: no result files."""
        self.metrics = metrics
        self.start_point: list[np.ndarray] | None = None
        """A sample of the parameters where training started (None: it resumed mid-run)."""
        self.eval_model: nn.Module | None = None
        """The copy of the model evaluated every ``eval_every`` steps (None: never)."""
        self.resumed = False
        """This chief continues a run (restarted or resumed), not starting it."""
        self.recent: RecentInputs | None = None
        """The chief's latest training inputs, replayed to re-estimate BatchNorm statistics
        before each evaluation and the final model's (None: a model without them)."""

    def start(self, model: nn.Module, *, from_start: bool) -> None:
        """Before the first step (``from_start``: the run's first, not a resumed one)."""
        self.resumed = not from_start
        # a run at chance that barely moved from where it started stalled, not diverged
        if from_start:
            self.start_point = parameter_sample(model)
        if self.test_set is not None and self.config.eval_every:
            self.eval_model = copy.deepcopy(model)
        if running_stats_modules(model):
            self.recent = RecentInputs(model)  # after the copy, which must not hold its hook

    def recalibrate(self, model: nn.Module) -> None:
        """Re-estimate ``model``'s BatchNorm statistics at its parameters over the chief's
        latest training batches (nothing without BatchNorm)."""
        if self.recent is None:
            return
        if recalibrate(model, self.recent) == 0:
            log.info(
                "BatchNorm statistics kept as the replica has them: this process has not "
                "trained a batch to re-estimate them with (a chief restarted after its steps)"
            )

    def close(self) -> None:
        """Take the recording hook off the model (the script may go on using it)."""
        if self.recent is not None:
            self.recent.remove()
            self.recent = None

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        assert self.test_set is not None and self.loss_fn is not None
        return evaluate(
            model,
            self.test_set,
            self.loss_fn,
            batch_size=self.config.eval_batch_size,
            device=device,
            batch_fn=self.batch_fn,
            metric_fns=self.metric_fns,
        )

    def log_scores(self, ctx: WorkerContext, scores: Mapping[str, float], **extra: Any) -> None:
        user = {k: scores[k] for k in self.metric_fns if k in scores}
        self.metrics.log(
            step=ctx.global_step,
            local_step=ctx.local_step,
            test_loss=scores["loss"],
            accuracy=scores.get("accuracy"),
            **({"user": user} if user else {}),
            **extra,
        )

    def every_step(self, ctx: WorkerContext, scheme: WorkerScheme) -> dict[str, float] | None:
        """After a step: on every ``eval_every``-th, the scores of the parameters the scheme
        evaluates (the servers', or the replica's); None on the others."""
        if self.eval_model is None or ctx.local_step % self.config.eval_every != 0:
            return None
        with ctx.clock.measure("eval"):
            # the replica's whole state (its BatchNorm statistics), then the servers' weights
            server = ctx.ps.pull(record=False)[1] if scheme.evaluate_on == "server" else None
            load_eval_state(self.eval_model, ctx.model, server)
            self.recalibrate(self.eval_model)
            scores = self.evaluate(self.eval_model, ctx.device)
        self.log_scores(ctx, scores)
        return scores

    def finish(
        self,
        result: TrainResult,
        *,
        ctx: WorkerContext,
        conn: Connection,
        scheme: WorkerScheme,
        on_evaluate: Callable[[dict[str, float]], None],
    ) -> TrainResult:
        """After the other workers finished: the servers' parameters into the replica (where
        the scheme evaluates those), its BatchNorm statistics re-estimated at them, the final
        evaluation (``on_evaluate`` its scores) and
        its verdict, and the run's result files. A chief restarted (or resumed) after it
        recorded the run's result keeps that record and returns it: training was over."""
        if self.resumed and self.files is not None and self.files.get(RESULT_FILE) is not None:
            log.warning(
                "the run's result was recorded before this restart (%s); it stands: not "
                "evaluated or saved again",
                RESULT_FILE,
            )
            return recorded_result(self.files) or result
        pulled = conn.server_parameters() if scheme.evaluate_on == "server" else None
        if pulled is not None:
            ctx.load(pulled[1])
            ctx.global_step = max(ctx.global_step, pulled[0])
            result = dataclasses.replace(result, global_step=ctx.global_step)
        self.recalibrate(ctx.model)  # the final model's statistics at its parameters
        if self.test_set is not None:
            scores = self.evaluate(ctx.model, ctx.device)
            result = final_verdict(
                result,
                scores,
                metric_names=self.metric_fns,
                start_point=self.start_point,
                model=ctx.model,
                metrics=self.metrics,
            )
            self.log_scores(ctx, scores, final=True)
            log.info("test loss %.4f, accuracy %s", scores["loss"], scores.get("accuracy"))
            on_evaluate(scores)
        if self.files is not None:
            save_result(
                self.files,
                result,
                model=ctx.model,
                config=self.given_config,
                lr_scaling=self.lr_scaling,
            )
        return result


def wait_all_finished(
    ps: ParameterClient,
    num_workers: int,
    timeout: float,
    save: Callable[[int], None] | None = None,
    every_versions: int = 0,
    every_seconds: float = 0.0,
) -> None:
    """(Chief, after its last step) wait until every worker has left the servers, or is no
    longer a member of any (evicted: its machine was lost, say; the run then shrinks).

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
        # the others finished or were evicted (a server that forgot its members, restored from
        # a file, has epoch 0: it says nothing of evictions)
        if all(not info.members and info.membership_epoch > 0 for info in infos):
            done = min(info.finished_workers for info in infos)
            log.warning(
                "%d of %d workers finished; the others were evicted (silent past the servers' "
                "--evict-after: a lost machine's): the run ends without them",
                done,
                num_workers,
            )
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


def shard_saver(ps: ParameterClient, root: Path) -> Callable[[int], None]:
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


def parameter_sample(model: nn.Module) -> list[np.ndarray]:
    """Up to MOVEMENT_SAMPLE evenly strided elements of each exchanged parameter (float64)."""
    out = []
    for p in exchanged_parameters(model).values():
        flat = p.detach().reshape(-1)
        stride = max(1, flat.numel() // MOVEMENT_SAMPLE)
        out.append(flat[::stride][:MOVEMENT_SAMPLE].double().cpu().numpy().copy())
    return out


def final_verdict(
    result: TrainResult,
    scores: Mapping[str, float],
    *,
    metric_names: Iterable[str],
    start_point: list[np.ndarray] | None,
    model: nn.Module,
    metrics: MetricsWriter,
) -> TrainResult:
    """``result`` with the final evaluation's scores (those of ``metric_names``, the user's
    ``metrics=`` functions, in ``TrainResult.metrics``) and, when the run failed (a non-finite
    loss, an accuracy at chance), its verdict: diverged, or stalled when the parameters barely
    moved from ``start_point`` (where training started; None: unknown)."""
    result = dataclasses.replace(
        result,
        test_loss=scores["loss"],
        test_accuracy=scores.get("accuracy"),
        metrics={k: scores[k] for k in metric_names if k in scores},
    )
    verdict = (
        f"the final test loss is {scores['loss']}"
        if not math.isfinite(scores["loss"])
        else accuracy_verdict(scores.get("accuracy"), scores.get("chance"))
    )
    if verdict is None or result.diverged:
        return result
    moved = (
        relative_movement(start_point, parameter_sample(model))
        if start_point is not None and math.isfinite(scores["loss"])
        else math.inf
    )
    stalled = moved < STALL_MOVEMENT
    unclear = STALL_MOVEMENT <= moved < BLOWUP_MOVEMENT
    if stalled:
        verdict = stalled_verdict(verdict, moved)
    elif unclear:
        verdict = unclear_verdict(verdict, moved)
    log.warning("diverged: %s", verdict)
    metrics.log(
        step=result.global_step, event="diverged", reason=verdict, stalled=stalled, unclear=unclear
    )
    return dataclasses.replace(
        result, diverged=True, divergence=verdict, stalled=stalled, unclear=unclear
    )


def save_result(
    files: RunFiles,
    result: TrainResult,
    *,
    model: nn.Module,
    config: TrainConfig,
    lr_scaling: LrScaling,
) -> None:
    """The run's final parameters and ``result.json`` (with the config as given and how its
    rate was scaled) in the run folder (``files``: on this disk or the launcher's)."""
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    # streamed into the file: no serialized copy of the model in memory (two, with getvalue)
    files.put_stream(FINAL_PARAMS_FILE, lambda f: torch.save(state, f))
    saved: dict[str, Any] = {
        **result_fields(result),
        "config": config.to_dict(),
        "lr_scaling": lr_scaling.to_dict(),
    }
    files.put(RESULT_FILE, (json.dumps(saved, indent=2) + "\n").encode())


def log_work(work: dict[str, Any], metrics: MetricsWriter, step: int, local_step: int) -> None:
    """The work units' counts (result.json's ``work``) into the log and the metrics lines."""
    log.info(
        "work units: %d epochs of %d units; trained once %d, twice or more %d, never %d",
        work["epochs"],
        work["units_per_epoch"],
        work["trained_once"],
        work["trained_twice"],
        work["never_trained"],
    )
    metrics.log(
        step=step,
        local_step=local_step,
        event="work",
        **{k: v for k, v in work.items() if k != "per_epoch"},
    )
