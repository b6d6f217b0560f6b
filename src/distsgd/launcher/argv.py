"""What the local launcher starts: a parameter server's command line, a worker's command line
and its task description (``DISTSGD_TASK``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from distsgd.cluster import ClusterSpec, Role, TaskId
from distsgd.control.faults import DELAY_KINDS, Fault
from distsgd.control.task import TaskEnv
from distsgd.launcher.config import LaunchConfig


def server_argv(
    config: LaunchConfig,
    index: int,
    *,
    cluster_file: Path,
    address: str,
    address_file: Path,
    checkpoint_dir: Path,
    wal_dir: Path,
    restore: Path | None,
    control: str = "",
    spec: ClusterSpec | None = None,
) -> list[str]:
    """``distsgd server`` for ps ``index`` listening on ``address`` (port 0: any), writing the
    address it bound to ``address_file``, starting from ``restore`` when given. With a run
    ``control`` (tasks that do not share the launcher's disk) it reports the address there
    instead, and takes the cluster (``spec``) on its command line, not in a file."""
    argv = [*(sys.executable, "-m", "distsgd", "server", "--job", "ps", "--task", str(index))]
    if control:
        assert spec is not None
        argv += ["--ps-hosts", ",".join(spec.ps), "--worker-hosts", ",".join(spec.worker)]
        argv += ["--address", address, "--control", control]
    else:
        argv += ["--cluster", str(cluster_file), "--address", address]
        argv += ["--address-file", str(address_file)]
    argv += [
        *("--checkpoint-dir", str(checkpoint_dir)),
        *(["--wal-dir", str(wal_dir)] if config.durability.wal else ["--wal", "off"]),
    ]
    if restore is not None:
        argv += ["--restore", str(restore)]
    if config.size.elastic:
        argv += ["--max-workers", str(config.size.highest_workers)]
    if config.size.evict_after:
        argv += ["--evict-after", f"{config.size.evict_after:g}"]
    delay = sum(f.seconds for f in map(Fault.parse, config.faults) if _server_delay(f, index))
    if delay:
        argv += ["--inject-delay", f"{delay:g}"]
    if config.hosting.tls is not None:
        tls = config.hosting.tls
        argv += ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--tls-ca", str(tls.ca)]
    return argv


def worker_argv(config: LaunchConfig) -> list[str]:
    """The bootstrap running the user's script (the task comes in ``DISTSGD_TASK``)."""
    return [sys.executable, "-m", "distsgd.launcher.bootstrap", config.script, *config.script_args]


def worker_task(
    config: LaunchConfig,
    index: int,
    *,
    spec: ClusterSpec,
    run_dir: Path,
    run_id: str,
    rendezvous: str,
    ps_address_files: list[Path],
    active: int,
    resume: Path | None,
    continue_at: int = 0,
    reshard: bool = False,
    rollbacks_left: int = 0,
    control: str = "",
    link_delays: Sequence[Sequence[float]] = (),
) -> TaskEnv:
    """Worker ``index``'s task in a cluster of ``active`` workers started now; the launcher
    may still roll the run back ``rollbacks_left`` times. ``link_delays``: per server, the
    [round trip, jitter] of the emulated links between them (``Hosts.link_delays``)."""
    c = config
    return TaskEnv(
        cluster=spec.to_dict(),
        task_index=index,
        scheme=c.scheme,
        scheme_options=c.scheme_options,
        overrides=c.overrides,
        run_dir=str(run_dir.resolve()),
        run_id=run_id,
        rendezvous=rendezvous,
        startup_timeout=c.startup_timeout,
        wait_timeout=c.wait_timeout,
        checkpoint_every=c.durability.checkpoint_every,
        checkpoint_seconds=c.durability.checkpoint_seconds,
        resume="" if resume is None else str(resume),
        continue_at=continue_at,
        tls=c.hosting.tls,
        ps_address_files=[] if control else [str(path) for path in ps_address_files],
        control=control,
        ps_link_delays=[list(pair) for pair in link_delays],
        faults=tuple(
            fault
            for fault in map(Fault.parse, c.faults)
            if _worker_fault(fault, index, c.hosting.hosts)
        ),
        # an elastic cluster lists --max-workers workers: a collective one trains with those
        # started now (a process group's size), a parameter-server one registers --workers
        registered_workers=(active if c.collective else c.size.workers) if c.size.elastic else 0,
        reshard=reshard,
        rollbacks_left=rollbacks_left,
    )


def _worker_fault(fault: Fault, index: int, hosts: int) -> bool:
    """Whether worker ``index`` is given ``fault``: a delay of its own, or a partition of its
    own without ``--hosts`` (simulated; under ``--hosts`` the launcher cuts its host's link),
    and every kill (the launcher's: each worker holds still at its step until it landed, see
    :class:`~distsgd.control.faults.FaultInjector`). Slow links are the launcher's."""
    if fault.kills:
        return True
    if fault.task_id != TaskId(job=Role.WORKER, index=index):
        return False
    return fault.kind in DELAY_KINDS or (fault.kind == "partition" and not hosts)


def _server_delay(fault: Fault, index: int) -> bool:
    """Whether ``fault`` delays ps ``index``'s answers (``delay:ps:N=DURATION``)."""
    return fault.kind == "delay" and fault.task_id == TaskId(job=Role.PS, index=index)
