"""A worker's connection to the parameter servers: :class:`PsConnection`.

Built by :meth:`PsConnection.open`: a :class:`~distsgd.ps.client.ParameterClient` over the
partition of the model's parameters, registered by the chief (the rule's options, the number
of workers, an elastic run's work queue), waited for by the others. Once the scheme's context
exists the worker joins every shard's membership and keeps it with a heartbeat; at the end it
leaves, and the chief waits for the others (:mod:`distsgd.runtime.chief`).
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn
from torch.utils.data import Dataset

from distsgd.control.config import TrainConfig
from distsgd.control.metrics import MetricsWriter
from distsgd.control.task import TaskEnv
from distsgd.ps.client import Heartbeat, ParameterClient
from distsgd.ps.partition import PartitionPlan
from distsgd.ps.rules import WORLD_SIZE_OPTION
from distsgd.runtime.chief import shard_saver, wait_all_finished
from distsgd.runtime.connection import Connection
from distsgd.runtime.context import WorkerContext
from distsgd.runtime.modules import exchanged_parameters
from distsgd.runtime.scheme import WorkerScheme
from distsgd.runtime.work import LeasedBatches, wait_members_gone, work_spec
from distsgd.transport.delay import LinkDelay
from distsgd.transport.inflight import CALLS
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.security import load_secret

log = logging.getLogger(__name__)


class PsConnection(Connection):
    """A worker of a parameter-server scheme: its client of every shard, its membership
    heartbeat, and (an elastic run counted in epochs) its leased batches."""

    def __init__(self, client: ParameterClient, *, rank: int) -> None:
        self.ps: ParameterClient = client
        self.rank = rank
        self.heartbeat: Heartbeat | None = None

    @classmethod
    def open(
        cls,
        *,
        env: TaskEnv,
        config: TrainConfig,
        scheme: WorkerScheme,
        model: nn.Module,
        work: Dataset[Any] | None,
        stop: threading.Event | None,
    ) -> PsConnection:
        """Connect to the servers of ``env``'s cluster; the chief registers the run. ``work``:
        the training set whose batches this worker leases from shard 0's queue (None: it
        trains its own shard, or the loop brings its data)."""
        spec, rank = env.spec, env.task_index
        if spec.num_ps == 0:
            raise ValueError(
                f"scheme {env.scheme!r} needs parameter servers; run with --ps 1 or more"
            )
        arrays = {n: p.detach().cpu().numpy() for n, p in exchanged_parameters(model).items()}
        plan = PartitionPlan.from_arrays(arrays, spec.num_ps, placement=config.param_placement)
        conn = cls(_client(env, config, plan), rank=rank)
        conn.ps.startup_seconds = env.startup_timeout  # the first wait for the others' pushes
        try:
            if rank == 0:
                conn.ps.register(
                    arrays,
                    scheme=env.scheme,
                    options=server_options(scheme, config),
                    num_workers=env.num_workers,
                    work=None if work is None else work_spec(work, config),
                )
                log.info(
                    "registered %d parameters on %d ps (bytes per shard: %s)",
                    len(arrays),
                    spec.num_ps,
                    plan.shard_bytes,
                )
            conn.ps.wait_registered(env.startup_timeout)
            if work is not None:
                conn.leased = LeasedBatches(
                    work, ps=conn.ps, batch_size=config.batch_size, seed=config.seed, stop=stop
                )
        except BaseException:
            conn.close()
            raise
        return conn

    def join(self, ctx: WorkerContext, metrics: MetricsWriter) -> None:
        """Join every shard's membership, log it, and keep it with a :class:`Heartbeat` that
        logs a ``membership`` event (at the worker's step as last heard) whenever a shard's
        epoch changes."""
        joined = self.ps.join()

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
        self.heartbeat = Heartbeat(self.ps, joined, changed)

    def continue_at(self, env: TaskEnv) -> int:
        """Where the servers say this worker's pushes stopped (the steps whose push every shard
        applied, as they answered at registration), not where its metrics lines stopped
        (``env.continue_at``, up to ``--log-every`` steps behind): no step is pushed twice."""
        return self.ps.steps_applied()

    @property
    def shard_checkpoint(self) -> Callable[[str], list[dict[str, Any]]] | None:
        return self.ps.checkpoint

    def after_step(self, ctx: WorkerContext) -> None:
        """The servers' version, as the scheme's last exchange heard it, stays."""

    def step_fields(self, ctx: WorkerContext) -> dict[str, Any]:
        """The mean staleness, and ``server_s``: per server, the seconds this process's pulls
        and pushes to it took so far (``{"ps0": {"pull": 1.2, "push": 3.4}, ...}``: where the
        straggler detector looks for a slow link or a slow server)."""
        spent = {
            f"ps{i}": {m.lower(): round(CALLS.spent(s.address, m), 4) for m in ("Pull", "Push")}
            for i, s in enumerate(self.ps.shards)
        }
        return {"mean_staleness": round(ctx.mean_staleness, 4), "server_s": spent}

    def leave(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()  # before the leave: a heartbeat after it would join again
        self.ps.leave()  # before waiting on checkpoints: a sync step may wait for this leave

    def finish_fields(self) -> dict[str, Any]:
        return {
            "shared_memory_shards": self.ps.shared_memory_shards,
            "tensor_socket_shards": self.ps.tensor_socket_shards,
        }

    def wait_for_others(self, env: TaskEnv, checkpoints: Path | None) -> pb.WorkStatus | None:
        if self.leased is not None:
            return wait_members_gone(self.ps, self.rank, env.wait_timeout)
        wait_all_finished(
            self.ps,
            env.num_workers,
            env.wait_timeout,
            save=None if checkpoints is None else shard_saver(self.ps, checkpoints),
            every_versions=env.checkpoint_every,
            every_seconds=env.checkpoint_seconds or 10.0,
        )
        return None

    def server_parameters(self) -> tuple[int, dict[str, np.ndarray]] | None:
        return self.ps.pull(record=False)

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.ps.close()


def server_options(scheme: WorkerScheme, config: TrainConfig) -> dict[str, Any]:
    """What the chief registers as the rule's options: the scheme's, and ``world_size`` when
    dynamic (a fixed run's options stay exactly as before)."""
    options = scheme.server_options(config)
    if config.world_size == "dynamic":
        options = {**options, WORLD_SIZE_OPTION: "dynamic"}
    return options


def _client(env: TaskEnv, config: TrainConfig, plan: PartitionPlan) -> ParameterClient:
    """This worker's client of every shard, with the run's transport settings."""
    return ParameterClient(
        list(env.spec.ps),
        plan,
        worker=env.task_index,
        incarnation=secrets.randbits(63),
        run_id=env.run_id,
        timeout=env.rpc_timeout,
        retry_seconds=env.wait_timeout,
        secret=load_secret(),
        shared_memory=config.shared_memory == "auto",
        tensor_socket=config.tensor_socket == "auto",
        wire_dtype=config.wire_dtype,
        pull_dtype=config.pull_dtype,
        topk=config.topk,
        tls=env.tls,
        link_delays=[LinkDelay(round_trip_s=rtt, jitter_s=jit) for rtt, jit in env.ps_link_delays],
    )
