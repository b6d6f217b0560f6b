"""Tasks as Ray actors: ``distsgd run --ray`` runs the very task processes of the local launcher,
each started by an actor in a placement group, so Ray schedules them and distsgd does the rest.

Ray reserves one bundle per task (``CPU`` per task, ``GPU`` where asked) in a placement group;
each task's actor starts the task's ordinary command line as a child process on its node and
hands its output to the launcher, which writes the logs and watches exits as it does for local
processes. The data plane stays distsgd's own (gRPC and the run secret, shared memory, tensor
sockets): Ray is the scheduler, not the transport. Restarts and ``--inject-fault`` go through
the same :class:`~distsgd.launcher.supervisor.Supervisor` interface, and nothing outlives the
launcher: a task process exits with its actor (the lifeline is the actor's PID), actors are
killed when stopped, and the placement group is removed; without an address the launcher's own
Ray instance is shut down, which ends whatever is left of it.

A local instance (no address) is ``ray start --head --block`` in a session of its own,
listening on 127.0.0.1 only, with a :mod:`~distsgd.launcher.reaper` that ends its process group
if the launcher is killed (Ray's agents outlive a killed driver).

Across nodes (``--placement spread``, the default): the servers' placement group is
``STRICT_SPREAD`` where the cluster has a node for each, the workers' ``SPREAD``; every task's
address names :data:`NODE_HOST`, which the actor replaces by its node's address, and the tasks
send the run folder's files to the launcher's run control (``launcher/control.py``), so no node
needs the driver's disk. ``--placement pack``: one ``STRICT_PACK`` group, every task on one node.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distsgd.launcher.engines import Engine
from distsgd.launcher.lifeline import PARENT_ENV
from distsgd.launcher.reaper import end_group, remove
from distsgd.transport.security import SECRET_ENV, SECRET_FILE_ENV, load_secret
from distsgd.util import open_private, private_dir

if TYPE_CHECKING:
    from distsgd.launcher.config import LaunchConfig
    from distsgd.launcher.progress import Console

log = logging.getLogger(__name__)

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch that, set to 0, makes a new local instance use 127.0.0.1 as its node address
(it then binds its servers there) instead of the machine's network address."""
RAY_TIMEOUT = 60.0
"""How long a call on an actor, or the placement group's reservation, may take (seconds)."""
NODE_HOST = "ray-node.invalid"
"""The host the launcher writes in a task's addresses (its command line, its ``DISTSGD_TASK``):
the actor puts its node's address in its place, so a server binds there and a worker's
collective data plane listens there (``.invalid`` is a name no resolver answers)."""
READ_WAIT = 1.0
"""How long one read of a task's output waits on its node for a line (a long poll: fewer calls
through Ray than polling on a timer)."""
RAY_LOG = "ray-start.log"
"""The local instance's ``ray start`` output, in the run's logs (its first line: its folder)."""


def import_ray() -> Any:
    """The ``ray`` module, or a one-line ValueError naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise ValueError(
            "--ray needs Ray: pip install 'distsgd[ray]' (or pip install ray)"
        ) from None
    return ray


class LocalRay:
    """A Ray instance of this launcher's own, on 127.0.0.1: ``ray start --head --block`` in its
    own session (its process group is ours to end), watched by a reaper.

    Its files are in a folder only this user may enter, ``/tmp/dray-*`` (0700, made by
    ``mkdtemp``): the token, and Ray's temporary folder ``r`` inside it, which Ray makes
    world-writable (0777, no sticky bit) but no other user can reach. ``log``: where ``ray
    start`` writes its output (the run's logs, so it outlives the instance); its first line
    names the folder. A failed or interrupted start leaves nothing; :meth:`close` removes it
    all, and the reaper does if the launcher dies."""

    def __init__(self, *, cpus: int, gpus: int, log: Path, timeout: float = RAY_TIMEOUT) -> None:
        # a short path: Ray's socket paths under it must fit in 107 bytes
        self.scratch = Path(tempfile.mkdtemp(prefix="dray-", dir="/tmp"))
        """This instance's own folder (0700): the token and Ray's temporary folder."""
        self.temp_dir = str(self.scratch / "r")
        """Ray's ``--temp-dir`` (Ray makes it 0777; the folder above keeps others out)."""
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None
        self.reaper: subprocess.Popen[bytes] | None = None
        try:
            self._start(cpus, gpus)
            self.address = self._wait_for_address(timeout)
        except BaseException:
            self.close()
            raise

    def _start(self, cpus: int, gpus: int) -> None:
        # Ray's token authentication, with a token of this run's (not ~/.ray/auth_token)
        token = self.scratch / "auth_token"
        with os.fdopen(open_private(token, os.O_WRONLY | os.O_EXCL), "w") as out:
            out.write(secrets.token_hex(32))
        self.auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
        """What a driver of this instance needs in its environment to authenticate."""
        env = {**os.environ, LOOPBACK_ENV: "0", "RAY_USAGE_STATS_ENABLED": "0", **self.auth}
        argv = [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
            "--port=0", f"--num-cpus={cpus}", f"--num-gpus={gpus}", "--include-dashboard=false",
            "--disable-usage-stats", f"--temp-dir={self.temp_dir}",
        ]  # fmt: skip
        with os.fdopen(open_private(self.log, os.O_WRONLY | os.O_APPEND), "wb") as out:
            out.write(f"# ray start of this run's local instance, in {self.scratch}\n".encode())
            out.flush()
            self.process = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        reaper = [sys.executable, "-m", "distsgd.launcher.reaper", str(self.process.pid)]
        self.reaper = subprocess.Popen(
            [*reaper, str(self.scratch)],
            env={**os.environ, PARENT_ENV: str(os.getpid())},
            stdin=subprocess.DEVNULL,
        )

    def _wait_for_address(self, timeout: float) -> str:
        assert self.process is not None
        current = Path(self.temp_dir) / "ray_current_cluster"
        deadline = time.monotonic() + timeout
        while not (current.is_file() and current.read_text().strip()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace").strip().splitlines()[1:][-3:]
                raise ValueError(
                    f"--ray: the local Ray instance did not start within {timeout:.0f}s "
                    f"({' / '.join(tail) or 'no output'}); see {self.log}"
                )
            time.sleep(0.1)
        return current.read_text().strip()

    def close(self) -> None:
        """End the instance's whole process group (SIGTERM, then SIGKILL), and its reaper;
        remove its folder. Also after a start that failed part way."""
        if self.process is not None:
            end_group(self.process.pid)
            self.process.wait()
        if self.reaper is not None:
            with contextlib.suppress(ProcessLookupError):
                self.reaper.kill()
            self.reaper.wait()
        remove(str(self.scratch))


class TaskRunner:
    """The actor's body: one task process on the actor's node (Ray makes this a remote class)."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.lines: list[str] = []
        self.lock = threading.Condition()
        self.reader: threading.Thread | None = None

    def start(
        self, argv: Sequence[str], env: Mapping[str, str], secret: str | None = None
    ) -> tuple[int, str]:
        """Start the task (its own session, tied to this actor); (pid, node address). The run
        ``secret`` goes into the task's environment: its file is on the launcher's machine,
        which this node need not share."""
        import ray

        node = str(ray.util.get_node_ip_address())
        argv = [arg.replace(NODE_HOST, node) for arg in argv]
        child_env = {k: v.replace(NODE_HOST, node) for k, v in env.items()}
        child_env[PARENT_ENV] = str(os.getpid())
        if secret is not None:
            child_env.pop(SECRET_FILE_ENV, None)
            child_env[SECRET_ENV] = secret
        if "CUDA_VISIBLE_DEVICES" in os.environ:  # the GPUs Ray gave this actor, if any
            child_env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
        self.process = subprocess.Popen(
            list(argv),
            env=child_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self.process.pid, node

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for raw in iter(self.process.stdout.readline, b""):
            with self.lock:
                self.lines.append(raw.decode(errors="replace"))
                self.lock.notify_all()
        with self.lock:
            self.lock.notify_all()  # the output ended: a waiting read answers now

    def read(self, start: int, wait: float = 0.0) -> tuple[list[str], int | None]:
        """The output lines from ``start`` on, and the exit code once the process exited and
        every line was read (None while it runs). With no line yet, waits up to ``wait``
        seconds for one (a long poll: the launcher asks again at once, not on a timer)."""
        assert self.process is not None
        with self.lock:
            self.lock.wait_for(lambda: len(self.lines) > start or not self._reading(), timeout=wait)
        code = self.process.poll()
        if code is not None and self.reader is not None:
            self.reader.join(timeout=2.0)
        with self.lock:
            lines = self.lines[start:]
        return lines, code

    def _reading(self) -> bool:
        return self.reader is not None and self.reader.is_alive()

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the task's process group (the group we created, by its PID)."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signum)

    def stop(self, grace: float) -> int | None:
        """SIGTERM, then after ``grace`` seconds SIGKILL to the task's group; its exit code."""
        if self.process is None:
            return None
        self.signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # stragglers in its group too
        return self.process.wait()


@dataclass
class RayTask:
    """One task started by an actor: what the launcher reads of a task (name, pid, poll, tail,
    log), plus kill for ``--inject-fault``."""

    name: str
    actor: Any
    pid: int
    node: str
    log_path: Path
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=20))
    code: int | None = None
    reader: threading.Thread | None = None
    gone: threading.Event = field(default_factory=threading.Event)

    def poll(self) -> int | None:
        return self.code

    def kill(self) -> None:
        """SIGKILL the task's process group on its node (its actor stays, as a parent would)."""
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM to the task's process group on its node."""
        self._signal(signal.SIGTERM)

    def interrupt(self) -> None:
        """SIGINT to the task's process group on its node (stop and save)."""
        self._signal(signal.SIGINT)

    def _signal(self, signum: signal.Signals) -> None:
        import ray

        ray.get(self.actor.signal.remote(int(signum)), timeout=RAY_TIMEOUT)


class RaySupervisor:
    """Owns the tasks of one run as actors in a placement group of one bundle per task.

    ``address``: a running Ray cluster ("auto", "ray://...", "host:port"); "" starts a local
    instance on 127.0.0.1 with ``cpus`` CPUs. ``bundles``: task name -> its resources.
    ``spread``: the servers each on a node of their own where the cluster has enough nodes,
    the workers spread over the nodes (two placement groups); else every task on one node.
    """

    node_host = NODE_HOST
    """What the tasks' addresses say for their host: each task binds its node's address."""

    def __init__(
        self,
        *,
        log_dir: Path,
        echo: Callable[[str], None],
        address: str,
        bundles: Mapping[str, Mapping[str, float]],
        spread: bool = True,
    ) -> None:
        self.log_dir = log_dir
        self.echo = echo
        self.tasks: dict[str, RayTask] = {}
        self.groups: list[Any] = []
        self.index: dict[str, tuple[Any, int]] = {}
        """Each task's placement group and bundle in it."""
        self.local: LocalRay | None = None
        if importlib.util.find_spec("ray") is None:
            import_ray()  # raises the one-line error naming the extra
        try:  # from here on, an error or Ctrl-C leaves nothing (the local instance closed)
            if not address:
                address = self._start_local(bundles)
            self.ray = ray = import_ray()
            if ray.is_initialized():
                raise ValueError("--ray: Ray is already initialised in this process")
            ray.init(address=address, log_to_driver=False, configure_logging=False)
            self.control_host: str | None = str(ray.util.get_node_ip_address())
            """The driver's node address: tasks on any node reach its run control there."""
            self.machines = len(self._alive())
            """The cluster's nodes alive at the start (two or more: log replicas)."""
            for names, strategy in self._plan(bundles, spread):
                self._reserve({n: bundles[n] for n in names}, strategy)
            self._remote = ray.remote(TaskRunner)
            self._ready = {name: self._actor(name) for name in bundles}
            """An actor per task, made now, all at once (Ray starts their processes while the
            launcher does the rest): the tasks then start together, not one actor apart."""
        except BaseException:
            self.close()
            raise

    def _alive(self) -> list[str]:
        """The IDs of the cluster's nodes alive now, sorted."""
        return sorted(str(n["NodeID"]) for n in self.ray.nodes() if n.get("Alive"))

    def _away_from_server(self, name: str) -> Any:
        """Where log replica ``name`` (``replicaI``) goes: the node after the one ``psI``'s
        bundle is on now, among those alive (so the replicas of several servers spread)."""
        from ray.util.placement_group import placement_group_table
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        group, bundle = self.index["ps" + name.removeprefix("replica")]
        server = placement_group_table(group)["bundles_to_node_id"].get(bundle)
        alive = self._alive()
        after = alive.index(server) + 1 if server in alive else 0
        others = [n for n in alive[after:] + alive[:after] if n != server] or alive
        return NodeAffinitySchedulingStrategy(node_id=others[0], soft=False)

    def _plan(
        self, bundles: Mapping[str, Mapping[str, float]], spread: bool
    ) -> list[tuple[list[str], str]]:
        """The placement groups to reserve: (task names, Ray's strategy) each."""
        if not spread:
            return [(list(bundles), "STRICT_PACK")]
        servers = [n for n in bundles if n.startswith("ps")]
        workers = [n for n in bundles if n not in servers]
        nodes = len(self._alive())
        own = "STRICT_SPREAD" if 2 <= len(servers) <= nodes else "SPREAD"
        if len(servers) > nodes > 1:
            log.warning("%d servers on %d nodes: some share a node", len(servers), nodes)
        return [(names, s) for names, s in ((servers, own), (workers, "SPREAD")) if names]

    def _reserve(self, bundles: Mapping[str, Mapping[str, float]], strategy: str) -> None:
        """One placement group of ``bundles`` by ``strategy``, waited for."""
        from ray.util.placement_group import placement_group

        group = placement_group([dict(b) for b in bundles.values()], strategy=strategy, name="")
        self.groups.append(group)
        if not group.wait(timeout_seconds=RAY_TIMEOUT):
            where = "on one node" if strategy == "STRICT_PACK" else "on the cluster"
            raise ValueError(
                f"--ray: the cluster could not reserve {len(bundles)} tasks' resources {where} "
                f"within {RAY_TIMEOUT:.0f}s ({self._wanted(bundles)}); give the cluster more "
                "CPUs, or run fewer tasks (--workers, --ps)"
            )
        self.index.update({name: (group, i) for i, name in enumerate(bundles)})

    def _start_local(self, bundles: Mapping[str, Mapping[str, float]]) -> str:
        """Start this run's local instance with the bundles' CPUs and GPUs; its address."""
        cpus = sum(b.get("CPU", 0.0) for b in bundles.values())
        gpus = sum(b.get("GPU", 0.0) for b in bundles.values())
        private_dir(self.log_dir)
        self.local = LocalRay(
            cpus=max(1, int(cpus + 0.999)), gpus=int(gpus + 0.999), log=self.log_dir / RAY_LOG
        )
        # Read when ray is imported: this driver, too, stays on 127.0.0.1 and presents the
        # instance's token.
        os.environ.update({LOOPBACK_ENV: "0", **self.local.auth})
        return self.local.address

    @staticmethod
    def _wanted(bundles: Mapping[str, Mapping[str, float]]) -> str:
        totals: dict[str, float] = collections.defaultdict(float)
        for bundle in bundles.values():
            for key, value in bundle.items():
                totals[key] += value
        return ", ".join(f"{v:g} {k}" for k, v in totals.items())

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str]) -> RayTask:
        """Start task ``name`` by a new actor in its bundle (a log replica: on a node away
        from its server's). An actor that dies before it started the task (its node lost
        meanwhile, the bundle not yet placed again) is replaced, until :data:`RAY_TIMEOUT`."""
        old = self.tasks.get(name)
        if old is not None:  # a restart: its bundle is free once the old actor is gone
            self._kill_actor(old)
        private_dir(self.log_dir)
        secret = load_secret(env) if SECRET_FILE_ENV in env else None
        deadline = time.monotonic() + RAY_TIMEOUT
        while True:
            actor = self._ready.pop(name, None) or self._actor(name)
            try:
                started = actor.start.remote(list(argv), dict(env), secret)
                pid, node = self.ray.get(started, timeout=RAY_TIMEOUT)
                break
            except self.ray.exceptions.ActorDiedError as exc:
                with contextlib.suppress(Exception):
                    self.ray.kill(actor, no_restart=True)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: no node could start it ({exc})") from None
                log.info("%s: its actor died before it started (%s); again", name, exc)
                time.sleep(1.0)
        task = RayTask(
            name=name, actor=actor, pid=pid, node=node, log_path=self.log_dir / f"{name}.log"
        )
        task.reader = threading.Thread(target=self._relay, args=(task,), name=f"relay-{name}")
        task.reader.daemon = True
        task.reader.start()
        self.tasks[name] = task
        log.debug("started %s on %s as pid %d", name, node, pid)
        return task

    def _actor(self, name: str) -> Any:
        """A new actor for task ``name``, in its bundle or (a log replica) on a node away
        from its server's."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy: Any
        if name in self.index:
            group, bundle = self.index[name]
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=bundle
            )
            resources = group.bundle_specs[bundle]
        else:  # a log replica: no bundle of its own, on a node its server's is not on
            strategy, resources = self._away_from_server(name), {}
        return self._remote.options(
            name=None,
            num_cpus=resources.get("CPU", 0),
            num_gpus=resources.get("GPU", 0),
            max_restarts=0,
            max_concurrency=4,  # a signal or stop is not queued behind a waiting read
            scheduling_strategy=strategy,
        ).remote()

    def _relay(self, task: RayTask) -> None:
        """Fetch the task's output into its log, the console and its tail, until it exits."""
        got = 0
        fd = open_private(task.log_path, os.O_WRONLY | os.O_APPEND)
        with os.fdopen(fd, "a", encoding="utf-8") as log_file:
            while not task.gone.is_set():
                try:
                    lines, code = self.ray.get(
                        task.actor.read.remote(got, READ_WAIT), timeout=RAY_TIMEOUT
                    )
                except Exception as exc:  # the actor died (node lost, killed): the task with it
                    log.debug("%s: actor gone: %s", task.name, exc)
                    task.code = -int(signal.SIGKILL) if task.code is None else task.code
                    return
                for line in lines:
                    log_file.write(line)
                    text = line.rstrip("\n")
                    task.tail.append(text)
                    self.echo(f"[{task.name}] {text}")
                log_file.flush()
                got += len(lines)
                if code is not None and not lines:
                    task.code = code
                    return
                if not lines:
                    time.sleep(0.1)

    def _kill_actor(self, task: RayTask) -> None:
        task.gone.set()
        with contextlib.suppress(Exception):
            self.ray.kill(task.actor, no_restart=True)

    def stop(self, names: Sequence[str] | None = None, *, grace: float = 2.0) -> None:
        """End the named tasks (default: all): SIGTERM, SIGKILL after ``grace``, then their
        actors."""
        tasks = [self.tasks[n] for n in names] if names is not None else list(self.tasks.values())
        pending = {task.name: task.actor.stop.remote(grace) for task in tasks if task.code is None}
        for task in tasks:
            ref = pending.get(task.name)
            if ref is not None:
                with contextlib.suppress(Exception):
                    code = self.ray.get(ref, timeout=grace + RAY_TIMEOUT)
                    if task.reader is not None:
                        task.reader.join(timeout=2.0)
                    if task.code is None:
                        task.code = code
            self._kill_actor(task)
            if task.code is None:
                task.code = -int(signal.SIGKILL)

    def forget(self) -> None:
        self.tasks.clear()

    def prepare(self, env: Mapping[str, str]) -> None:
        """Nothing to start ahead: Ray's workers have their own processes."""

    def close(self) -> None:
        """Stop every task, remove the placement group, and leave Ray (shutting down the
        instance this launcher started)."""
        with contextlib.suppress(Exception):
            if self.tasks:
                self.stop()
        for actor in getattr(self, "_ready", {}).values():  # made, never used
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
        for group in self.groups:
            with contextlib.suppress(Exception):
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(group)
        with contextlib.suppress(Exception):
            self.ray.shutdown()
        if self.local is not None:
            self.local.close()


def _start(config: LaunchConfig, run_dir: Path, console: Console) -> RaySupervisor:
    """One bundle of resources per task, reserved for the run's largest size (an elastic run
    that scales up then needs no new reservation)."""
    bundles = {f"ps{i}": {"CPU": 1.0} for i in range(config.num_ps)}
    worker: dict[str, float] = {"CPU": float(config.threads_per_worker)}
    if config.device.startswith("cuda"):  # auto: a GPU only where Ray gives one anyway
        worker["GPU"] = 1.0
    bundles.update({f"worker{i}": dict(worker) for i in range(config.size.highest_workers)})
    where = config.hosting.ray or "a local Ray instance (127.0.0.1)"
    console.note(f"[distsgd] tasks as Ray actors on {where}")
    return RaySupervisor(
        log_dir=run_dir / "logs",
        echo=console.line,
        address=config.hosting.ray or "",
        bundles=bundles,
        spread=config.hosting.placement == "spread",
    )


ENGINE = Engine(name="Ray", flag="--ray", places_tasks=True, assigns_devices=True, start=_start)
