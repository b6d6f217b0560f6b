"""``distsgd elastic scale`` and ``distsgd elastic join``: change the size of a running elastic
run (docs/elastic.md), from its run folder."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from distsgd.cli.tasks import run_task


def add_command(sub: Any) -> None:
    """The ``elastic`` command and its actions, ``scale`` and ``join``."""
    elastic = sub.add_parser(
        "elastic",
        help="change the number of workers of a running elastic run (scale, join)",
        description="Change the size of a running elastic run (a distsgd run or demo started "
        "with --min-workers/--max-workers): scale asks its launcher for N workers, join adds "
        "one in this process.",
    )
    actions = elastic.add_subparsers(dest="elastic_command", required=True, metavar="ACTION")
    scale = actions.add_parser(
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
    join = actions.add_parser(
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
        help="this worker's index (default: the highest one the launcher has not started)",
    )


def main(args: argparse.Namespace) -> int:
    """Run ``distsgd elastic ACTION``."""
    return _scale(args) if args.elastic_command == "scale" else _join(args)


def _scale(args: argparse.Namespace) -> int:
    from distsgd.launcher.scale import request_scale

    answer = request_scale(args.run_dir, args.workers, timeout=args.timeout)
    if answer.get("event") == "scale_refused":
        raise ValueError(f"the launcher refused {args.workers} workers; see its output")
    print(
        f"distsgd: {args.run_dir}: {answer.get('workers_before')} -> {answer.get('workers')} "
        "workers"
    )
    return 0


def _join(args: argparse.Namespace) -> int:
    from distsgd.launcher.join import join_env
    from distsgd.transport.security import SECRET_FILE_ENV

    env, script, script_args, secret = join_env(args.run_dir, args.task)
    os.environ[SECRET_FILE_ENV] = str(secret)  # the worker's calls carry the run's secret
    print(f"distsgd: joining {args.run_dir} as worker{env.task_index}", file=sys.stderr)
    run_task(env, script, script_args)
    return 0  # not reached
