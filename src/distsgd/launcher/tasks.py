"""Starting a local run's tasks (:class:`TaskStarter`): parameter servers, workers and log
replicas, alone or as a whole cluster from a checkpoint, with their command lines and
environments, the run control they reach the launcher's folder by, and the cluster's addresses;
a collaborator of the launcher's :class:`~distsgd.launcher.run.LocalRun`."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from distsgd.cluster import ClusterSpec, Role, TaskId
from distsgd.control.checkpoint.store import Checkpoint
from distsgd.control.errors import SetupErrorRecord
from distsgd.control.rendezvous import host_store
from distsgd.control.task import ENV_VAR
from distsgd.launcher.argv import server_argv, worker_argv, worker_task
from distsgd.launcher.control import ControlServer
from distsgd.launcher.durability import disk_full
from distsgd.launcher.emulated import Host, Hosts
from distsgd.launcher.engines import engine_for
from distsgd.launcher.errors import RunFailed
from distsgd.launcher.keras_env import keras_environment
from distsgd.launcher.lifeline import PARENT_ENV, thread_env
from distsgd.launcher.replicas import Replicas
from distsgd.launcher.run_state import RunState
from distsgd.launcher.supervisor import TaskHandle, Tasks
from distsgd.launcher.waits import said_while_slow
from distsgd.transport.security import SECRET_ENV, SECRET_FILE_ENV
from distsgd.util import write_atomic
from distsgd.util.atomic import private_dir as make_private_dir
from distsgd.util.probe import DIR_ENV as DOCTOR_DIR_ENV
from distsgd.util.probe import FOLDER as DOCTOR_FOLDER
from distsgd.util.proctitle import TITLE_ENV, task_title

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


def task_envs(run_dir: Path, threads: int) -> tuple[dict[str, str], dict[str, str]]:
    """The environments of a run's workers and of its servers (and replicas): the run
    secret's file, and the folder of the doctor's pointers (:mod:`distsgd.util.probe`)."""
    env = {k: v for k, v in os.environ.items() if k not in (ENV_VAR, SECRET_ENV)}
    env.update({PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"})
    env[SECRET_FILE_ENV] = str((run_dir / "secret").resolve())
    env[DOCTOR_DIR_ENV] = str((run_dir / DOCTOR_FOLDER).resolve())
    # parameter servers stay on CPU (and import no torch)
    return {**env, **thread_env(threads)}, {**env, **thread_env(1), "CUDA_VISIBLE_DEVICES": ""}


class TaskStarter:
    """Starts the tasks of one local run, and keeps the cluster's addresses and its run
    control."""

    def __init__(
        self,
        state: RunState,
        hosts: Hosts,
        *,
        worker_env: dict[str, str],
        ps_env: dict[str, str],
        gpus: list[str],
    ) -> None:
        self.state = state
        self.hosts = hosts
        self.worker_env, self.ps_env = worker_env, ps_env
        self.gpus = gpus
        """The GPUs handed out to the workers in turn (:func:`worker_gpus`)."""
        self.spec = self.unbound_spec()
        """The cluster's addresses (each server's real one once it listens)."""
        self.store: Any = None
        """The all-reduce rendezvous store the launcher hosts (collective runs)."""
        self.rendezvous = ""
        self.control = self._control()
        """The run control (launcher/control.py) of tasks that do not share this disk
        (emulated hosts, Ray); None: they write the run folder themselves."""
        self.replicas = self._replicas()
        """The servers' log replicas on other machines (launcher/replicas.py; None: none)."""

    @property
    def default_host(self) -> str:
        """The address a task binds off the emulated hosts: its engine node's, else ``--host``."""
        return self.state.supervisor.node_host or self.state.config.hosting.host

    # -- the run control and the log replicas ---------------------------------------------------
    def _control(self) -> ControlServer | None:
        """A run control where the tasks run on other hosts: on the management address for
        emulated hosts, on the engine's own address for an engine that places tasks."""
        state, supervisor = self.state, self.state.supervisor
        host = self.hosts.control_host(supervisor.control_host)
        if host is None:
            return None
        if state.config.hosting.tls is not None:  # plaintext connections: not under mutual TLS
            if (
                not self.hosts.emulated
                and supervisor.machines > 1
                and state.config.hosting.placement == "spread"
            ):
                raise ValueError(
                    "--tls on a Ray cluster of several nodes: the run control that brings the "
                    "tasks' files to the launcher is not encrypted yet; add --placement pack "
                    "(every task on one node, the run folder on its disk) or drop --tls"
                )
            state.console.note(
                "[distsgd] --tls: the tasks write the run folder on the disk they share with "
                "the launcher (the run control is not encrypted yet)"
            )
            return None
        control = ControlServer(state.run_dir, host=host, secret=state.secret)
        state.console.note(
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

    def _replicas(self) -> Replicas | None:
        """Log replicas: with the log, on two or more machines (emulated hosts, or an
        engine's: Ray's nodes), unless ``--wal local``."""
        state, config = self.state, self.state.config
        machines = self.hosts.machines(state.supervisor.machines)
        durability = config.durability
        if machines < 2 or not (durability.wal and durability.replicate and config.num_ps):
            return None
        if config.hosting.tls is not None:  # its connection is plaintext: not under mutual TLS
            state.console.note(
                "[distsgd] --tls: the servers' logs stay on their own hosts (no replica)"
            )
            return None
        node = self.default_host
        place = self.hosts.replica_place()
        return Replicas(
            place=place if place is not None else lambda ps: (node, None),
            run_dir=state.run_dir,
            run_id=state.run_id,
            python=[sys.executable, "-m", "distsgd"],
            start_task=lambda name, argv, host: self.start_task(name, argv, self.ps_env, host=host),
            wait_address=lambda task, path: wait_for_address(task, path, 60.0),
            holds=self.hosts.replica_holds if self.hosts.emulated else None,
            note=state.console.note,
            event=state.events.log,
            control=self.control_address,
        )

    # -- where tasks run ------------------------------------------------------------------------
    def task_host(self, task: TaskId) -> str:
        """The address ``task`` binds: its emulated host's (``--hosts``), else ``--host``."""
        host = self.hosts.task_host(task)
        return host if host is not None else self.default_host

    def ps_address(self, index: int) -> str:
        """ps ``index``'s address as the launcher knows it."""
        return self.spec.address(self.spec.task(Role.PS, index))

    def clear_logs(self) -> None:
        """Remove the logs of an earlier cluster (on each host's own disk under ``--hosts``:
        the folder the hosts see as theirs stays, it is their disks' mount point)."""
        if not self.hosts.wipe_all():
            shutil.rmtree(self.state.wal_root, ignore_errors=True)

    def unbound_spec(self) -> ClusterSpec:
        """Every task at its address with port 0 (each server picks its port when it starts)."""
        c = self.state.config
        if not self.hosts.emulated:
            host = self.default_host
            return ClusterSpec.local(num_workers=c.size.highest_workers, num_ps=c.num_ps, host=host)
        ps = [self.task_host(TaskId(job=Role.PS, index=i)) for i in range(c.num_ps)]
        workers = range(c.size.highest_workers)
        worker = [self.task_host(TaskId(job=Role.WORKER, index=i)) for i in workers]
        return ClusterSpec(ps=tuple(f"{a}:0" for a in ps), worker=tuple(f"{a}:0" for a in worker))

    # -- starting tasks -------------------------------------------------------------------------
    def write_config(self) -> None:
        """Save the run's :class:`~distsgd.control.spec.RunSpec` as its ``config.json``."""
        state, config = self.state, self.state.config
        spec = config.run_spec(run_id=state.run_id)
        assert (spec.ps, spec.threads_per_worker) == (config.num_ps, config.threads_per_worker)
        spec.save(state.run_dir)

    def start_ps(self, index: int, *, address: str, restore: Path | None) -> TaskHandle:
        """Start ps ``index`` and wait until it reports the address it bound."""
        task = self.spawn_ps(index, address=address, restore=restore)
        self.await_ps(index, task)
        return task

    def await_ps(self, index: int, task: TaskHandle) -> None:
        with said_while_slow(self.state.console.note, f"ps{index} to listen ({task.log_path})"):
            bound = wait_for_address(task, self.ps_address_file(index), 60.0)
        self.spec = self.spec.with_address(self.spec.task(Role.PS, index), bound)

    def ps_address_file(self, index: int) -> Path:
        return self.state.run_dir / f"ps{index}.address"

    def spawn_ps(self, index: int, *, address: str, restore: Path | None) -> TaskHandle:
        """Start ps ``index`` on ``address`` (port 0: any); it writes its real address to
        :meth:`ps_address_file` once it listens."""
        state = self.state
        init = state.run_dir / "cluster-init.json"
        write_atomic(init, json.dumps(self.unbound_spec().to_dict()) + "\n")
        addr_file = self.ps_address_file(index)
        addr_file.unlink(missing_ok=True)
        self.spec = self.spec.with_address(self.spec.task(Role.PS, index), address)
        argv = server_argv(
            state.config,
            index,
            cluster_file=init,
            address=address,
            address_file=addr_file,
            checkpoint_dir=state.ckpt_root,
            wal_dir=state.wal_root / f"ps{index}",
            restore=restore,
            control=self.control_address,
            spec=self.unbound_spec(),
        )
        replica = None if self.replicas is None else self.replicas.address(index)
        if replica is not None:
            argv += ["--replica", replica, "--run-id", state.run_id]
        return self.start_task(f"ps{index}", argv, self.ps_env)

    def start_task(
        self, name: str, argv: list[str], env: dict[str, str], *, host: Host | None = None
    ) -> TaskHandle:
        """Start task ``name`` (in its emulated host's network namespace, or ``host``'s)."""
        state = self.state
        state.started_at[name] = time.monotonic()
        env = {**env, TITLE_ENV: task_title(name, state.run_dir.name)}  # what ps and top show
        argv = [*self.hosts.enter(name, host), *argv]
        return state.supervisor.start(name, argv, env)

    def start_worker(
        self, index: int, *, resume: Path | None, continue_at: int = 0, reshard: bool = False
    ) -> TaskHandle:
        state = self.state
        c = state.config
        task_env = worker_task(
            c,
            index,
            spec=self.spec,
            run_dir=state.run_dir,
            run_id=state.run_id,
            rendezvous=self.rendezvous,
            ps_address_files=[self.ps_address_file(i) for i in range(state.config.num_ps)],
            active=len(state.active),
            resume=resume,
            continue_at=continue_at,
            reshard=reshard,
            rollbacks_left=state.rollbacks_left,
            control=self.control_address,
            link_delays=self.hosts.link_delays(index, state.config.num_ps),
        )
        state.done.discard(f"worker{index}")
        SetupErrorRecord.clear(state.run_dir, TaskId(job=Role.WORKER, index=index))
        env = {**self.worker_env, ENV_VAR: task_env.to_json()}
        if self.gpus:  # each worker its own GPU (in turn, when there are more workers)
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[index % len(self.gpus)]
        # Keras 3 scripts: KERAS_BACKEND=torch, KERAS_TORCH_DEVICE where it trains (unless set)
        gpu = None if engine_for(c).assigns_devices else bool(self.gpus)  # None: Ray's to say
        env.update(keras_environment(c.device, gpu=gpu, environ=env))
        return self.start_task(f"worker{index}", worker_argv(c), env)

    def _new_rendezvous(self) -> None:
        state, config = self.state, self.state.config
        if config.collective and config.size.workers > 1:
            # under --hosts the launcher is reached over the management link, on Ray at the
            # driver's node address
            host = self.hosts.control_host(state.supervisor.control_host) or config.hosting.host
            what = "torch to load: the launcher hosts the all-reduce rendezvous store"
            with said_while_slow(state.console.note, what):
                self.store, port = host_store(host, timedelta(seconds=config.wait_timeout))
            self.rendezvous = f"{host}:{port}"

    def start_cluster(self, checkpoint: Checkpoint | None, *, fresh_ports: bool) -> None:
        """Start every task. The workers start while the servers do (both take seconds to
        import); a worker reads each server's real address from its address file. They start
        from the checkpoint: logs of an earlier cluster are removed."""
        state = self.state
        self.clear_logs()
        if state.active:  # its imports go on beside the launcher's (the rendezvous store's)
            state.supervisor.prepare(self.worker_env)
        if state.config.durability.wal and state.config.num_ps:
            make_private_dir(state.wal_root)
        if self.replicas is not None:  # before the servers, which are told their addresses
            with said_while_slow(state.console.note, "the servers' log replicas to listen"):
                self.replicas.start(state.config.num_ps)
        servers = []
        for i in range(state.config.num_ps):
            address = (
                f"{self.task_host(TaskId(job=Role.PS, index=i))}:0"
                if fresh_ports
                else self.ps_address(i)
            )
            restore = None if checkpoint is None else checkpoint.shard_file(i)
            servers.append(self.spawn_ps(i, address=address, restore=restore))
        self._new_rendezvous()
        saved = 0 if checkpoint is None else len(checkpoint.manifest["workers"])
        # saved at another size (distsgd elastic scale): each worker continues from worker 0's state
        reshard = checkpoint is not None and saved != len(state.active)
        for i in sorted(state.active):
            resume = None if checkpoint is None else checkpoint.worker_file(0 if reshard else i)
            self.start_worker(i, resume=resume, reshard=reshard)
        for i, task in enumerate(servers):
            self.await_ps(i, task)
        write_atomic(
            state.run_dir / "cluster.json", json.dumps(self.spec.to_dict(), indent=2) + "\n"
        )
        write_tasks(state.run_dir, state.supervisor)
