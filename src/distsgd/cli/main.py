"""The ``distsgd`` command: run, demo, server, worker, schemes."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from distsgd import __version__, schemes
from distsgd.cli.flags import add_scheme_flags, add_training_flags, collect, scheme_options
from distsgd.cluster import ClusterSpecError, resolve_cluster

DEMO_SCRIPT = Path(__file__).resolve().parents[1] / "demo" / "digits.py"


def _add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "cluster (first given wins: --cluster, host lists, TF_CONFIG)"
    )
    group.add_argument("--cluster", metavar="FILE", help="cluster spec, .toml or .json")
    group.add_argument(
        "--ps-hosts", "--ps_hosts", dest="ps_hosts", help="comma-separated ps addresses"
    )
    group.add_argument(
        "--worker-hosts",
        "--worker_hosts",
        dest="worker_hosts",
        help="comma-separated worker addresses",
    )


def _add_launch_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="worker tasks (default 2)")
    parser.add_argument(
        "--ps", type=int, default=None, help="parameter-server tasks (default 1; 0 for allreduce)"
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="run folder (default ./distsgd-runs/<time>-<scheme>)",
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per worker (default cores/workers)"
    )
    parser.add_argument("--quiet", action="store_true", help="hide task log lines")
    add_scheme_flags(parser)
    add_training_flags(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distsgd", description=__doc__)
    parser.add_argument("--version", action="version", version=f"distsgd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="train a script on a local cluster of N workers and M ps")
    _add_launch_flags(run)
    run.add_argument("script", help="training script that calls distsgd.train")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")

    demo = sub.add_parser(
        "demo", help="train the bundled digits CNN (prints the test accuracy last)"
    )
    _add_launch_flags(demo)

    server = sub.add_parser("server", help="run one parameter-server task")
    server.add_argument("--job", "--job_name", dest="job", default="ps", help="must be ps")
    server.add_argument(
        "--task", "--task_index", dest="task", type=int, default=None, help="ps task index"
    )
    server.add_argument(
        "--address", help="listen on HOST:PORT instead of the spec's address (port 0 = any)"
    )
    server.add_argument(
        "--address-file", type=Path, help="write the address really bound to this file"
    )
    _add_cluster_flags(server)

    worker = sub.add_parser("worker", help="run a training script as one worker task of a cluster")
    worker.add_argument(
        "--task",
        "--task_index",
        dest="task",
        type=int,
        default=None,
        help="worker index (0 = chief)",
    )
    worker.add_argument("--run-dir", type=Path, default=None, help="folder for metrics and results")
    worker.add_argument(
        "--rendezvous",
        default="",
        help="torch.distributed store HOST:PORT (default: chief's address)",
    )
    _add_cluster_flags(worker)
    add_scheme_flags(worker)
    add_training_flags(worker)
    worker.add_argument("script")
    worker.add_argument("script_args", nargs=argparse.REMAINDER)

    sub.add_parser("schemes", help="list the training schemes")
    return parser


def _cmd_run(args: argparse.Namespace, script: str, script_args: Sequence[str]) -> int:
    from distsgd.launcher import LaunchConfig, launch

    config = LaunchConfig(
        script=script,
        script_args=tuple(script_args),
        workers=args.workers,
        ps=args.ps,
        scheme=args.scheme,
        scheme_options=scheme_options(args),
        overrides=collect(args, "train."),
        run_dir=args.run_dir,
        threads=args.threads,
        quiet=args.quiet,
    )
    return launch(config)


def _cmd_server(args: argparse.Namespace) -> int:
    from distsgd.launcher.bootstrap import setup_logging
    from distsgd.launcher.lifeline import tie_to_parent
    from distsgd.ps import serve

    spec, tf_task = resolve_cluster(
        cluster_file=args.cluster, ps_hosts=args.ps_hosts, worker_hosts=args.worker_hosts
    )
    if args.job != "ps":
        raise ValueError(
            f"--job {args.job}: 'distsgd server' runs ps tasks; run workers with 'distsgd worker'"
        )
    index = (
        args.task
        if args.task is not None
        else (tf_task.index if tf_task and tf_task.job == "ps" else None)
    )
    if index is None:
        raise ValueError("no ps task index; pass --task N (or set TF_CONFIG's task)")
    task = spec.task("ps", index)
    tie_to_parent()
    setup_logging()
    address = args.address or spec.address(task)
    host = address.rpartition(":")[0].strip("[]")
    if host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("distsgd").warning(
            "listening on non-loopback %s without authentication or TLS", address
        )
    serve(
        address=address,
        shard_index=index,
        rule_factory=schemes.make_server_rule,
        address_file=args.address_file,
    )
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    import os

    from distsgd.launcher.bootstrap import main as bootstrap_main
    from distsgd.runtime import ENV_VAR, TaskEnv

    spec, tf_task = resolve_cluster(
        cluster_file=args.cluster, ps_hosts=args.ps_hosts, worker_hosts=args.worker_hosts
    )
    index = (
        args.task
        if args.task is not None
        else (tf_task.index if tf_task and tf_task.job == "worker" else None)
    )
    if index is None:
        raise ValueError("no worker task index; pass --task N (or set TF_CONFIG's task)")
    spec.task("worker", index)
    options = scheme_options(args)
    schemes.get(args.scheme).worker(
        schemes.get(args.scheme).parse_options(options), spec.num_workers
    )
    env = TaskEnv(
        cluster=spec.to_dict(),
        task_index=index,
        scheme=args.scheme,
        scheme_options=options,
        overrides=collect(args, "train."),
        run_dir=str(args.run_dir or ""),
        rendezvous=args.rendezvous,
    )
    if args.run_dir:
        Path(args.run_dir).mkdir(parents=True, exist_ok=True)
    os.environ[ENV_VAR] = env.to_json()
    return bootstrap_main([args.script, *args.script_args])


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            return _cmd_run(args, args.script, args.script_args)
        if args.command == "demo":
            return _cmd_run(args, str(DEMO_SCRIPT), [])
        if args.command == "server":
            return _cmd_server(args)
        if args.command == "worker":
            return _cmd_worker(args)
        if args.command == "schemes":
            for name in schemes.names():
                print(f"{name:10s} {schemes.get(name).summary}")
            return 0
    except (ValueError, ClusterSpecError, OSError) as exc:
        print(f"distsgd: error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
