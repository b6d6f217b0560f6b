"""The ``distsgd`` command: run, demo, compare, server, worker, inspect, schemes, k8s."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distsgd import __version__, schemes
from distsgd.cli.flags import (
    add_help_scheme_flag,
    add_scheme_flags,
    add_scheme_option_flags,
    add_training_flags,
    collect,
    scheme_options,
)
from distsgd.cluster import ClusterSpecError, resolve_cluster
from distsgd.launcher.config import DEFAULT_CHECKPOINT_SECONDS, DEFAULT_MAX_RESTARTS
from distsgd.util import private_dir

DEMO_SCRIPT = Path(__file__).resolve().parents[1] / "demo" / "digits.py"
DEBUG_ENV = "DISTSGD_DEBUG"
"""Set to show the traceback of an unexpected error instead of its one-line summary."""


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


def _add_tls_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("mutual TLS (all three, or none)")
    group.add_argument("--tls-cert", type=Path, help="this task's certificate (PEM)")
    group.add_argument("--tls-key", type=Path, help="this task's private key (PEM)")
    group.add_argument(
        "--tls-ca", type=Path, help="the CA certificate every task's certificate is signed by"
    )


def _tls(args: argparse.Namespace) -> Any:
    from distsgd.transport.security import TlsConfig

    return TlsConfig.from_flags(args.tls_cert, args.tls_key, args.tls_ca)


def _add_launch_flags(parser: argparse.ArgumentParser, *, compare: bool = False) -> None:
    """The flags of run and demo; compare has --schemes and --out instead of --scheme,
    --run-dir and --quiet (its runs' output goes to their launcher.log)."""
    parser.add_argument("--workers", type=int, default=2, help="worker tasks (default 2)")
    parser.add_argument(
        "--ps", type=int, default=None, help="parameter-server tasks (default 1; 0 for allreduce)"
    )
    if not compare:
        parser.add_argument(
            "--run-dir",
            type=Path,
            default=None,
            help="run folder (default ./distsgd-runs/<time>-<scheme>)",
        )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per worker (default cores/workers)"
    )
    if not compare:
        parser.add_argument("--quiet", action="store_true", help="hide task log lines")
        parser.add_argument(
            "--ray",
            default=None,
            metavar="ADDRESS",
            help="run the tasks as Ray actors (pip install 'distsgd[ray]'): --ray alone on a "
            "local Ray instance on 127.0.0.1, --ray=ADDRESS on the Ray cluster there ('auto', "
            "HOST:PORT, ray://...)",
        )
    ft = parser.add_argument_group("fault tolerance")
    ft.add_argument(
        "--checkpoint-every",
        metavar="N|Ns",
        default=None,
        help="checkpoint every N steps of each worker, or every N seconds with 's' (e.g. 50, "
        f"30s; default {DEFAULT_CHECKPOINT_SECONDS:.0f}s, 0 = off)",
    )
    if not compare:
        ft.add_argument(
            "--wal",
            choices=("on", "off"),
            default="on",
            help="each parameter server logs every update before applying it, so that a killed "
            "one comes back without losing any (default on; see docs/fault-tolerance.md)",
        )
    ft.add_argument(
        "--max-restarts",
        type=int,
        default=DEFAULT_MAX_RESTARTS,
        help="restart a dead task up to K times in a row from its last checkpoint (default "
        f"{DEFAULT_MAX_RESTARTS}; 0 = stop the run at the first failure)",
    )
    ft.add_argument(
        "--inject-fault",
        action="append",
        default=[],
        metavar="SPEC",
        help="kill:worker:1@step=50, kill:ps:0@step=120, delay:worker:2=200ms, "
        "partition:worker:0@step=30+10s (repeatable)",
    )
    if not compare:
        elastic = parser.add_argument_group(
            "elastic runs (parameter-server schemes need --world-size dynamic)"
        )
        elastic.add_argument(
            "--min-workers",
            type=int,
            default=0,
            help="fewest workers the run goes on with (distsgd scale's lower bound; a worker "
            "out of restarts is dropped while this many remain; default --workers)",
        )
        elastic.add_argument(
            "--max-workers",
            type=int,
            default=0,
            help="most workers distsgd scale may grow the run to (default --workers)",
        )
        elastic.add_argument(
            "--evict-after",
            type=float,
            default=0.0,
            metavar="SECONDS",
            help="the servers evict a worker silent this long (default 60)",
        )
    _add_tls_flags(parser)
    add_help_scheme_flag(parser)
    if compare:
        add_scheme_option_flags(parser)
    else:
        add_scheme_flags(parser)
    add_training_flags(parser)


def _add_compare_command(sub: Any) -> None:
    compare = sub.add_parser(
        "compare",
        help="run several schemes on the same script, plot and tabulate them",
        description="Run each scheme of --schemes in turn on the same script, data and seed "
        "(no SCRIPT: the bundled digits demo), then write compare.png (accuracy and loss "
        "against seconds and samples), compare.md (a table) and compare.json into --out. "
        "A scheme option applies to every listed scheme that has it; --ps applies to the "
        "parameter-server schemes; a variant, an entry of --schemes with settings of its own, "
        "overrides them for its run. Unless --eval-every or --steps is given, the first run "
        "calibrates how often the chief evaluates (about 20 points per curve).",
    )
    compare.add_argument(
        "--schemes",
        default="",
        metavar="A,B(KEY=VALUE,...),...",
        help="comma-separated schemes to compare, in this order (see distsgd schemes). An "
        "entry may be a variant with its own settings in parentheses, e.g. "
        "'downpour,downpour(server_lr=1),hogwild(lr=0.15)' (quote it for the shell): KEY is "
        "one of the scheme's options or a training flag's name (lr, momentum, batch_size, "
        "...; '-' or '_'), and its value beats the flag given for all runs. Each entry is "
        "labelled as written and runs in OUT/runs/FOLDER: the name, or for a variant the "
        "name and its settings joined by '_' (downpour_server_lr=1)",
    )
    compare.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder, new or empty (default ./distsgd-compare/<time>)",
    )
    compare.add_argument(
        "--target",
        type=float,
        default=None,
        metavar="ACC",
        help="report seconds to this test accuracy (default 95%% of the best final accuracy)",
    )
    fair = compare.add_argument_group(
        "fair comparisons (tuning on a validation split, repeats, a one-worker baseline)"
    )
    fair.add_argument(
        "--tune",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="run each entry with every value (repeat the flag for a grid) on the training set "
        "less a held-out validation part (--validation, default 0.2; the test set is not "
        "read), then its final runs with the best one; KEY is a training field (lr, "
        "momentum, batch_size, ...) or an option of a listed scheme (tuned for the schemes "
        "that have it); an entry that sets KEY itself keeps its value. E.g. --tune "
        "lr=0.05,0.15,0.3",
    )
    fair.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="K",
        help="final runs per entry, with seeds --seed + i (--seed default 0); the table shows "
        "their mean ± sample standard deviation, the figure the mean curve and the min-max "
        "band (default 1)",
    )
    fair.add_argument(
        "--baseline",
        action="store_true",
        help="add a row '1 worker (allreduce)': the same script on one worker over the same "
        "total samples (tuned too, under --tune)",
    )
    _add_launch_flags(compare, compare=True)
    compare.add_argument("script", nargs="?", help="training script (default: the bundled demo)")
    compare.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="arguments passed to the script"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distsgd", description=__doc__)
    parser.add_argument("--version", action="version", version=f"distsgd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="train a script on a local cluster of N workers and M ps")
    _add_launch_flags(run)
    run.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="continue an earlier run from its last complete checkpoint (same script, options)",
    )
    run.add_argument("script", nargs="?", help="training script that calls distsgd.train")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")

    demo = sub.add_parser(
        "demo", help="train the bundled digits CNN (prints the test accuracy last)"
    )
    _add_launch_flags(demo)
    _add_compare_command(sub)

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
    server.add_argument(
        "--checkpoint-dir", type=Path, help="folder the Checkpoint call writes into"
    )
    server.add_argument("--restore", type=Path, help="start from this shard checkpoint (psN.npz)")
    server.add_argument(
        "--restore-latest",
        action="store_true",
        help="start from this shard's newest file under --checkpoint-dir, if there is one "
        "(a restarted server: its container, or a pod)",
    )
    server.add_argument(
        "--wal",
        choices=("on", "off"),
        default="on",
        help="log every update before applying it, so that a killed server restarted on the "
        "same folder loses none (default on; needs --wal-dir or --checkpoint-dir)",
    )
    server.add_argument(
        "--wal-dir",
        type=Path,
        help="the write-ahead log's folder (default CHECKPOINT_DIR/wal/psN); a server started "
        "on a folder that holds a shard serves it",
    )
    server.add_argument(
        "--evict-after",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="evict a member silent (no call, no heartbeat) for this long (default 60)",
    )
    server.add_argument(
        "--max-workers",
        type=int,
        default=0,
        help="worker indexes up to this may join (default 0: the registered number)",
    )
    _add_cluster_flags(server)
    _add_tls_flags(server)

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
    worker.add_argument(
        "--checkpoint-every",
        metavar="N|Ns",
        default=None,
        help="checkpoint into RUN_DIR/checkpoints every N steps, or every N seconds with 's' "
        "(default off; give the servers --checkpoint-dir RUN_DIR/checkpoints)",
    )
    worker.add_argument(
        "--resume-latest",
        action="store_true",
        help="continue from this worker's newest state in RUN_DIR/checkpoints, if there is one "
        "(a restarted worker)",
    )
    _add_cluster_flags(worker)
    _add_tls_flags(worker)
    add_scheme_flags(worker)
    add_training_flags(worker)
    worker.add_argument("script")
    worker.add_argument("script_args", nargs=argparse.REMAINDER)

    scale = sub.add_parser(
        "scale",
        help="change the number of workers of a running elastic run",
        description="Ask the launcher running RUN_DIR (a distsgd run or demo started with "
        "--min-workers/--max-workers) for N workers, and wait until it has started the new "
        "ones or asked the ones over N to leave (they finish their step and hand their work "
        "back; the chief, worker0, always stays).",
    )
    scale.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run's folder")
    scale.add_argument("--workers", type=int, required=True, help="the number of workers wanted")
    scale.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for the launcher's answer"
    )

    join = sub.add_parser(
        "join",
        help="add a worker, in this process, to a running elastic run",
        description="Start one more worker of the run in RUN_DIR in this process (not "
        "supervised by its launcher): it reads the run's config.json, cluster.json and secret "
        "there (from another machine: a copy of those three files, with the servers "
        "reachable), joins the servers' membership, takes work units until the run's data is "
        "done, and leaves. Ctrl-C makes it leave after its step.",
    )
    join.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run's folder")
    join.add_argument(
        "--task",
        type=int,
        default=None,
        help="this worker's index (default: the highest one the launcher has not started)",
    )

    inspect = sub.add_parser("inspect", help="show what a checkpoint holds")
    inspect.add_argument(
        "path", type=Path, help="a run folder, a checkpoint folder, or a psN.npz / worker file"
    )

    sub.add_parser(
        "schemes",
        help="list the training schemes (details: distsgd run --help-scheme NAME)",
    )
    from distsgd.cli import k8s

    k8s.add_command(sub, _add_launch_flags)
    return parser


def _checkpoint_every(text: str | None) -> tuple[int, float]:
    """'50' -> 50 steps; '30s' -> 30 seconds; '0' -> off; None -> the default cadence."""
    if text is None:
        return 0, DEFAULT_CHECKPOINT_SECONDS
    try:
        if text.endswith("s"):
            return 0, float(text[:-1])
        return int(text), 0.0
    except ValueError:
        raise ValueError(
            f"--checkpoint-every {text!r}: give steps (50), seconds (30s) or 0 (off)"
        ) from None


def _cmd_run(args: argparse.Namespace, script: str | None, script_args: Sequence[str]) -> int:
    from distsgd.launcher import LaunchConfig, launch
    from distsgd.launcher.run import load_run_config

    steps, seconds = _checkpoint_every(args.checkpoint_every)
    common: dict[str, Any] = {
        "threads": args.threads,
        "quiet": args.quiet,
        "max_restarts": args.max_restarts,
        "faults": tuple(args.inject_fault),
        "tls": _tls(args),
        "ray": args.ray,
        "min_workers": args.min_workers,
        "max_workers": args.max_workers,
        "evict_after": args.evict_after,
        "wal": args.wal == "on",
    }
    resume = getattr(args, "resume", None)
    if resume is not None:
        ignored = [
            flag
            for flag, given in (
                ("SCRIPT", script is not None),
                ("--workers", args.workers != 2),
                ("--ps", args.ps is not None),
                ("--scheme", args.scheme != "sync"),
                ("--run-dir", args.run_dir is not None),
                ("scheme options", bool(collect(args, "scheme."))),
                ("training flags", bool(collect(args, "train."))),
            )
            if given
        ]
        if ignored:
            raise ValueError(
                "--resume continues the run with its saved script and options; "
                f"drop {', '.join(ignored)}"
            )
        saved = load_run_config(resume)
        if args.checkpoint_every is None:
            steps, seconds = saved.get("checkpoint_every", 0), saved.get("checkpoint_seconds", 0.0)
        config = LaunchConfig(
            script=saved["script"],
            script_args=tuple(saved["script_args"]),
            workers=saved["workers"],
            ps=saved["ps"],
            scheme=saved["scheme"],
            scheme_options=saved["scheme_options"],
            overrides=saved["overrides"],
            run_dir=resume,
            run_id=saved["run_id"],
            resume=True,
            checkpoint_every=steps,
            checkpoint_seconds=seconds,
            **common,
        )
        return launch(config).exit_code
    if script is None:
        raise ValueError("no training script; give SCRIPT, or --resume RUN_DIR to continue a run")
    config = LaunchConfig(
        script=script,
        script_args=tuple(script_args),
        workers=args.workers,
        ps=args.ps,
        scheme=args.scheme,
        scheme_options=scheme_options(args),
        overrides=collect(args, "train."),
        run_dir=args.run_dir,
        checkpoint_every=steps,
        checkpoint_seconds=seconds,
        **common,
    )
    return launch(config).exit_code


def _cmd_compare(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from distsgd.compare.entries import split_schemes
    from distsgd.compare.run import CompareConfig, compare

    steps, seconds = _checkpoint_every(args.checkpoint_every)
    script = args.script or str(DEMO_SCRIPT)
    overrides = collect(args, "train.")
    config = CompareConfig(
        schemes=split_schemes(args.schemes),
        script=script,
        script_args=tuple(args.script_args),
        label="digits CNN (bundled demo)" if args.script is None else Path(script).name,
        workers=args.workers,
        ps=args.ps,
        scheme_options=collect(args, "scheme."),
        overrides={k: v for k, v in overrides.items() if k != "validation"},
        validation=float(overrides.get("validation", 0.0)),
        tune=tuple(args.tune),
        repeats=args.repeats,
        baseline=args.baseline,
        out=args.out,
        target=args.target,
        threads=args.threads,
        checkpoint_every=steps,
        checkpoint_seconds=seconds,
        max_restarts=args.max_restarts,
        faults=tuple(args.inject_fault),
        tls=_tls(args),
        command=shlex.join(["distsgd", *argv]),
    )
    try:
        return compare(config)
    except KeyboardInterrupt:  # between two runs (a run itself stops on Ctrl-C by itself)
        print("distsgd: interrupted", file=sys.stderr)
        return 130


def _cmd_schemes() -> int:
    for name in schemes.names():
        print(f"{name:10s} {schemes.get(name).summary}")
    # stderr: stdout stays one scheme per line for scripts
    print("each scheme's math, paper and options: distsgd run --help-scheme NAME", file=sys.stderr)
    return 0


def _task_index(arg: int | None, tf_task: Any, job: str) -> int:
    if arg is not None:
        return arg
    if tf_task is not None and tf_task.job == job:
        return int(tf_task.index)
    raise ValueError(f"no {job} task index; pass --task N (or set TF_CONFIG's task)")


def _cmd_server(args: argparse.Namespace) -> int:
    from distsgd.cluster.kube import alias_address, host_aliases
    from distsgd.launcher.bootstrap import setup_logging
    from distsgd.launcher.lifeline import tie_to_parent
    from distsgd.ps import serve
    from distsgd.ps.membership import check_evict_after
    from distsgd.ps.rules import MAX_WORKERS
    from distsgd.transport.security import load_secret

    spec, tf_task = resolve_cluster(
        cluster_file=args.cluster, ps_hosts=args.ps_hosts, worker_hosts=args.worker_hosts
    )
    if args.job != "ps":
        raise ValueError(
            f"--job {args.job}: 'distsgd server' runs ps tasks; run workers with 'distsgd worker'"
        )
    index = _task_index(args.task, tf_task, "ps")
    task = spec.task("ps", index)
    tls, secret = _tls(args), load_secret()
    if args.restore is not None and not args.restore.is_file():
        raise ValueError(f"--restore {args.restore}: no such file; give a psN.npz of a checkpoint")
    restore = args.restore
    if args.restore_latest:
        from distsgd.runtime.checkpoint import newest_shard_file

        if args.checkpoint_dir is None or args.restore is not None:
            raise ValueError("--restore-latest needs --checkpoint-dir, and no --restore")
        restore = newest_shard_file(args.checkpoint_dir, index)
    check_evict_after(args.evict_after)
    if not 0 <= args.max_workers <= MAX_WORKERS:
        raise ValueError(f"--max-workers must be in 0..{MAX_WORKERS}, got {args.max_workers}")
    wal_dir = args.wal_dir
    if wal_dir is None and args.checkpoint_dir is not None:
        wal_dir = args.checkpoint_dir / "wal" / f"ps{index}"
    if args.wal == "off":
        wal_dir = None
    tie_to_parent()
    setup_logging()
    address = alias_address(args.address or spec.address(task), host_aliases())
    serve(
        address=address,
        shard_index=index,
        rule_factory=schemes.make_server_rule,
        address_file=args.address_file,
        checkpoint_dir=args.checkpoint_dir,
        restore=restore,
        secret=secret,
        tls=tls,
        max_workers=args.max_workers,
        evict_after=args.evict_after,
        wal_dir=wal_dir,
    )
    from distsgd.launcher.bootstrap import exit_now

    # serve has stopped (within a second of SIGTERM) and written all it owns; skip interpreter
    # finalization, which takes seconds once torch is imported.
    exit_now(0)
    return 0  # not reached


def _cmd_worker(args: argparse.Namespace) -> int:
    from distsgd.control.task import TaskEnv

    spec, tf_task = resolve_cluster(
        cluster_file=args.cluster, ps_hosts=args.ps_hosts, worker_hosts=args.worker_hosts
    )
    index = _task_index(args.task, tf_task, "worker")
    spec.task("worker", index)
    options = scheme_options(args)
    scheme = schemes.get(args.scheme)
    scheme.worker(scheme.parse_options(options), spec.num_workers)
    tls = _tls(args)
    steps, seconds = _checkpoint_every(args.checkpoint_every or "0")
    if (steps or seconds or args.resume_latest) and not args.run_dir:
        raise ValueError(
            "--checkpoint-every and --resume-latest need --run-dir (RUN_DIR/checkpoints)"
        )
    resume = None
    if args.resume_latest:
        from distsgd.runtime.checkpoint import newest_worker_state

        resume = newest_worker_state(Path(args.run_dir) / "checkpoints", index)
    env = TaskEnv(
        cluster=spec.to_dict(),
        task_index=index,
        scheme=args.scheme,
        scheme_options=options,
        overrides=collect(args, "train."),
        run_dir=str(args.run_dir or ""),
        rendezvous=args.rendezvous,
        checkpoint_every=steps,
        checkpoint_seconds=seconds,
        resume="" if resume is None else str(resume),
        tls=[] if tls is None else [str(tls.cert), str(tls.key), str(tls.ca)],
    )
    if args.run_dir:
        private_dir(Path(args.run_dir))
    _run_task(env, args.script, args.script_args)
    return 0  # not reached


def _run_task(env: Any, script: str, script_args: Sequence[str]) -> None:
    """Run ``script`` as the task ``env`` describes, in this process, and exit with its code."""
    from distsgd.control.task import ENV_VAR
    from distsgd.launcher.bootstrap import exit_now
    from distsgd.launcher.bootstrap import main as bootstrap_main

    os.environ[ENV_VAR] = env.to_json()
    exit_now(bootstrap_main([script, *script_args]))


def _cmd_scale(args: argparse.Namespace) -> int:
    from distsgd.launcher.scale import request_scale

    answer = request_scale(args.run_dir, args.workers, timeout=args.timeout)
    if answer.get("event") == "scale_refused":
        raise ValueError(f"the launcher refused {args.workers} workers; see its output")
    print(
        f"distsgd: {args.run_dir}: {answer.get('workers_before')} -> {answer.get('workers')} "
        "workers"
    )
    return 0


def _cmd_join(args: argparse.Namespace) -> int:
    from distsgd.launcher.join import join_env
    from distsgd.transport.security import SECRET_FILE_ENV

    env, script, script_args, secret = join_env(args.run_dir, args.task)
    os.environ[SECRET_FILE_ENV] = str(secret)  # the worker's calls carry the run's secret
    print(f"distsgd: joining {args.run_dir} as worker{env.task_index}", file=sys.stderr)
    _run_task(env, script, script_args)
    return 0  # not reached


def _bare_ray(argv: list[str]) -> list[str]:
    """``--ray`` alone (a local Ray instance) as ``--ray=``, so that the script after it is
    not taken for an address; only before the script (the first ``.py`` argument)."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg.endswith(".py") or arg == "--":
            return out + argv[i:]
        out.append("--ray=" if arg == "--ray" else arg)
    return out


def parse_argv(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """The command line as the CLI reads it (``--ray`` alone meaning a local Ray instance)."""
    return parser.parse_args(_bare_ray(list(argv)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_argv(parser, argv)
    try:
        if args.command == "run":
            return _cmd_run(args, args.script, args.script_args)
        if args.command == "demo":
            return _cmd_run(args, str(DEMO_SCRIPT), [])
        if args.command == "compare":
            return _cmd_compare(args, argv)
        if args.command == "server":
            return _cmd_server(args)
        if args.command == "worker":
            return _cmd_worker(args)
        if args.command == "scale":
            return _cmd_scale(args)
        if args.command == "join":
            return _cmd_join(args)
        if args.command == "inspect":
            from distsgd.cli.inspect import inspect

            return inspect(args.path)
        if args.command == "schemes":
            return _cmd_schemes()
        if args.command == "k8s":
            from distsgd.cli import k8s

            return k8s.main(args)
    except (ValueError, ClusterSpecError, OSError) as exc:
        print(f"distsgd: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("distsgd: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: one line, the traceback only when asked for
        if os.environ.get(DEBUG_ENV):
            raise
        print(
            f"distsgd: internal error: {type(exc).__name__}: {_one_line(exc)} (a bug in "
            f"distsgd; rerun with {DEBUG_ENV}=1 for the traceback and report it)",
            file=sys.stderr,
        )
        return 1
    parser.error(f"unknown command {args.command}")
    return 2


def _one_line(exc: BaseException) -> str:
    """The error's message as one line (multi-line messages keep their first line's sense)."""
    text = str(exc).strip()
    return " ".join(text.split("\n")) if text else type(exc).__name__


if __name__ == "__main__":
    logging.captureWarnings(True)
    sys.exit(main())
