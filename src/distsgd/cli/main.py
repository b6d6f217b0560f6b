"""What each ``distsgd`` subcommand does (``_cmd_*``), and :func:`main`: it reads the command
line (:mod:`distsgd.cli.parser`) and turns an error into one line and an exit code."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from distsgd import schemes
from distsgd.cli import elastic, k8s, plan
from distsgd.cli.flags import checkpoint_every, collect, scheme_options
from distsgd.cli.parser import build_parser, parse_argv
from distsgd.cli.tasks import run_task
from distsgd.cluster import ClusterSpecError, Role, resolve_cluster
from distsgd.launcher.config import DEMO_SCRIPTS
from distsgd.transport.errors import RemoteError
from distsgd.util import private_dir
from distsgd.util.optional import installed

DEBUG_ENV = "DISTSGD_DEBUG"
"""Set to show the traceback of an unexpected error instead of its one-line summary."""


def _tls(args: argparse.Namespace) -> Any:
    from distsgd.transport.security import TlsConfig

    return TlsConfig.from_flags(args.tls_cert, args.tls_key, args.tls_ca)


def _cmd_run(args: argparse.Namespace, script: str | None, script_args: Sequence[str]) -> int:
    from distsgd.launcher import LaunchConfig, launch
    from distsgd.launcher.config import ClusterSize, Durability, Hosting

    steps, seconds = checkpoint_every(args.checkpoint_every)
    durability = Durability(
        checkpoint_every=steps,
        checkpoint_seconds=seconds,
        max_restarts=args.max_restarts,
        max_rollbacks=args.max_rollbacks,
        wal=args.wal != "off",
        replicate=args.wal == "on",
        doctor_after=args.doctor_after,
    )
    common: dict[str, Any] = {
        "quiet": args.quiet,
        "faults": tuple(args.inject_fault),
        "rebalance": getattr(args, "rebalance", "off"),
        "hosting": Hosting(
            threads=args.threads,
            tls=_tls(args),
            ray=args.ray,
            fork_server=args.fork_server == "on",
            hosts=args.hosts,
            links=tuple(args.link),
            placement=args.placement,
            metrics_address=args.metrics_address,
        ),
    }
    bounds: dict[str, Any] = {
        "min_workers": args.min_workers,
        "max_workers": args.max_workers,
        "evict_after": args.evict_after,
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
        cadence = None if args.checkpoint_every is None else (steps, seconds)  # None: saved
        config = LaunchConfig.resumed(
            resume, cadence=cadence, durability=durability, **bounds, **common
        )
        return launch(config).exit_code
    if script is None:
        raise ValueError("no training script; give SCRIPT, or --resume RUN_DIR to continue a run")
    config = LaunchConfig(
        script=script,
        script_args=tuple(script_args),
        scheme=args.scheme,
        scheme_options=scheme_options(args),
        overrides=collect(args, "train."),
        size=ClusterSize(workers=args.workers, ps=args.ps, **bounds),
        durability=durability,
        run_dir=args.run_dir,
        **common,
    )
    return launch(config).exit_code


def _cmd_compare(args: argparse.Namespace, argv: Sequence[str]) -> int:
    with installed("distsgd_compare", "distsgd compare"):
        from distsgd_compare.command import main as compare_main
    return compare_main(args, argv)


def _task_index(arg: int | None, tf_task: Any, job: str) -> int:
    if arg is not None:
        return arg
    if tf_task is not None and tf_task.job == job:
        return int(tf_task.index)
    raise ValueError(f"no {job} task index; pass --task N (or set TF_CONFIG's task)")


def _replicate(
    args: argparse.Namespace, wal_dir: Path | None, index: int, secret: str | None
) -> None:
    """``--replica``: the shard's log is mirrored there (needs the log and the run secret)."""
    from distsgd.ps import wal
    from distsgd.ps.replica import ReplicaLink

    if wal_dir is None or secret is None:
        raise ValueError(
            "--replica needs the write-ahead log (--wal-dir) and the run secret "
            "(DISTSGD_SECRET or DISTSGD_SECRET_FILE)"
        )
    if args.tls_cert or args.tls_key or args.tls_ca:
        raise ValueError(
            "--replica: a log replica's connection is not encrypted; under mutual TLS keep the "
            "log on the server's own disk (drop --replica)"
        )
    resolve = None if not args.control else _resolver(args.control, f"replica{index}", secret)
    link = ReplicaLink(
        args.replica, run_id=args.run_id, shard=index, secret=secret, resolve=resolve
    )
    wal.replicate(wal_dir, link)


def _resolver(control: str, task: str, secret: str) -> Callable[[], str | None]:
    """What reads the address ``task`` last reported to the run control at ``control`` (a
    replica started again on another node reports a new one)."""
    from distsgd.control.remote_files import RemoteFiles

    files = RemoteFiles(control, secret=secret, timeout=5.0)

    def resolve() -> str | None:
        data = files.get(f"{task}.address")
        return None if data is None else data.decode(errors="replace").strip()

    return resolve


def _cmd_replica(args: argparse.Namespace) -> int:
    """``distsgd server --job replica``: keep ps --task's log in --wal-dir until stopped."""
    from distsgd.launcher.bootstrap import setup_logging
    from distsgd.launcher.lifeline import tie_to_parent
    from distsgd.ps.replica_server import serve_replica
    from distsgd.transport.security import load_secret

    secret = load_secret()
    if args.task is None or args.wal_dir is None or not args.address or secret is None:
        raise ValueError(
            "--job replica needs --task (the ps it keeps), --wal-dir, --address HOST:PORT and "
            "the run secret (DISTSGD_SECRET or DISTSGD_SECRET_FILE)"
        )
    tie_to_parent()
    setup_logging()
    serve_replica(
        args.wal_dir,
        address=args.address,
        shard=args.task,
        run_id=args.run_id,
        secret=secret,
        address_file=args.address_file,
        announce=None
        if not args.control
        else _announcer(args.control, f"replica{args.task}", secret),
    )
    return 0


def _cmd_control(args: argparse.Namespace) -> int:
    """``distsgd server --job control``: serve the run control for --run-dir until stopped."""
    from distsgd.cluster.kube import alias_address, host_aliases
    from distsgd.launcher.bootstrap import setup_logging
    from distsgd.launcher.k8s_control import serve_control, split_host_port
    from distsgd.launcher.lifeline import tie_to_parent
    from distsgd.transport.security import load_secret

    if args.run_dir is None or not args.address:
        raise ValueError(
            "--job control needs --run-dir (the run folder it assembles) and --address "
            "HOST:PORT (where the tasks' --control reaches it)"
        )
    if args.tls_cert or args.tls_key or args.tls_ca:
        raise ValueError(
            "--job control: the run control's connections are not encrypted; drop "
            "--tls-cert/--tls-key/--tls-ca and run it on a network meant for this run"
        )
    secret = load_secret()
    if secret is None:
        raise ValueError(
            "--job control needs the run secret, which every task presents; set "
            "DISTSGD_SECRET_FILE (or DISTSGD_SECRET)"
        )
    address = alias_address(args.address, host_aliases())
    split_host_port(address)  # a bad address fails here, in one line
    tie_to_parent()
    setup_logging()
    serve_control(args.run_dir, address=address, secret=secret, address_file=args.address_file)
    return 0


def _control_address(control: str | None) -> str:
    """``--control HOST:PORT`` as this task dials it (``DISTSGD_HOST_ALIASES`` applied)."""
    from distsgd.cluster.kube import alias_address, host_aliases

    return alias_address(control, host_aliases()) if control else ""


def _announcer(control: str, task: str, secret: str | None) -> Callable[[str], None]:
    """What tells the launcher's run control at ``control`` the address ``task`` bound."""
    from distsgd.control.remote_files import RemoteFiles

    def announce(bound: str) -> None:
        with contextlib.closing(RemoteFiles(control, secret=secret)) as files:
            files.put(f"{task}.address", (bound + "\n").encode())

    return announce


def _cmd_server(args: argparse.Namespace) -> int:
    from distsgd.cluster.kube import alias_address, host_aliases
    from distsgd.launcher.bootstrap import setup_logging
    from distsgd.launcher.lifeline import tie_to_parent
    from distsgd.ps import serve
    from distsgd.ps.membership import check_evict_after
    from distsgd.ps.rules import check_max_workers
    from distsgd.transport.security import load_secret

    if args.job == "replica":  # needs no cluster: it serves its server alone
        return _cmd_replica(args)
    if args.job == "control":  # needs no cluster either: the tasks come to it
        return _cmd_control(args)
    if args.run_dir is not None:
        raise ValueError(
            "--run-dir is the run control's (--job control); give a parameter server "
            "--checkpoint-dir"
        )
    spec, tf_task = resolve_cluster(
        cluster_file=args.cluster, ps_hosts=args.ps_hosts, worker_hosts=args.worker_hosts
    )
    if args.job != Role.PS:
        raise ValueError(
            f"--job {args.job}: 'distsgd server' runs ps tasks; run workers with 'distsgd worker'"
        )
    index = _task_index(args.task, tf_task, "ps")
    task = spec.task(Role.PS, index)
    tls, secret = _tls(args), load_secret()
    if args.restore is not None and not args.restore.is_file():
        raise ValueError(f"--restore {args.restore}: no such file; give a psN.npz of a checkpoint")
    restore = args.restore
    if args.restore_latest:
        from distsgd.control.checkpoint.store import DiskStore
        from distsgd.control.recovery import resume_point

        if args.checkpoint_dir is None or args.restore is not None:
            raise ValueError("--restore-latest needs --checkpoint-dir, and no --restore")
        shard = resume_point(task, DiskStore(args.checkpoint_dir)).resume
        restore = None if shard is None else shard.path
    check_evict_after(args.evict_after)
    check_max_workers(args.max_workers)
    wal_dir = args.wal_dir
    if wal_dir is None and args.checkpoint_dir is not None:
        wal_dir = args.checkpoint_dir / "wal" / f"ps{index}"
    if args.wal == "off":
        wal_dir = None
    if args.replica:
        _replicate(args, wal_dir, index, secret)
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
        inject_delay=args.inject_delay,
        announce=None
        if not args.control
        else _announcer(_control_address(args.control), f"ps{index}", secret),
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
    spec.task(Role.WORKER, index)
    options = scheme_options(args)
    scheme = schemes.get(args.scheme)
    scheme.check(scheme.parse_options(options), spec.num_workers)
    tls = _tls(args)
    steps, seconds = checkpoint_every(args.checkpoint_every or "0")
    if (steps or seconds or args.resume_latest) and not args.run_dir:
        raise ValueError(
            "--checkpoint-every and --resume-latest need --run-dir (RUN_DIR/checkpoints)"
        )
    resume = None
    if args.resume_latest:
        from distsgd.control.checkpoint.store import DiskStore
        from distsgd.control.recovery import resume_point

        store = DiskStore(Path(args.run_dir) / "checkpoints")
        state = resume_point(spec.task(Role.WORKER, index), store).resume
        resume = None if state is None else state.path
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
        tls=tls,
        control=_control_address(args.control),
    )
    if args.run_dir:
        private_dir(Path(args.run_dir))
    run_task(env, args.script, args.script_args)
    return 0  # not reached


def _dispatch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run the parsed command."""
    if args.command == "demo":
        return _cmd_run(args, str(DEMO_SCRIPTS[args.model]), [])
    if args.command == "run":
        return _cmd_run(args, args.script, args.script_args)
    if args.command == "compare":
        return _cmd_compare(args, argv)
    if args.command == "agent":
        from distsgd.cli.agent import main as agent_main

        return agent_main(args)
    if args.command == "doctor":
        from distsgd.cli.doctor import doctor

        return doctor(args.path, watch=args.watch, stall=args.stall)
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "server": _cmd_server,
        "worker": _cmd_worker,
        "elastic": elastic.main,
        "k8s": k8s.main,
        "plan": plan.main,
    }
    return handlers[args.command](args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_argv(parser, argv)
    try:
        return _dispatch(args, argv)
    except (ValueError, ClusterSpecError, OSError) as exc:
        print(f"distsgd: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("distsgd: interrupted", file=sys.stderr)
        return 130
    except RemoteError as exc:  # a server refused or could not be reached: not a bug
        print(f"distsgd: error: {_one_line(exc)}{_remote_hint(exc)}", file=sys.stderr)
        return 1
    except Exception as exc:  # a bug: one line, the traceback only when asked for
        if os.environ.get(DEBUG_ENV):
            raise
        print(
            f"distsgd: internal error: {type(exc).__name__}: {_one_line(exc)} (a bug in "
            f"distsgd; rerun with {DEBUG_ENV}=1 for the traceback and report it)",
            file=sys.stderr,
        )
        return 1


def _remote_hint(exc: RemoteError) -> str:
    """What to check for a failed call to a parameter server, by its status code."""
    if exc.code == grpc.StatusCode.UNAUTHENTICATED:
        return ""  # the server's message names the fix (the shared secret)
    if exc.code == grpc.StatusCode.UNAVAILABLE:
        return (
            f"; check that a server listens at {exc.address} (distsgd server) and that the "
            "cluster names its address"
        )
    if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "; the other tasks of the run must start within the wait it names"
    return ""


def _one_line(exc: BaseException) -> str:
    """The error's message as one line (multi-line messages keep their first line's sense)."""
    text = str(exc).strip()
    return " ".join(text.split("\n")) if text else type(exc).__name__


if __name__ == "__main__":
    logging.captureWarnings(True)
    sys.exit(main())
