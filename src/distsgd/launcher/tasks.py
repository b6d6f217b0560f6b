"""The tasks of a local run: starting parameter servers and workers, alone or as a whole
cluster from a checkpoint (:class:`LocalTasks`, the base of the launcher's
:class:`~distsgd.launcher.run.LocalRun`)."""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distsgd.cluster import ClusterSpec, Role, TaskId
from distsgd.cluster.hosts import MANAGEMENT_ADDRESS, Host
from distsgd.control.checkpoint.errors import IncompleteCheckpoint
from distsgd.control.checkpoint.store import Checkpoint, latest_checkpoint
from distsgd.control.errors import SetupErrorRecord
from distsgd.control.folder import METRICS_FILE
from distsgd.control.metrics import MetricsWriter
from distsgd.control.rendezvous import host_store
from distsgd.control.task import ENV_VAR
from distsgd.launcher.argv import server_argv, worker_argv, worker_task
from distsgd.launcher.config import LaunchConfig
from distsgd.launcher.control import ControlServer
from distsgd.launcher.durability import DurabilityWatch, disk_full
from distsgd.launcher.engines import engine_for
from distsgd.launcher.errors import RunFailed
from distsgd.launcher.keras_env import keras_environment
from distsgd.launcher.lifeline import PARENT_ENV
from distsgd.launcher.progress import Console, Progress
from distsgd.launcher.rebalance import Rebalancer
from distsgd.launcher.replicas import PREFIX as REPLICA_PREFIX
from distsgd.launcher.replicas import Replicas, is_replica, on_hosts, replica_host
from distsgd.launcher.shard_load import ShardLoadLog
from distsgd.launcher.supervisor import TaskHandle, Tasks
from distsgd.launcher.waits import said_while_slow
from distsgd.transport.security import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    load_secret,
    write_secret_file,
)
from distsgd.util import write_atomic
from distsgd.util.atomic import private_dir as make_private_dir
from distsgd.util.proctitle import TITLE_ENV, task_title

if TYPE_CHECKING:
    from distsgd.launcher.emulated import EmulatedHosts

log = logging.getLogger(__name__)


def worker_gpus(device: str, environ: Mapping[str, str]) -> list[str]:
    """The GPUs the local launcher hands out to its workers, one each in turn, as values of
    ``CUDA_VISIBLE_DEVICES``: for ``--device auto`` or ``cuda`` every GPU this process sees
    (its own ``CUDA_VISIBLE_DEVICES`` when set), none otherwise. ``--device cuda`` on a machine
    without one is an error; ``cuda:N`` picks the same GPU for every worker (none handed out)."""
    if device not in ("auto", "cuda"):
        return []
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        import torch

        ids = (
            [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
        )
    if not ids and device == "cuda":
        raise ValueError(
            "--device cuda: this machine shows no GPU to distsgd; use --device auto (GPUs "
            "where there are some) or cpu"
        )
    return ids


def write_tasks(run_dir: Path, supervisor: Tasks) -> None:
    """``tasks.json``: the PID of every task, for diagnostics and for tests that check cleanup."""
    pids = {t.name: t.pid for t in supervisor.tasks.values()}
    try:
        write_atomic(run_dir / "tasks.json", json.dumps(pids) + "\n")
    except OSError as exc:  # diagnostics: a full disk must not end the run
        if not disk_full(exc):
            raise
        log.warning("tasks.json not written: %s", exc.strerror)


def _replica_holds(hosts: EmulatedHosts, ps: int) -> bool:
    """Whether ps ``ps``'s replica holds a snapshot on its emulated host's disk."""
    host = replica_host(hosts.plan, ps)
    return host is not None and any(
        (hosts.disk_of(host) / f"{REPLICA_PREFIX}{ps}").glob("snapshot-*.npz")
    )


def wait_for_address(task: TaskHandle, path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text().strip()
        if task.poll() is not None:
            last = tuple(task.tail)[-5:]
            tail = "\n".join(f"    {line}" for line in last)
            head = f"{task.name} exited with code {task.poll()} before it was listening"
            raise RunFailed(
                f"{head}; its last log lines:\n{tail}\nfull log: {task.log_path}",
                reason=head,
                log_tail=last,
            )
        time.sleep(0.02)
    raise RunFailed(f"{task.name} did not report its address within {timeout:.0f}s")


def task_envs(secret_file: Path, threads: int) -> tuple[dict[str, str], dict[str, str]]:
    """The environments of a run's workers and of its servers (and replicas)."""
    env = dict(os.environ)
    env.pop(ENV_VAR, None)
    env.pop(SECRET_ENV, None)
    env.update(
        {
            PARENT_ENV: str(os.getpid()),
            "PYTHONUNBUFFERED": "1",
            SECRET_FILE_ENV: str(secret_file.resolve()),
        }
    )
    worker_env = {
        **env,
        "DISTSGD_THREADS": str(threads),
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
    }
    ps_env = {
        **env,
        "DISTSGD_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",  # parameter servers stay on CPU (and import no torch)
    }
    return worker_env, ps_env


class LocalTasks:
    """The tasks of one local run and how they are started."""

    rollbacks: tuple[dict[str, object], ...] = ()
    """The rollbacks taken so far (``result.json``'s ``rollbacks``; see :class:`Restarts`)."""

    def __init__(
        self,
        config: LaunchConfig,
        console: Console,
        run_dir: Path,
        supervisor: Tasks,
        stop: threading.Event,
        *,
        hosts: EmulatedHosts | None = None,
    ) -> None:
        self.config = config
        self.hosts = hosts
        """The emulated hosts the tasks run on (``--hosts``); None: this machine's namespace."""
        self.console = console
        self.run_dir = run_dir
        self.supervisor = supervisor
        self.stop = stop
        self.num_ps = config.num_ps
        self.threads = config.threads_per_worker
        self.collective = config.collective
        self.ckpt_root = run_dir / "checkpoints"
        self.wal_root = run_dir / "wal"
        self.seen_versions: dict[int, int] = {}
        """Each server's version as the launcher last read it (Info, about once a second and
        just before an injected kill): what a dead one had applied at least."""
        self._next_poll = 0.0
        self.checkpointing = bool(config.checkpoint_every or config.checkpoint_seconds)
        self.run_id = config.run_id or secrets.token_hex(8)
        secret_file = run_dir / "secret"
        if config.resume:  # kept on --resume: the restored shards know the run
            self.secret = load_secret({SECRET_FILE_ENV: str(secret_file)})
        else:
            self.secret = write_secret_file(secret_file)
        self.worker_env, self.ps_env = task_envs(secret_file, self.threads)
        hands_out = engine_for(config).assigns_devices  # Ray: the GPUs its bundles reserved
        self.gpus = [] if hands_out else worker_gpus(config.device, os.environ)
        self.spec = self.unbound_spec()
        self.active: set[int] = set(range(config.workers))
        """The worker indexes meant to run now (``distsgd scale`` changes them)."""
        self.store: Any = None
        self.rendezvous = ""
        self.restarts: dict[str, int] = {}
        """Restarts of each task in a row (reset once it runs healthy_seconds)."""
        self.started_at: dict[str, float] = {}
        """When each task was last started (monotonic seconds)."""
        self.restored_ps: set[int] = set()
        """Parameter servers restored from a file in this cluster's life (told who finished)."""
        self.done: set[str] = set()
        """Tasks that have finished (or left, or were dropped)."""
        self.progress = Progress(run_dir / METRICS_FILE)
        self.events = MetricsWriter(run_dir / METRICS_FILE, "launcher")
        self.shard_loads = ShardLoadLog(self.events.log)
        """Each server's load over time, from the Info polls (``shard_load`` events)."""
        self.durability = DurabilityWatch(note=console.note, event=self.events.log, run_dir=run_dir)
        """Each server's write-ahead log as the Info polls find it (launcher/durability.py)."""
        self.rebalancer = self._rebalancer(config, console)
        """``--rebalance auto``: moves pieces between servers (launcher/rebalance.py)."""
        self.control = self._control(supervisor)
        """The run control (launcher/control.py) of tasks that do not share this disk
        (emulated hosts, Ray); None: they write the run folder themselves."""
        self.replicas = self._replicas(config, console)
        """The servers' log replicas on other machines (launcher/replicas.py; None: none)."""

    def _control(self, supervisor: Tasks) -> ControlServer | None:
        """A run control where the tasks run on other hosts: on the management address for
        emulated hosts, on the engine's own address for an engine that places tasks."""
        host = MANAGEMENT_ADDRESS if self.hosts is not None else supervisor.control_host
        if host is None:
            return None
        if self.config.tls is not None:  # its connections are plaintext: not under mutual TLS
            if self.hosts is None and supervisor.machines > 1 and self.config.placement == "spread":
                raise ValueError(
                    "--tls on a Ray cluster of several nodes: the run control that brings the "
                    "tasks' files to the launcher is not encrypted yet; add --placement pack "
                    "(every task on one node, the run folder on its disk) or drop --tls"
                )
            self.console.note(
                "[distsgd] --tls: the tasks write the run folder on the disk they share with "
                "the launcher (the run control is not encrypted yet)"
            )
            return None
        control = ControlServer(self.run_dir, host=host, secret=self.secret)
        self.console.note(
            f"[distsgd] run control on {control.address}: the tasks send the run folder's "
            "files here over the network"
        )
        return control

    @property
    def control_address(self) -> str:
        """Where tasks reach the run control ("" = none: the run folder on this disk)."""
        return "" if self.control is None else self.control.address

    def close_control(self) -> None:
        """Stop the run control (once the tasks are gone)."""
        if self.control is not None:
            self.control.close()
            self.control = None

    def _replicas(self, config: LaunchConfig, console: Console) -> Replicas | None:
        """Log replicas: with the log, on two or more machines (emulated hosts, or an
        engine's: Ray's nodes), unless ``--wal local``."""
        hosts, machines = self.hosts, self.supervisor.machines
        if hosts is not None:
            machines = len(hosts.plan.hosts)
        if machines < 2 or not (config.wal and config.replicate and self.num_ps):
            return None
        if config.tls is not None:  # its connection is plaintext: not under mutual TLS
            console.note("[distsgd] --tls: the servers' logs stay on their own hosts (no replica)")
            return None
        node = self.supervisor.node_host or self.config.host
        return Replicas(
            place=on_hosts(hosts.plan) if hosts is not None else lambda ps: (node, None),
            run_dir=self.run_dir,
            run_id=self.run_id,
            python=[sys.executable, "-m", "distsgd"],
            start_task=lambda name, argv, host: self._start(name, argv, self.ps_env, host=host),
            wait_address=lambda task, path: wait_for_address(task, path, 60.0),
            holds=None if hosts is None else partial(_replica_holds, hosts),
            note=console.note,
            event=self.events.log,
            control=self.control_address,
        )

    def _rebalancer(self, config: LaunchConfig, console: Console) -> Rebalancer | None:
        """``--rebalance auto``'s mover (None: off)."""
        if config.rebalance != "auto":
            return None
        return Rebalancer(
            num_ps=self.num_ps,
            address_of=lambda i: self.spec.address(self.spec.task(Role.PS, i)),
            run_id=self.run_id,
            secret=self.secret,
            tls=config.tls,
            event=self.events.log,
            note=console.note,
        )

    # -- where tasks run ------------------------------------------------------------------------
    def task_host(self, task: TaskId) -> str:
        """The address ``task`` binds: its emulated host's (``--hosts``), else ``--host``."""
        if self.hosts is None:
            return self.supervisor.node_host or self.config.host
        return self.hosts.plan.host_of(task).address

    def host_of(self, name: str) -> Host | None:
        """The emulated host task ``name`` (a server, worker or log replica) runs on."""
        if self.hosts is None:
            return None
        if is_replica(name):
            return replica_host(self.hosts.plan, int(name[len(REPLICA_PREFIX) :]))
        return self.hosts.plan.host_of(TaskId.parse(name))

    def wipe_disk(self, host: Host) -> None:
        """``host`` lost its disk: everything its tasks kept there is gone."""
        assert self.hosts is not None
        self.hosts.wipe(host)

    def _clear_logs(self) -> None:
        """Remove the logs of an earlier cluster (on each host's own disk under ``--hosts``:
        the folder the hosts see as theirs stays, it is their disks' mount point)."""
        self.seen_versions.clear()
        if self.hosts is None:
            shutil.rmtree(self.wal_root, ignore_errors=True)
            return
        for host in self.hosts.plan.hosts:
            self.hosts.wipe(host)

    def unbound_spec(self) -> ClusterSpec:
        """Every task at its address with port 0 (each server picks its port when it starts)."""
        if self.hosts is None:
            c, host = self.config, self.supervisor.node_host or self.config.host
            return ClusterSpec.local(num_workers=c.highest_workers, num_ps=self.num_ps, host=host)
        ps = [self.task_host(TaskId(job=Role.PS, index=i)) for i in range(self.num_ps)]
        workers = range(self.config.highest_workers)
        worker = [self.task_host(TaskId(job=Role.WORKER, index=i)) for i in workers]
        return ClusterSpec(ps=tuple(f"{a}:0" for a in ps), worker=tuple(f"{a}:0" for a in worker))

    @property
    def rollbacks_left(self) -> int:
        """Rollbacks the run may still take (each worker watches for spikes while any are)."""
        return max(0, self.config.max_rollbacks - len(self.rollbacks))

    # -- starting tasks -------------------------------------------------------------------------
    def write_config(self) -> None:
        """Save the run's :class:`~distsgd.control.spec.RunSpec` as its ``config.json``."""
        spec = self.config.run_spec(run_id=self.run_id)
        assert (spec.ps, spec.threads_per_worker) == (self.num_ps, self.threads)
        spec.save(self.run_dir)

    def start_ps(self, index: int, *, address: str, restore: Path | None) -> TaskHandle:
        """Start ps ``index`` and wait until it reports the address it bound."""
        task = self.spawn_ps(index, address=address, restore=restore)
        self.await_ps(index, task)
        return task

    def await_ps(self, index: int, task: TaskHandle) -> None:
        with said_while_slow(self.console.note, f"ps{index} to listen ({task.log_path})"):
            bound = wait_for_address(task, self.ps_address_file(index), 60.0)
        self.spec = self.spec.with_address(self.spec.task(Role.PS, index), bound)

    def ps_address_file(self, index: int) -> Path:
        return self.run_dir / f"ps{index}.address"

    def spawn_ps(self, index: int, *, address: str, restore: Path | None) -> TaskHandle:
        """Start ps ``index`` on ``address`` (port 0: any); it writes its real address to
        :meth:`ps_address_file` once it listens."""
        init = self.run_dir / "cluster-init.json"
        c = self.config
        write_atomic(init, json.dumps(self.unbound_spec().to_dict()) + "\n")
        addr_file = self.ps_address_file(index)
        addr_file.unlink(missing_ok=True)
        self.spec = self.spec.with_address(self.spec.task(Role.PS, index), address)
        argv = server_argv(
            c,
            index,
            cluster_file=init,
            address=address,
            address_file=addr_file,
            checkpoint_dir=self.ckpt_root,
            wal_dir=self.wal_root / f"ps{index}",
            restore=restore,
            control=self.control_address,
            spec=self.unbound_spec(),
        )
        replica = None if self.replicas is None else self.replicas.address(index)
        if replica is not None:
            argv += ["--replica", replica, "--run-id", self.run_id]
        return self._start(f"ps{index}", argv, self.ps_env)

    def _start(
        self, name: str, argv: list[str], env: dict[str, str], *, host: Host | None = None
    ) -> TaskHandle:
        self.started_at[name] = time.monotonic()
        env = {**env, TITLE_ENV: task_title(name, self.run_dir.name)}  # what ps and top show
        if self.hosts is not None:  # in its host's network namespace
            where = host or self.host_of(name)
            assert where is not None
            argv = [*self.hosts.enter(where), *argv]
        return self.supervisor.start(name, argv, env)

    def start_worker(
        self, index: int, *, resume: Path | None, continue_at: int = 0, reshard: bool = False
    ) -> TaskHandle:
        c = self.config
        task_env = worker_task(
            c,
            index,
            spec=self.spec,
            run_dir=self.run_dir,
            run_id=self.run_id,
            rendezvous=self.rendezvous,
            ps_address_files=[self.ps_address_file(i) for i in range(self.num_ps)],
            active=len(self.active),
            resume=resume,
            continue_at=continue_at,
            reshard=reshard,
            rollbacks_left=self.rollbacks_left,
            control=self.control_address,
        )
        self.done.discard(f"worker{index}")
        SetupErrorRecord.clear(self.run_dir, TaskId(job=Role.WORKER, index=index))
        env = {**self.worker_env, ENV_VAR: task_env.to_json()}
        if self.gpus:  # each worker its own GPU (in turn, when there are more workers)
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[index % len(self.gpus)]
        # Keras 3 scripts: KERAS_BACKEND=torch, KERAS_TORCH_DEVICE where it trains (unless set)
        gpu = None if engine_for(c).assigns_devices else bool(self.gpus)  # None: Ray's to say
        env.update(keras_environment(c.device, gpu=gpu, environ=env))
        return self._start(f"worker{index}", worker_argv(c), env)

    def _new_rendezvous(self) -> None:
        if self.collective and self.config.workers > 1:
            # under --hosts the launcher is reached over the management link, on Ray at the
            # driver's node address
            host = self.supervisor.control_host or self.config.host
            if self.hosts is not None:
                host = MANAGEMENT_ADDRESS
            what = "torch to load: the launcher hosts the all-reduce rendezvous store"
            with said_while_slow(self.console.note, what):
                self.store, port = host_store(host, timedelta(seconds=self.config.wait_timeout))
            self.rendezvous = f"{host}:{port}"

    def start_cluster(self, checkpoint: Checkpoint | None, *, fresh_ports: bool) -> None:
        """Start every task. The workers start while the servers do (both take seconds to
        import); a worker reads each server's real address from its address file. They start
        from the checkpoint: logs of an earlier cluster are removed."""
        self._clear_logs()
        if self.active:  # its imports go on beside the launcher's (the rendezvous store's)
            self.supervisor.prepare(self.worker_env)
        if self.config.wal and self.num_ps:
            make_private_dir(self.wal_root)
        if self.replicas is not None:  # before the servers, which are told their addresses
            with said_while_slow(self.console.note, "the servers' log replicas to listen"):
                self.replicas.start(self.num_ps)
        servers = []
        for i in range(self.num_ps):
            address = (
                f"{self.task_host(TaskId(job=Role.PS, index=i))}:0"
                if fresh_ports
                else self.spec.address(self.spec.task(Role.PS, i))
            )
            restore = None if checkpoint is None else checkpoint.shard_file(i)
            servers.append(self.spawn_ps(i, address=address, restore=restore))
        self._new_rendezvous()
        saved = 0 if checkpoint is None else len(checkpoint.manifest["workers"])
        # saved at another size (distsgd scale): every worker continues from worker 0's state
        reshard = checkpoint is not None and saved != len(self.active)
        for i in sorted(self.active):
            resume = None if checkpoint is None else checkpoint.worker_file(0 if reshard else i)
            self.start_worker(i, resume=resume, reshard=reshard)
        for i, task in enumerate(servers):
            self.await_ps(i, task)
        write_atomic(
            self.run_dir / "cluster.json", json.dumps(self.spec.to_dict(), indent=2) + "\n"
        )
        write_tasks(self.run_dir, self.supervisor)

    def latest(self) -> Checkpoint | None:
        checkpoint, problems = latest_checkpoint(self.ckpt_root)
        pending = [p for p in problems if isinstance(p, IncompleteCheckpoint)]
        for problem in problems:
            if not isinstance(problem, IncompleteCheckpoint):
                self.console.note(f"[distsgd] unusable checkpoint: {problem}")
        if pending:
            self.console.note(
                f"[distsgd] skipping {len(pending)} newer checkpoint(s) without a manifest "
                "(still being completed, or interrupted)"
            )
        if checkpoint is not None and len(problems) > len(pending):
            self.console.note(
                f"[distsgd] using the previous complete checkpoint {checkpoint.path.name}"
            )
        return checkpoint
