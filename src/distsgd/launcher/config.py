"""What ``distsgd run`` starts: a typed, validated description of a local run.

:class:`LaunchConfig` is the run (script, scheme, training settings) and three records of its
own concerns, each checked where it is made: :class:`ClusterSize` (how many tasks),
:class:`Durability` (checkpoints, logs, restarts) and :class:`Hosting` (where and how the
tasks run)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from distsgd import schemes
from distsgd.cluster import Role, TaskId
from distsgd.control.config import TrainConfig, lr_multiplier
from distsgd.control.faults import Fault
from distsgd.control.folder import RESULT_FILE, new_run_folder, runs_root
from distsgd.control.rollback import MAX_ROLLBACKS
from distsgd.control.spec import RunSpec, WorkerBounds, check_worker_bounds
from distsgd.launcher.emulated import check_hosts
from distsgd.launcher.engines import engine_for
from distsgd.launcher.lifeline import shared_cores
from distsgd.launcher.metrics_endpoint import DEFAULT_ADDRESS as DEFAULT_METRICS_ADDRESS
from distsgd.launcher.metrics_endpoint import OFF as METRICS_OFF
from distsgd.launcher.metrics_endpoint import parse_address
from distsgd.transport.security import TlsConfig

DEMO_SCRIPT = Path(__file__).resolve().parents[1] / "demo" / "digits.py"
DEMO_SCRIPTS = {"digits": DEMO_SCRIPT, "lm": DEMO_SCRIPT.with_name("lm.py")}
"""``distsgd demo --model``'s scripts: the digits CNN, and the small GPT on bundled text."""
"""The bundled demo's training script (``distsgd demo``)."""

DEFAULT_CHECKPOINT_SECONDS = 30.0
"""Checkpoint cadence when none is given: a restart costs at most this much of a task's work."""
DEFAULT_MAX_RESTARTS = 3
"""Restarts per task in a row when none is given (fault tolerance is on by default)."""
FORK_SERVER_DEFAULT = sys.platform.startswith("linux") and hasattr(os, "fork")
"""Whether workers are forked from a fork server by default: on Linux (elsewhere, forking a
process that has loaded torch and system frameworks is not safe, and there is no
parent-death signal)."""
DOCTOR_AFTER = 60.0
"""``--doctor-after``'s default: seconds without progress before the launcher's own doctor."""
PLACEMENTS = ("spread", "pack")
"""``--placement``'s choices: how tasks go on emulated hosts, or on a Ray cluster's nodes."""


@dataclass(frozen=True, kw_only=True)
class ClusterSize(WorkerBounds):
    """How many tasks a run has: its workers (fixed, or elastic between two bounds) and
    parameter servers, and how long a silent worker stays a member."""

    workers: int = field(default=2, metadata={"help": "number of worker tasks"})
    ps: int | None = field(
        default=None,
        metadata={"help": "parameter-server tasks (default 1, or 0 for collective schemes)"},
    )
    min_workers: int = field(
        default=0,
        metadata={
            "help": "fewest workers an elastic run goes on with (distsgd elastic scale's lower "
            "bound; a worker out of restarts is dropped while this many remain); 0 = --workers"
        },
    )
    max_workers: int = field(
        default=0,
        metadata={
            "help": "most workers an elastic run may grow to (distsgd elastic scale); 0 = --workers"
        },
    )
    evict_after: float = field(
        default=0.0,
        metadata={
            "help": "seconds a silent worker stays a member before the servers evict it "
            "(0 = the servers' default, 60)"
        },
    )

    def __post_init__(self) -> None:
        """The worker counts of a fixed or elastic run (the run spec's check), --evict-after
        and --ps."""
        check_worker_bounds(
            workers=self.workers, min_workers=self.min_workers, max_workers=self.max_workers
        )
        if self.evict_after < 0:
            raise ValueError(
                f"--evict-after must be 0 (the default) or more, got {self.evict_after}"
            )
        if self.ps is not None and self.ps < 0:
            raise ValueError(f"--ps must be 0 or more, got {self.ps}")


@dataclass(frozen=True, kw_only=True)
class Durability:
    """What a run keeps to survive a failure: checkpoints, the servers' logs, and how often a
    task is restarted or a diverged run rolled back."""

    checkpoint_every: int = field(
        default=0, metadata={"help": "checkpoint every N steps of each worker (0 = by time only)"}
    )
    checkpoint_seconds: float = field(
        default=DEFAULT_CHECKPOINT_SECONDS,
        metadata={"help": "checkpoint every N seconds (0 with checkpoint_every 0 = off)"},
    )
    wal: bool = field(
        default=True,
        metadata={
            "help": "each parameter server logs every update before applying it "
            "(RUN_DIR/wal/psN): a killed one is restarted where it was, losing none"
        },
    )
    replicate: bool = field(
        default=True,
        metadata={
            "help": "with the log, on emulated hosts (hosts of 2 or more): each server's log is "
            "also kept by a replica on the next host, and a push acknowledged once both hold "
            "it: a server whose host and disk are lost comes back from the replica"
        },
    )
    max_restarts: int = field(
        default=DEFAULT_MAX_RESTARTS,
        metadata={
            "help": "restarts allowed per task in a row before the run stops (0 = fail fast); "
            "a task that then runs healthy for healthy_seconds gets them back"
        },
    )
    max_rollbacks: int = field(
        default=MAX_ROLLBACKS,
        metadata={
            "help": "times a diverged run (a loss spike, a NaN) goes back to its last good "
            "checkpoint at half the rate before it stops with exit code 3 (0 = stop at once)"
        },
    )
    healthy_seconds: float = field(
        default=60.0,
        metadata={
            "help": "a task running this long after a restart counts as healthy again: its "
            "restart backoff and budget are reset"
        },
    )
    doctor_after: float = field(
        default=DOCTOR_AFTER,
        metadata={
            "help": "seconds without progress after which the launcher asks every task what it "
            "waits on and names the culprit (distsgd doctor; the report goes to RUN/doctor/); "
            "0 = never by itself"
        },
    )

    def __post_init__(self) -> None:
        if self.doctor_after < 0:
            raise ValueError(
                f"--doctor-after must be 0 (off) or more seconds, got {self.doctor_after}"
            )
        if self.checkpoint_every < 0 or self.checkpoint_seconds < 0:
            raise ValueError("--checkpoint-every must be 0 or more steps (N) or seconds (Ns)")
        for flag, value in (("restarts", self.max_restarts), ("rollbacks", self.max_rollbacks)):
            if value < 0:
                raise ValueError(f"--max-{flag} must be 0 or more, got {value}")


@dataclass(frozen=True, kw_only=True)
class Hosting:
    """Where and how the tasks run: the address they bind, emulated hosts and their links, Ray,
    TLS, torch threads, and whether workers are forked."""

    host: str = field(default="127.0.0.1", metadata={"help": "address tasks bind to"})
    threads: int = field(
        default=0, metadata={"help": "torch threads per worker (0 = cores / workers)"}
    )
    tls: TlsConfig | None = field(default=None, metadata={"help": "mutual TLS for every task"})
    ray: str | None = field(
        default=None,
        metadata={
            "help": "run the tasks as Ray actors: a cluster's address ('auto', 'host:port', "
            "'ray://...'), or '' for a local Ray instance on 127.0.0.1; None: local processes"
        },
    )
    fork_server: bool = field(
        default=FORK_SERVER_DEFAULT,
        metadata={
            "help": "fork each worker from one process that has imported torch once "
            "(launcher/zygote.py) instead of starting a new interpreter: faster starts and "
            "restarts, less CPU; on by default on Linux (parameter servers and Ray tasks are "
            "processes either way); off under --hosts"
        },
    )
    hosts: int = field(
        default=0,
        metadata={
            "help": "place the tasks on N emulated hosts (network namespaces joined by a switch, "
            "distsgd_emulate/netns.py; needs root); each task binds its host's address. "
            "Workers are then started as processes (no fork server). 0: no emulation"
        },
    )
    links: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "--link specs for the emulated hosts' links: RATE[,DELAY[,JITTER]] for "
            "every host (1gbit, 100mbit,5ms), NAME=SPEC for one host or task "
            "(worker1=10mbit); () unshaped"
        },
    )
    placement: str = field(
        default="spread",
        metadata={
            "help": "how tasks go on the emulated hosts: spread (round-robin, servers first) "
            "or pack (contiguous blocks); distsgd_emulate/hosts.py place(). With --ray, over the "
            "cluster's nodes: spread (each server on a node of its own where there are enough, "
            "the workers spread) or pack (every task on one node)"
        },
    )
    metrics_address: str = field(
        default=DEFAULT_METRICS_ADDRESS,
        metadata={
            "help": "where the launcher serves GET /metrics in Prometheus's text format "
            "(HOST:PORT, an IP address or localhost; port 0: a free one; the address it got is "
            "written to RUN_DIR/metrics.address), or 'off'; default loopback, a free port"
        },
    )

    def __post_init__(self) -> None:
        """The checks that need no other record (the task count, the engine and the
        certificate's names are :class:`LaunchConfig`'s)."""
        if self.placement not in PLACEMENTS:
            raise ValueError(f"--placement must be spread or pack, got {self.placement!r}")
        if self.hosts < 0:
            raise ValueError(f"--hosts must be 0 (no emulated hosts) or more, got {self.hosts}")
        if self.fork_server and not FORK_SERVER_DEFAULT:
            raise ValueError(
                "--fork-server on: this platform cannot fork a worker safely (Linux only); "
                "use --fork-server off"
            )
        if self.threads < 0:
            raise ValueError(f"--threads must be 0 or more, got {self.threads}")
        if self.metrics_address != METRICS_OFF:
            parse_address(self.metrics_address)  # ValueError naming the fix


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """A whole cluster on this machine, on free loopback ports."""

    script: str = field(metadata={"help": "the training script (calls distsgd.train)"})
    script_args: tuple[str, ...] = field(default=(), metadata={"help": "arguments for the script"})
    scheme: str = field(default="sync", metadata={"help": "training scheme"})
    scheme_options: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "the scheme's options"}
    )
    overrides: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "TrainConfig fields to override"}
    )
    size: ClusterSize = field(
        default_factory=ClusterSize,
        metadata={"help": "workers (fixed or elastic bounds) and parameter servers"},
    )
    durability: Durability = field(
        default_factory=Durability,
        metadata={"help": "checkpoints, the servers' logs, restarts and rollbacks"},
    )
    hosting: Hosting = field(
        default_factory=Hosting,
        metadata={"help": "where and how tasks run: address, emulated hosts, Ray, TLS, threads"},
    )
    run_dir: Path | None = field(
        default=None, metadata={"help": "run folder (default ./distsgd-runs/<time>-<scheme>)"}
    )
    startup_timeout: float = field(
        default=300.0,
        metadata={"help": "seconds a task may take to start and find the others (imports, ports)"},
    )
    wait_timeout: float = field(
        default=120.0,
        metadata={
            "help": "seconds a task waits for a peer that makes no progress once training runs "
            "(a dead or stuck task), then fails"
        },
    )
    faults: tuple[str, ...] = field(default=(), metadata={"help": "--inject-fault specs"})
    run_id: str = field(default="", metadata={"help": "run id ('' = new; kept on --resume)"})
    resume: bool = field(
        default=False, metadata={"help": "continue the run in run_dir from its last checkpoint"}
    )
    quiet: bool = field(default=False, metadata={"help": "hide task log lines"})
    rebalance: str = field(
        default="off",
        metadata={
            "help": "auto: the launcher moves pieces from a parameter server that carries over "
            "1.2x the mean load (bytes/s) to the least loaded one, at one version and losing "
            "no update (asynchronous schemes, 2 or more servers; ps/moves.py); off: never"
        },
    )

    def __post_init__(self) -> None:
        if Path(self.script).is_dir():
            raise ValueError(
                f"script {self.script} is a folder; give the path of a Python file in it"
            )
        if not Path(self.script).is_file():
            raise ValueError(f"script {self.script} not found; give the path of a Python file")
        uses_ps = self._check_scheme()
        healthy = self.durability.healthy_seconds
        if not (self.startup_timeout > 0 and self.wait_timeout > 0 and healthy > 0):
            raise ValueError(
                "startup_timeout, wait_timeout and healthy_seconds must be positive seconds"
            )
        _check_faults(self)
        if self.resume and self.run_dir is None:
            raise ValueError("--resume needs the run folder to continue")
        _check_hosts(self)
        dynamic = self.overrides.get("world_size", "fixed") == "dynamic"
        if self.size.elastic and uses_ps and not dynamic:
            raise ValueError(
                "--min-workers/--max-workers: workers that join and leave need "
                "--world-size dynamic (the rules count the live members, and the data is "
                "handed out in work units)"
            )

    def _check_scheme(self) -> bool:
        """The scheme, its options for this many workers, --ps and the training flags; returns
        whether the scheme uses parameter servers."""
        spec = schemes.get(self.scheme)
        options = spec.parse_options(self.scheme_options)
        rules = spec.check(options, self.size.workers)  # validates options against the workers
        ps = self.size.ps
        if spec.uses_parameter_servers and ps == 0:
            raise ValueError(f"scheme {self.scheme!r} needs parameter servers; use --ps 1 or more")
        if not spec.uses_parameter_servers and ps:
            raise ValueError(
                f"scheme {self.scheme!r} uses no parameter servers; drop --ps or use --ps 0"
            )
        rules.check_config(TrainConfig().replace(**self.overrides))  # each valid, and here
        self._check_rebalance(spec)
        return spec.uses_parameter_servers

    def _check_rebalance(self, spec: schemes.SchemeSpec) -> None:
        if self.rebalance not in ("off", "auto"):
            raise ValueError(f"--rebalance must be off or auto, got {self.rebalance!r}")
        if self.rebalance == "off":
            return
        if spec.server is None or not spec.server.movable:
            raise ValueError(
                f"--rebalance auto under {self.scheme}: its servers keep state that is not per "
                "piece (a synchronous step) or it has none; use an asynchronous scheme "
                "(hogwild, downpour, agn, dynsgd, easgd, eamsgd) or --rebalance off"
            )
        if self.size.ps is not None and self.size.ps < 2:
            raise ValueError("--rebalance auto needs 2 or more servers to move pieces between")

    @property
    def forks_workers(self) -> bool:
        """Whether workers come from the fork server: ``fork_server``, except under ``--hosts``
        (a forked worker would be in the fork server's network namespace, not its host's)."""
        return self.hosting.fork_server and not self.hosting.hosts

    @property
    def tasks(self) -> tuple[TaskId, ...]:
        """The tasks the run may have: servers, then workers (up to ``--max-workers``)."""
        servers = tuple(TaskId(job=Role.PS, index=i) for i in range(self.num_ps))
        workers = range(self.size.highest_workers)
        return servers + tuple(TaskId(job=Role.WORKER, index=i) for i in workers)

    @property
    def lr_rule(self) -> tuple[str, float]:
        """The ``--lr-rule`` the workers apply (auto: the scheme's default) and its factor on
        ``--lr`` at ``--workers`` workers (control/config.py ``lr_multiplier``)."""
        chosen = str(self.overrides.get("lr_rule", "auto"))
        default = schemes.get(self.scheme).rules.lr_rule
        rule = default if chosen == "auto" else chosen
        return rule, lr_multiplier(rule, self.size.workers)

    @property
    def collective(self) -> bool:
        """Whether the run is collective (its scheme has no server half: the workers form one
        process group, and there are no parameter servers), as the scheme registry says."""
        return schemes.get(self.scheme).collective

    @property
    def num_ps(self) -> int:
        """``--ps``, or the scheme's default: 1 parameter server, none for a collective one."""
        if self.size.ps is not None:
            return self.size.ps
        return 0 if self.collective else 1

    @property
    def threads_per_worker(self) -> int:
        """``--threads``, or the cores left after one per parameter server, shared out."""
        return self.hosting.threads or shared_cores(self.size.workers, self.num_ps)

    @property
    def device(self) -> str:
        """The workers' ``--device`` ('' = where each script puts its model)."""
        return str(self.overrides.get("device", ""))

    def run_spec(self, *, run_id: str) -> RunSpec:
        """The run's settings as saved in its folder (``config.json``) and read back by
        ``--resume``, ``distsgd elastic scale`` and ``distsgd elastic join``."""
        return RunSpec(
            script=str(Path(self.script).resolve()),
            script_args=self.script_args,
            scheme=self.scheme,
            scheme_options=self.scheme_options,
            overrides=self.overrides,
            workers=self.size.workers,
            ps=self.num_ps,
            threads_per_worker=self.threads_per_worker,
            run_id=run_id,
            checkpoint_every=self.durability.checkpoint_every,
            checkpoint_seconds=self.durability.checkpoint_seconds,
            min_workers=self.size.lowest_workers,
            max_workers=self.size.highest_workers,
        )

    @classmethod
    def resumed(
        cls,
        run_dir: Path,
        *,
        min_workers: int = 0,
        max_workers: int = 0,
        evict_after: float = 0.0,
        cadence: tuple[int, float] | None = None,
        durability: Durability | None = None,
        **knobs: Any,
    ) -> LaunchConfig:
        """The run saved in ``run_dir`` (its :class:`RunSpec`), to continue from its last
        checkpoint; ``knobs`` are the launch settings not saved (hosting, faults, ...), and
        ``durability`` its restarts and logs. ``cadence`` (steps, seconds) gives the
        checkpoint cadence anew (None: the saved one; ``durability``'s own is not used), and
        ``min_workers``/``max_workers`` the bounds (0: the saved ones, so an elastic run stays
        elastic)."""
        spec = RunSpec.load(run_dir)
        if (Path(run_dir) / RESULT_FILE).exists():
            raise ValueError(
                f"run {run_dir} already finished (its chief wrote {RESULT_FILE}), so there is "
                f"nothing to resume; start a new run (distsgd run {spec.script} ...), or read "
                f"it with distsgd doctor {run_dir}"
            )
        steps, seconds = cadence or (spec.checkpoint_every, spec.checkpoint_seconds)
        size = ClusterSize(
            workers=spec.workers,
            ps=spec.ps,
            min_workers=min_workers or spec.min_workers,
            max_workers=max_workers or spec.max_workers,
            evict_after=evict_after,
        )
        return cls(
            script=spec.script,
            script_args=spec.script_args,
            scheme=spec.scheme,
            scheme_options=spec.scheme_options,
            overrides=spec.overrides,
            size=size,
            durability=replace(
                durability or Durability(), checkpoint_every=steps, checkpoint_seconds=seconds
            ),
            run_dir=run_dir,
            run_id=spec.run_id,
            resume=True,
            **knobs,
        )

    def resolved_run_dir(self) -> Path:
        if self.run_dir is not None:
            return Path(self.run_dir)
        return new_run_folder(self.scheme, runs_root())


def _check_hosts(config: LaunchConfig) -> None:
    """--hosts, --link and --placement against the engine and the tasks (the plan is made once,
    to check them, and the certificate's names against its servers' addresses)."""
    hosting, engine = config.hosting, engine_for(config)
    if not hosting.hosts:
        placed = engine.places_tasks  # Ray places its tasks by --placement
        if hosting.links or (hosting.placement != "spread" and not placed):
            raise ValueError(
                "--link and --placement shape emulated hosts (--placement also Ray's, "
                "with --ray); add --hosts N"
            )
        return
    if engine.places_tasks:
        raise ValueError(
            "--hosts places local processes in network namespaces, "
            f"{engine.name} places its tasks itself; drop --hosts or {engine.flag}"
        )
    tasks = len(config.tasks)
    if hosting.hosts > tasks:
        raise ValueError(
            f"--hosts {hosting.hosts} for {tasks} tasks would leave a host empty; "
            f"use --hosts {tasks} or fewer"
        )
    check_hosts(config)  # the plan, made once to check it, and the certificate's names


def _check_faults(config: LaunchConfig) -> None:
    """Each --inject-fault: a task the run has, and emulated hosts where the fault needs them."""
    hosts, size = config.hosting.hosts, config.size
    for spec_text in config.faults:
        fault = Fault.parse(spec_text)
        # a run that may grow (--max-workers) has its later workers' indices too
        count = config.num_ps if fault.job == Role.PS else size.highest_workers
        if fault.network and not hosts and (fault.kind == "slow" or fault.job == Role.PS):
            raise ValueError(
                f"--inject-fault {spec_text}: a slow link or a partition of a server acts "
                "on an emulated host's link; add --hosts N"
            )
        if fault.kind == "lose-host" and not hosts:
            raise ValueError(
                f"--inject-fault {spec_text}: losing a host needs emulated hosts (each with "
                "its own disk); add --hosts N"
            )
        if fault.index >= count:
            most = " at most" if fault.job == Role.WORKER and size.elastic else ""
            raise ValueError(
                f"--inject-fault {spec_text}: there is no {fault.task} "
                f"({count} {fault.job} tasks{most}); use an index below {count}"
            )
