"""The ``distsgd`` command line: :func:`build_parser` (the flags of ``run``, ``demo`` and
``compare`` here; ``plan``, ``elastic``, ``k8s`` and the cluster's tasks, ``tasks.py``, add theirs
in their modules), and :func:`parse_argv`, which reads a command line as :mod:`distsgd.cli.main`
runs it."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distsgd import __version__
from distsgd.cli import elastic, k8s, plan, tasks
from distsgd.cli.flags import (
    add_help_scheme_flag,
    add_scheme_flags,
    add_scheme_option_flags,
    add_tls_flags,
    add_training_flags,
)
from distsgd.cli.one_line import OneLineParser
from distsgd.control.rollback import MAX_ROLLBACKS
from distsgd.control.waitfor import STALL_S
from distsgd.launcher.config import (
    DEFAULT_CHECKPOINT_SECONDS,
    DEFAULT_MAX_RESTARTS,
    DOCTOR_AFTER,
    FORK_SERVER_DEFAULT,
)
from distsgd.launcher.metrics_endpoint import DEFAULT_ADDRESS as DEFAULT_METRICS_ADDRESS

DESCRIPTION = (
    "The ``distsgd`` command: run, demo, compare, plan, server, worker, agent, elastic, "
    "doctor, k8s."
)


def add_launch_flags(parser: argparse.ArgumentParser, *, compare: bool = False) -> None:
    """The flags of run and demo; compare has --schemes and --out instead of --scheme,
    --run-dir and --quiet (its runs' output goes to their launcher.log)."""
    parser.add_argument("--workers", type=int, default=2, help="worker tasks (default 2)")
    parser.add_argument(
        "--ps", type=int, help="parameter-server tasks (default 1; 0 for allreduce)"
    )
    if not compare:
        parser.add_argument(
            "--run-dir", type=Path, help="run folder (default ./distsgd-runs/<time>-<scheme>)"
        )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per worker (default cores/workers)"
    )
    if not compare:
        parser.add_argument("--quiet", action="store_true", help="hide task log lines")
        parser.add_argument(
            "--ray",
            metavar="ADDRESS",
            help="run the tasks as Ray actors (pip install 'distsgd[ray]'): --ray alone on a "
            "local Ray instance on 127.0.0.1, --ray=ADDRESS on the Ray cluster there ('auto', "
            "HOST:PORT, ray://...)",
        )
        parser.add_argument(
            "--fork-server",
            choices=("on", "off"),
            default="on" if FORK_SERVER_DEFAULT else "off",
            help="fork each local worker from one process that imported torch once, instead of "
            "starting a new interpreter: faster starts and restarts (default on, on Linux; off "
            "under --hosts)",
        )
    _add_fault_tolerance_flags(parser, compare=compare)
    if not compare:
        _add_elastic_flags(parser)
    add_tls_flags(parser)
    add_help_scheme_flag(parser)
    (add_scheme_option_flags if compare else add_scheme_flags)(parser)
    add_training_flags(parser)


def _add_fault_tolerance_flags(parser: argparse.ArgumentParser, *, compare: bool) -> None:
    ft = parser.add_argument_group("fault tolerance")
    ft.add_argument(
        "--checkpoint-every",
        metavar="N|Ns",
        help="checkpoint every N steps of each worker, or every N seconds with 's' (e.g. 50, "
        f"30s; default {DEFAULT_CHECKPOINT_SECONDS:.0f}s, 0 = off)",
    )
    if not compare:
        ft.add_argument(
            "--wal",
            choices=("on", "local", "off"),
            default="on",
            help="each parameter server logs every update before applying it, so that a killed "
            "one comes back without losing any; under --hosts the log is also kept by a replica "
            "on another host, so that a lost host loses none (default on; local: no replica; "
            "see docs/fault-tolerance.md)",
        )
        ft.add_argument(
            "--rebalance",
            choices=("off", "auto"),
            default="off",
            help="auto: move pieces from a parameter server carrying over 1.2x the mean load "
            "to the least loaded, at one version and losing no update (asynchronous schemes, "
            "--ps 2 or more; see docs/performance.md, 'Re-balancing'); default off",
        )
    ft.add_argument(
        "--max-restarts",
        type=int,
        default=DEFAULT_MAX_RESTARTS,
        help="restart a dead task up to K times in a row from its last checkpoint (default "
        f"{DEFAULT_MAX_RESTARTS}; 0 = stop the run at the first failure)",
    )
    if not compare:
        ft.add_argument(
            "--max-rollbacks",
            type=int,
            default=MAX_ROLLBACKS,
            help="a run whose loss spikes or turns NaN goes back to its last good checkpoint "
            f"at half the rate, up to K times (default {MAX_ROLLBACKS}; 0 = stop it at once, "
            "exit code 3)",
        )
    ft.add_argument(
        "--inject-fault",
        action="append",
        default=[],
        metavar="SPEC",
        help="kill:worker:1@step=50, kill:ps:0@step=120, delay:worker:2=200ms, "
        "partition:worker:0@step=30,for=10s (simulated by the worker; under --hosts its host is "
        "cut off); with --hosts also partition:ps:0@step=30,for=10s and "
        "slow:ps:0@step=40=10mbit[,for=10s] (repeatable; docs/fault-tolerance.md)",
    )


def _add_host_flags(parser: argparse.ArgumentParser) -> None:
    hosts = parser.add_argument_group(
        "emulated hosts (network namespaces on this machine, distsgd_emulate/netns.py; root)"
    )
    hosts.add_argument(
        "--hosts",
        type=int,
        default=0,
        metavar="N",
        help="place the tasks on N emulated hosts, each a network namespace with its own "
        "address (198.18.0.x), joined by a switch; tasks bind their host's address, and "
        "workers are started as processes (--fork-server is off: a forked worker would stay "
        "in the launcher's namespace); default 0, no emulation",
    )
    hosts.add_argument(
        "--link",
        action="append",
        default=[],
        metavar="SPEC",
        help="shape the hosts' links: RATE[,DELAY[,JITTER]] for every host (1gbit, "
        "100mbit,5ms; the delay is waited in user space by each parameter-server call, "
        "not by collective traffic), NAME=SPEC for one host or "
        "task (host1=10mbit, worker1=10mbit); repeatable; needs --hosts",
    )
    hosts.add_argument(
        "--placement",
        choices=("spread", "pack"),
        default="spread",
        help="spread: tasks dealt round-robin over the hosts, servers first (ps0->host0, "
        "ps1->host1, worker0->host2, ...); pack: contiguous blocks; default spread. With "
        "--ray, over the Ray cluster's nodes: spread puts each server on a node of its own "
        "where there are enough and spreads the workers; pack puts every task on one node",
    )


def _add_metrics_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-address",
        default=DEFAULT_METRICS_ADDRESS,
        metavar="HOST:PORT|off",
        help="where the launcher serves GET /metrics for Prometheus (an IP address or "
        "localhost; port 0: a free one, written to RUN_DIR/metrics.address; a non-loopback "
        "address is reachable by anyone who can reach this machine); off: none; default "
        f"{DEFAULT_METRICS_ADDRESS}",
    )


def _add_elastic_flags(parser: argparse.ArgumentParser) -> None:
    elastic = parser.add_argument_group(
        "elastic runs (parameter-server schemes need --world-size dynamic)"
    )
    elastic.add_argument(
        "--min-workers",
        type=int,
        default=0,
        help="fewest workers the run goes on with (distsgd elastic scale's lower bound; a worker "
        "out of restarts is dropped while this many remain; default --workers)",
    )
    elastic.add_argument(
        "--max-workers",
        type=int,
        default=0,
        help="most workers distsgd elastic scale may grow the run to (default --workers)",
    )
    elastic.add_argument(
        "--evict-after",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="the servers evict a worker silent this long (default 60)",
    )


def _add_compare(sub: Any) -> None:
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
        help="comma-separated schemes to compare, in this order (list: --help-scheme). An "
        "entry may be a variant with its own settings in parentheses, e.g. "
        "'downpour,downpour(server_lr=1),hogwild(lr=0.15)' (quote it for the shell): KEY is "
        "one of the scheme's options or a training flag's name (lr, momentum, batch_size, "
        "...; '-' or '_'), and its value beats the flag given for all runs. Each entry is "
        "labelled as written and runs in OUT/runs/FOLDER: the name, or for a variant the "
        "name and its settings joined by '_' (downpour_server_lr=1)",
    )
    compare.add_argument(
        "--out", type=Path, help="output folder, new or empty (default ./distsgd-compare/<time>)"
    )
    compare.add_argument(
        "--target",
        type=float,
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
    add_launch_flags(compare, compare=True)
    compare.add_argument("script", nargs="?", help="training script (default: the bundled demo)")
    compare.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="arguments passed to the script"
    )


def build_parser() -> argparse.ArgumentParser:
    """The parser of every ``distsgd`` subcommand."""
    parser = OneLineParser(prog="distsgd", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"distsgd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run(sub)
    _add_demo(sub)
    _add_compare(sub)
    plan.add_command(sub)
    tasks.add_commands(sub)  # server, worker, agent
    elastic.add_command(sub)
    _add_doctor(sub)
    k8s.add_command(sub, add_launch_flags)
    return parser


RUN_CORE = (
    *("--workers", "--ps", "--scheme", "--help-scheme", "--epochs", "--batch-size", "--lr"),
    *("--run-dir", "--resume", "--checkpoint-every", "--inject-fault", "--hosts", "--ray"),
)
"""The flags ``distsgd run --help`` shows (with ``-h`` and ``--help-all``); ``--help-all``
shows every one."""


class _HelpAll(argparse.Action):
    """``--help-all``: the help with every flag, then exit."""

    def __init__(self, option_strings: Sequence[str], dest: str, **_: Any) -> None:
        super().__init__(
            option_strings, dest, nargs=0, help="show every flag (--help shows the core ones)"
        )

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        for action in parser._actions:
            action.help = getattr(action, "full_help", action.help)
        parser.epilog = None
        parser.print_help()
        parser.exit()


def _core_only(parser: argparse.ArgumentParser, core: Sequence[str], prog: str) -> None:
    """``--help`` shows the ``core`` flags only; ``--help-all`` every one."""
    parser.add_argument("--help-all", action=_HelpAll)
    shown = {*core, "-h", "--help", "--help-all"}
    hidden = 0
    for action in parser._actions:
        if action.option_strings and not shown & set(action.option_strings):
            action.full_help = action.help  # type: ignore[attr-defined]
            action.help = argparse.SUPPRESS
            hidden += 1
    parser.epilog = f"{hidden} more flags (faults, elastic runs, emulated hosts, TLS, each "
    parser.epilog += f"scheme's options, the training settings): {prog} --help-all"


def _add_run(sub: Any) -> None:
    run = sub.add_parser("run", help="train a script on a local cluster of N workers and M ps")
    add_launch_flags(run)
    _add_host_flags(run)
    _add_metrics_flag(run)
    _add_doctor_flag(run)
    run.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue an earlier run from its last complete checkpoint (same script, options)",
    )
    run.add_argument("script", nargs="?", help="training script that calls distsgd.train")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    _core_only(run, RUN_CORE, "distsgd run")


def _add_demo(sub: Any) -> None:
    demo = sub.add_parser(
        "demo", help="train a bundled model: the digits CNN (prints the test accuracy last)"
    )
    demo.add_argument(
        "--model",
        choices=("digits", "lm"),
        default="digits",
        help="digits: a CNN on 8x8 handwritten digits (prints the test accuracy); lm: a small "
        "GPT on distsgd's own guide, read as bytes (prints the test loss)",
    )
    add_launch_flags(demo)
    _add_host_flags(demo)
    _add_metrics_flag(demo)
    _add_doctor_flag(demo)


def _add_doctor(sub: Any) -> None:
    doctor = sub.add_parser(
        "doctor",
        help="say which task holds a running run up and at which frame; --watch it live; or "
        "show what a checkpoint holds",
    )
    doctor.add_argument(
        "path", type=Path, help="a run folder, a checkpoint folder, or a psN.npz / worker file"
    )
    doctor.add_argument(
        "--watch",
        action="store_true",
        help="a live view of the run's tasks (rate, phase split, staleness, servers' load, "
        "stragglers), redrawn every second until Ctrl-C",
    )
    doctor.add_argument(
        "--stall",
        type=float,
        default=STALL_S,
        metavar="SECONDS",
        help=f"a worker that has not stepped for this long is stuck (default {STALL_S:g})",
    )


def _add_doctor_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--doctor-after",
        type=float,
        default=DOCTOR_AFTER,
        metavar="SECONDS",
        help="seconds without progress after which the launcher runs distsgd doctor on the "
        f"run by itself and prints the culprit (0: never); default {DOCTOR_AFTER:g}",
    )


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
