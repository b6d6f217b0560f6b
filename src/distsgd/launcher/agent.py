"""``distsgd agent``: one per machine of a cluster started by hand, as torchrun's per-node agent.

The agent starts this machine's tasks (``--tasks ps:0,worker:1``) with the command lines of
``distsgd server`` and ``distsgd worker`` that a user would type, relays their output with a
prefix, writes each task's log under its folder (``--dir``, default ``./distsgd-agent``), gives
each task a thread budget as ``distsgd run`` does (a server one, the workers the cores left,
shared out, or ``$DISTSGD_THREADS`` each), and restarts a task that dies, in place, as the
restart planner decides for tasks restarted in place
(:func:`~distsgd.control.recovery.plan_restart` with ``in_place``: the planner the local
launcher and the JobSet emulator drive too):

* a server comes back from its write-ahead log in ``DIR/wal/psJ`` on this machine's disk, or
  from its newest shard file, at the same address;
* a worker of a parameter-server scheme comes back with ``--resume-latest`` (its newest state
  under its ``--run-dir``, when it checkpoints) and continues where the servers say its pushes
  stopped; a worker of a collective scheme cannot rejoin its group alone: the run fails, as it
  would without the agent;
* after ``--max-restarts`` in a row (a task that ran ``--healthy-seconds`` gets them back) the
  agent stops its tasks and exits 1 naming the task and its log.

Nothing is shared between machines but the network: each agent knows only the cluster spec,
the run secret (``DISTSGD_SECRET_FILE``) and its own tasks. A machine that is lost takes its
agent and tasks with it; under an asynchronous scheme the other workers go on and the servers
evict the lost worker after ``--evict-after`` seconds (the run shrinks); under ``sync`` the
steps close without it after the step timeout. The agent ends when its workers have finished
and its servers say the run is over (no live member, and no pull or push for 10 s: the chief
has its final parameters), stopping its servers;
SIGINT or SIGTERM stops every task it started (by PID) and exits 130 or 143.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from distsgd.cluster import ClusterSpec, Role, TaskId
from distsgd.control.outcome import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_TERMINATED
from distsgd.control.recovery import (
    Drop,
    Finished,
    NothingStored,
    RestartBudget,
    RunTopology,
    Stop,
    TaskFailure,
    failure_kind,
    plan_restart,
)
from distsgd.launcher.errors import Interrupted, RunFailed
from distsgd.launcher.lifeline import PARENT_ENV, shared_cores, thread_env
from distsgd.launcher.progress import Console
from distsgd.launcher.supervisor import Supervisor, TaskHandle
from distsgd.launcher.tasks import write_tasks
from distsgd.transport.security import TlsConfig
from distsgd.util import private_dir, write_atomic
from distsgd.util.signals import stopping

log = logging.getLogger(__name__)

USAGE_EXIT = 2
"""A task's exit code for a mistake in its command line (``distsgd: error: ...``)."""
LISTEN_SECONDS = 60.0
QUIET_SECONDS = 10.0
"""How long a server with no live member must see no pull or push before the run is over."""
POLL_SECONDS = 0.25
OVER_POLL_SECONDS = 1.0


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """What one machine's agent runs."""

    tasks: tuple[TaskId, ...]
    """This machine's tasks, servers first."""
    spec: ClusterSpec
    """The run's cluster (every task's address)."""
    cluster_args: tuple[str, ...]
    """The flags that give every task the cluster (``--cluster FILE`` or the host lists)."""
    worker_args: tuple[str, ...] = ()
    """What follows ``distsgd worker --task I`` for each worker: scheme, training flags, the
    script and its arguments."""
    folder: Path = Path("distsgd-agent")
    """This machine's folder: ``logs/``, ``wal/psJ`` (the servers' logs) and ``checkpoints/``
    (the servers' shard files)."""
    collective: bool = False
    """The workers' scheme trains with an all-reduce (a dead worker stops the run)."""
    resume_workers: bool = False
    """The workers keep a run folder (``--run-dir``): a restarted one resumes from its newest
    state there (``--resume-latest``)."""
    max_restarts: int = 3
    """Restarts of a task in a row before the agent gives up."""
    healthy_seconds: float = 60.0
    """A task that ran this long since its start has its restarts back."""
    evict_after: float = 60.0
    """The servers evict a worker silent this long (a lost machine's)."""
    tls: TlsConfig | None = None
    """Mutual TLS for the agent's calls to its servers (the tasks get the same flags)."""
    secret: str | None = None
    """The run secret, for the agent's calls to its servers."""
    python: tuple[str, ...] = field(default_factory=lambda: (sys.executable, "-m", "distsgd"))
    """How a task's command line starts."""

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("--tasks: give this machine's tasks, e.g. --tasks ps:0,worker:1")
        for task in self.tasks:
            self.spec.address(task)  # ClusterSpecError naming the task and the fix
        if len(set(self.tasks)) != len(self.tasks):
            raise ValueError("--tasks names a task twice; give each of this machine's once")
        if self.max_restarts < 0 or self.healthy_seconds <= 0 or self.evict_after <= 0:
            raise ValueError(
                "--max-restarts must be 0 or more, --healthy-seconds and --evict-after above 0"
            )
        if any(t.job == Role.WORKER for t in self.tasks) and not self.worker_args:
            raise ValueError(
                "a worker needs its script: distsgd agent --tasks ... -- --scheme S train.py"
            )


def address_file(config: AgentConfig, task: TaskId) -> Path:
    return config.folder / f"{task.name}.address"


def task_argv(
    config: AgentConfig,
    task: TaskId,
    *,
    again: bool,
    cluster: Sequence[str] | None = None,
    address: str | None = None,
) -> list[str]:
    """The command line of ``task`` (``again``: a restart, from its own newest state);
    ``cluster``: the flags giving the cluster (default the agent's); ``address``: where a
    server listens (default its address in the spec)."""
    cluster = config.cluster_args if cluster is None else cluster
    if task.job == Role.PS:
        argv = [
            *config.python, "server", "--job", "ps", "--task", str(task.index), *cluster,
            "--wal-dir", str(config.folder / "wal" / task.name),
            "--checkpoint-dir", str(config.folder / "checkpoints"),
            "--evict-after", f"{config.evict_after:g}",
            "--address-file", str(address_file(config, task)),
            *(["--address", address] if address else []),
        ]  # fmt: skip
        return [*argv, *(["--restore-latest"] if again else []), *_tls_args(config.tls)]
    argv = [*config.python, "worker", "--task", str(task.index), *cluster]
    again_flag = ["--resume-latest"] if again and config.resume_workers else []
    return [*argv, *_tls_args(config.tls), *again_flag, *config.worker_args]


def _tls_args(tls: TlsConfig | None) -> list[str]:
    if tls is None:
        return []
    return ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--tls-ca", str(tls.ca)]


class Agent:
    """Runs one machine's tasks until the run is over (:meth:`run`)."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        echo: Callable[[str], None],
        note: Callable[[str], None],
        run_over: Callable[[str], bool],
    ) -> None:
        self.config = config
        self.note = note
        self.run_over = run_over
        """Whether the server at an address says the run is over (:class:`RunEnd`)."""
        self.stop = threading.Event()
        self.supervisor = Supervisor(log_dir=config.folder / "logs", echo=echo, note=note)
        env = {**os.environ, PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"}
        workers = sum(task.job == Role.WORKER for task in config.tasks)
        given = os.environ.get("DISTSGD_THREADS", "")  # the user's own budget stands
        threads = int(given) if given.isdigit() and int(given) > 0 else 0
        threads = threads or shared_cores(workers, len(config.tasks) - workers)
        self.envs = {  # each task's thread budget, as `distsgd run` gives its tasks
            Role.WORKER: {**env, **thread_env(threads)},
            Role.PS: {**env, **thread_env(1)},
        }
        self.restarts: dict[str, int] = {}
        self.started_at: dict[str, float] = {}
        self.done: set[str] = set()
        self._next_ask = 0.0
        self.bound: dict[str, str] = {}
        """Each port-0 server's address once it listens (it restarts there)."""
        self.cluster_args = config.cluster_args
        self.spec = config.spec

    def _start(self, task: TaskId, *, again: bool = False) -> TaskHandle:
        self.started_at[task.name] = time.monotonic()
        if task.job == Role.PS:
            address_file(self.config, task).unlink(missing_ok=True)
        argv = task_argv(
            self.config,
            task,
            again=again,
            cluster=self.cluster_args,
            address=self.bound.get(task.name),
        )
        handle = self.supervisor.start(task.name, argv, self.envs[task.job])
        write_tasks(self.config.folder, self.supervisor)  # DIR/tasks.json: every task's PID
        return handle

    def _bind_servers(self) -> None:
        """Servers at port 0 in the spec: once each listens, its workers here get a cluster
        file with the real address (``DIR/cluster.json``), and a restart keeps the port."""
        spec = self.config.spec
        for task in self.config.tasks:
            if task.job != Role.PS or not spec.address(task).endswith(":0"):
                continue
            handle = self.supervisor.tasks[task.name]
            path = address_file(self.config, task)
            deadline = time.monotonic() + LISTEN_SECONDS
            while not path.exists():
                if handle.poll() is not None or time.monotonic() > deadline:
                    raise RunFailed(f"{task.name} did not listen (its log: {handle.log_path})")
                if self.stop.wait(0.05):
                    raise Interrupted
            self.bound[task.name] = path.read_text().strip()
            spec = spec.with_address(task, self.bound[task.name])
        if self.bound:
            cluster = self.config.folder / "cluster.json"
            write_atomic(cluster, json.dumps(spec.to_dict()) + "\n")
            self.cluster_args = ("--cluster", str(cluster))
            self.spec = spec

    def run(self) -> int:
        """Start the tasks and watch them; 0 once the run is over (RunFailed, Interrupted)."""
        try:
            private_dir(self.config.folder)
            servers = [t for t in self.config.tasks if t.job == Role.PS]
            for task in servers:  # first: the workers find them at once
                self._start(task)
            self._bind_servers()
            for task in self.config.tasks:
                if task.job == Role.WORKER:
                    self._start(task)
            self.note(
                f"[agent] started {', '.join(t.name for t in self.config.tasks)}; logs in "
                f"{self.config.folder / 'logs'}"
            )
            while not self._over():
                if self.stop.wait(POLL_SECONDS):
                    raise Interrupted
                for task in self.config.tasks:
                    self._check(task)
            names = [t.name for t in servers]
            stopping = f"; stopping {', '.join(names)}" if names else ""
            self.note(f"[agent] the run is over{stopping}")
            return 0
        finally:
            self.supervisor.close()

    def _check(self, task: TaskId) -> None:
        handle = self.supervisor.tasks.get(task.name)
        code = None if handle is None else handle.poll()
        if code is None or task.name in self.done:
            return
        if code == 0:
            self.done.add(task.name)
            self.note(f"[agent] {task.name} finished")
            return
        assert handle is not None
        if code == USAGE_EXIT:  # its command line is wrong: a restart would say the same
            said = handle.tail[-1] if handle.tail else "nothing"
            raise RunFailed(
                f"{task.name} refused its command line (exit code 2: {said}); fix the agent's "
                f"arguments (full log: {handle.log_path})"
            )
        budget = RestartBudget(
            used=self.restarts.get(task.name, 0),
            max_restarts=self.config.max_restarts,
            ran_seconds=time.monotonic() - self.started_at.get(task.name, 0.0),
            healthy_seconds=self.config.healthy_seconds,
        )
        run = RunTopology(
            collective=self.config.collective, workers=1, min_workers=1, in_place=True
        )
        failure = TaskFailure(task=task, exit_code=code, kind=failure_kind(code))
        plan = plan_restart(failure, run, NothingStored(), budget)
        if isinstance(plan, (Finished, Drop)):  # a Drop: the run goes on without it
            self.done.add(task.name)
            return
        alone = self.config.collective and task.job == Role.WORKER  # its group cannot re-form
        if isinstance(plan, Stop) or alone:
            tail = "\n".join(f"    {line}" for line in tuple(handle.tail)[-5:])
            why = plan.reason.replace("_", " ") if isinstance(plan, Stop) else "collective"
            raise RunFailed(
                f"{task.name} exited with code {code} ({why}); its last log lines:\n{tail}\n"
                f"full log: {handle.log_path}",
                reason=f"{task.name} exited with code {code}",
            )
        self.restarts[task.name] = plan.attempt
        self.note(
            f"[agent] {task.name} died (exit code {code}); restart {plan.attempt} of "
            f"{self.config.max_restarts} in {plan.backoff:.1f}s"
        )
        if self.stop.wait(plan.backoff):
            raise Interrupted
        self._start(task, again=True)

    def _over(self) -> bool:
        """This machine's workers have all finished, and its servers (if any) say the run is
        over; asked of the servers at most once a second."""
        if any(t.job == Role.WORKER and t.name not in self.done for t in self.config.tasks):
            return False
        servers = [
            t for t in self.config.tasks if t.job == Role.PS and t.name not in self.done
        ]  # a server that ended by itself (stopped) has nothing more to say
        now = time.monotonic()
        if not servers or now < self._next_ask:
            return not servers
        self._next_ask = now + OVER_POLL_SECONDS
        return all(self.run_over(self.spec.address(t)) for t in servers)


def parse_tasks(text: str) -> tuple[TaskId, ...]:
    """``ps:0,worker:1`` -> the tasks, servers first; ValueError naming the form."""
    try:
        tasks = [TaskId.parse(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"--tasks {text!r}: {exc}") from None
    return tuple(sorted(tasks, key=lambda t: (t.job != Role.PS, t.index)))


@dataclass
class RunEnd:
    """Whether a server says the run is over: its shard registered, no live member left, at
    least one worker finished, and no pull or push for :attr:`quiet` seconds since (the chief
    pulls the final parameters after the last member left, a lost one's eviction included)."""

    secret: str | None
    tls: TlsConfig | None
    quiet: float = QUIET_SECONDS
    _seen: dict[str, tuple[tuple[int, int], float]] = field(default_factory=dict)

    def __call__(self, address: str) -> bool:
        from distsgd.launcher.servers import read_info

        reply = read_info(address, run_id="", secret=self.secret, tls=self.tls)
        now = time.monotonic()
        if (
            reply is None
            or not reply.registered
            or reply.members
            or not reply.finished_workers
            or not reply.membership_epoch  # restored from a file: its members forgotten
        ):
            self._seen.pop(address, None)
            return False
        counts = (int(reply.load.pulls), int(reply.load.pushes))
        seen = self._seen.get(address)
        if seen is None or seen[0] != counts:
            self._seen[address] = (counts, now)
            return False
        return now - seen[1] >= self.quiet


def run_agent(config: AgentConfig, console: Console | None = None) -> int:
    """Run ``config``'s agent in this process until the run is over (the CLI's ``distsgd
    agent``): 0, 1 if a task could not be kept running, 130 or 143 after SIGINT or SIGTERM."""
    console = console or Console()
    agent = Agent(
        config,
        echo=console.line,
        note=console.note,
        run_over=RunEnd(secret=config.secret, tls=config.tls),
    )
    caught: list[int] = []
    with stopping(agent.stop, caught):
        try:
            return agent.run()
        except Interrupted:
            stopped = len(agent.supervisor.tasks)
            console.final(f"distsgd agent: interrupted; stopped {stopped} tasks")
            return EXIT_TERMINATED if caught[:1] == [signal.SIGTERM] else EXIT_INTERRUPTED
        except RunFailed as exc:
            console.error(f"distsgd agent: error: {exc}")
            return EXIT_FAILED
