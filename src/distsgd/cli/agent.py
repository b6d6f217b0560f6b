"""``distsgd agent``: the command line of a machine's agent (:mod:`distsgd.launcher.agent`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from distsgd import schemes
from distsgd.cluster import Role
from distsgd.cluster.resolve import resolve_cluster
from distsgd.transport.security import TlsConfig, load_secret


def cluster_args(args: argparse.Namespace) -> list[str]:
    """The flags that give a task the cluster the agent was given."""
    if args.cluster:
        return ["--cluster", str(args.cluster)]
    given = [("--ps-hosts", args.ps_hosts), ("--worker-hosts", args.worker_hosts)]
    return [part for flag, value in given if value for part in (flag, value)]


def main(args: argparse.Namespace) -> int:
    from distsgd.cli.parser import build_parser, parse_argv
    from distsgd.launcher.agent import AgentConfig, parse_tasks, run_agent
    from distsgd.launcher.bootstrap import setup_logging

    worker_args = list(args.worker_args)
    if worker_args[:1] == ["--"]:
        worker_args = worker_args[1:]
    spec, _ = resolve_cluster(
        cluster_file=args.cluster, ps_hosts=args.ps_hosts, worker_hosts=args.worker_hosts
    )
    tasks = parse_tasks(args.tasks)
    collective = resume = False
    if any(t.job == Role.WORKER for t in tasks) and worker_args:
        # the workers' flags, checked now rather than by each worker after it started
        worker = parse_argv(
            build_parser(), ["worker", "--task", "0", *cluster_args(args), *worker_args]
        )
        collective = schemes.get(worker.scheme).collective
        resume = worker.run_dir is not None
        if not Path(worker.script).is_file():
            raise ValueError(f"{worker.script}: no such script; give the workers' script path")
    config = AgentConfig(
        tasks=tasks,
        spec=spec,
        cluster_args=tuple(cluster_args(args)),
        worker_args=tuple(worker_args),
        folder=args.dir,
        collective=collective,
        resume_workers=resume,
        max_restarts=args.max_restarts,
        healthy_seconds=args.healthy_seconds,
        evict_after=args.evict_after,
        tls=TlsConfig.from_flags(args.tls_cert, args.tls_key, args.tls_ca),
        secret=load_secret(),
    )
    setup_logging()
    return run_agent(config)
