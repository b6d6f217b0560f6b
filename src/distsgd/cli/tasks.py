"""The commands that run a cluster started by hand, one task or one machine at a time:
``server``, ``worker`` and ``agent`` (their flags; :mod:`distsgd.cli.main` and
:mod:`distsgd.cli.agent` run them), and :func:`run_task`, which runs a training script as one
worker task in this process (``distsgd worker``, ``distsgd elastic join``)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distsgd.cli.flags import (
    add_cluster_flags,
    add_scheme_flags,
    add_tls_flags,
    add_training_flags,
)


def add_commands(sub: Any) -> None:
    """``server``, ``worker`` and ``agent``."""
    _add_server(sub)
    _add_worker(sub)
    _add_agent(sub)


def run_task(env: Any, script: str, script_args: Sequence[str]) -> None:
    """Run ``script`` as the task ``env`` describes, in this process, and exit with its code."""
    from distsgd.control.task import ENV_VAR
    from distsgd.launcher.bootstrap import exit_now
    from distsgd.launcher.bootstrap import main as bootstrap_main

    os.environ[ENV_VAR] = env.to_json()
    exit_now(bootstrap_main([script, *script_args]))


def _add_server(sub: Any) -> None:
    server = sub.add_parser("server", help="run one parameter-server task")
    server.add_argument(
        "--job",
        "--job_name",
        dest="job",
        default="ps",
        choices=("ps", "replica", "control"),
        help="ps (default); replica: keep the write-ahead log of ps --task on this host "
        "(in --wal-dir), for a server started with --replica; control: the run control, "
        "assembling --run-dir from what the tasks given --control send (the control pod of "
        "distsgd k8s render)",
    )
    server.add_argument("--task", "--task_index", dest="task", type=int, help="ps task index")
    server.add_argument(
        "--address", help="listen on HOST:PORT instead of the spec's address (port 0 = any)"
    )
    server.add_argument(
        "--address-file", type=Path, help="write the address really bound to this file"
    )
    server.add_argument(
        "--control",
        metavar="HOST:PORT",
        help="report the address really bound to the launcher's run control there (what "
        "distsgd run gives tasks that do not share its disk)",
    )
    server.add_argument(
        "--checkpoint-dir", type=Path, help="folder the Checkpoint call writes into"
    )
    server.add_argument(
        "--run-dir", type=Path, help="(--job control) the run folder it assembles for the tasks"
    )
    server.add_argument("--restore", type=Path, help="start from this shard checkpoint (psN.npz)")
    server.add_argument(
        "--restore-latest",
        action="store_true",
        help="start from this shard's newest file under --checkpoint-dir, if there is one "
        "(a restarted server: its container, or a pod)",
    )
    _add_wal_flags(server)
    server.add_argument(
        "--run-id", default="", help="the run's id, which a replica and its server must share"
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
    server.add_argument(
        "--inject-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help=argparse.SUPPRESS,  # distsgd run --inject-fault delay:ps:N=DURATION (a slow server)
    )
    add_cluster_flags(server)
    add_tls_flags(server)


def _add_wal_flags(server: Any) -> None:
    """The server's write-ahead log: on or off, its folder, its replica."""
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
        "--replica",
        metavar="HOST:PORT",
        help="mirror the write-ahead log to the replica there (distsgd server --job replica on "
        "another host): a push is acknowledged once both hold it, and a server started on an "
        "empty --wal-dir fetches the replica's copy first",
    )


def _add_worker(sub: Any) -> None:
    worker = sub.add_parser("worker", help="run a training script as one worker task of a cluster")
    worker.add_argument(
        "--task", "--task_index", dest="task", type=int, help="worker index (0 = chief)"
    )
    worker.add_argument("--run-dir", type=Path, help="folder for metrics and results")
    worker.add_argument(
        "--control",
        metavar="HOST:PORT",
        default="",
        help="send the run folder's files (metrics, result, final model) to the run control "
        "there (distsgd server --job control) instead of writing them into --run-dir, which "
        "then holds this worker's checkpoints only",
    )
    worker.add_argument(
        "--rendezvous",
        default="",
        help="torch.distributed store HOST:PORT (default: chief's address)",
    )
    worker.add_argument(
        "--checkpoint-every",
        metavar="N|Ns",
        help="checkpoint into RUN_DIR/checkpoints every N steps, or every N seconds with 's' "
        "(default off; give the servers --checkpoint-dir RUN_DIR/checkpoints)",
    )
    worker.add_argument(
        "--resume-latest",
        action="store_true",
        help="continue from this worker's newest state in RUN_DIR/checkpoints, if there is one "
        "(a restarted worker)",
    )
    add_cluster_flags(worker)
    add_tls_flags(worker)
    add_scheme_flags(worker)
    add_training_flags(worker)
    worker.add_argument("script")
    worker.add_argument("script_args", nargs=argparse.REMAINDER)


def _add_agent(sub: Any) -> None:
    agent = sub.add_parser(
        "agent",
        help="run this machine's tasks of a cluster started by hand, restarting any that dies",
        description="One per machine: starts this machine's servers and workers (the command "
        "lines of distsgd server and distsgd worker), restarts a task that dies in place, and "
        "ends when the run is over. Everything after -- goes to each worker: "
        "distsgd agent --tasks ps:0,worker:1 --cluster cluster.toml -- --scheme hogwild train.py",
    )
    agent.add_argument(
        "--tasks", required=True, help="this machine's tasks, e.g. ps:0,worker:1 (servers first)"
    )
    agent.add_argument(
        "--dir",
        type=Path,
        default=Path("distsgd-agent"),
        help="this machine's folder: task logs, the servers' write-ahead logs and shard files "
        "(default ./distsgd-agent)",
    )
    agent.add_argument(
        "--max-restarts", type=int, default=3, help="restarts of a task in a row (default 3)"
    )
    agent.add_argument(
        "--healthy-seconds",
        type=float,
        default=60.0,
        help="a task that ran this long has its restarts back (default 60)",
    )
    agent.add_argument(
        "--evict-after",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="the servers evict a worker silent this long, e.g. a lost machine's (default 60)",
    )
    add_cluster_flags(agent)
    add_tls_flags(agent)
    agent.add_argument(
        "worker_args",
        nargs=argparse.REMAINDER,
        help="-- then each worker's flags, its script and the script's arguments",
    )
