"""``distsgd-emulate``: the emulators' own command (``python -m distsgd_emulate``).

``hosts up N`` makes N network namespaces with their own addresses joined by a switch (root),
keeps them until SIGINT or SIGTERM and then removes every namespace and link; ``hosts exec HOST
-- COMMAND`` runs a command inside one (:mod:`distsgd_emulate.machines`). See
docs/guide/many-machines.md. ``k8s OUT_DIR`` runs the pods of manifests written by ``distsgd k8s
render`` on this machine, as Kubernetes would (:mod:`distsgd_emulate.k8s_local`;
docs/kubernetes.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distsgd.cli.one_line import OneLineParser

PROG = "distsgd-emulate"
DEFAULT_DIR = Path("distsgd-hosts")
"""Where ``hosts up`` records its hosts unless ``--dir`` says otherwise."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of every ``distsgd-emulate`` subcommand."""
    parser = OneLineParser(
        prog=PROG,
        description="Emulators for trying distsgd's cluster runs on one machine: emulated "
        "hosts (network namespaces) and a Kubernetes JobSet run as local processes.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_hosts_command(sub)
    add_k8s_command(sub)
    return parser


def add_hosts_command(sub: Any) -> None:
    """The ``hosts`` command and its ``up`` and ``exec`` actions."""
    hosts = sub.add_parser(
        "hosts",
        help="emulated machines on this one (network namespaces, root): for tasks started "
        "by hand, as on a real cluster",
        description="Make emulated hosts (network namespaces with addresses 198.18.0.1, .2, "
        "... joined by a switch; this machine is 198.18.0.253 to them; `ip netns list` shows "
        "them as distsgd-host0, ...) and run commands in them. `distsgd run --hosts N` does "
        "this for its own tasks.",
    )
    actions = hosts.add_subparsers(dest="hosts_command", required=True, metavar="ACTION")
    up = actions.add_parser(
        "up", help="make N hosts and keep them until Ctrl-C (or SIGTERM), then remove them"
    )
    up.add_argument("count", type=int, metavar="N", help="how many hosts (1 to 252)")
    up.add_argument(
        "--link",
        action="append",
        default=[],
        metavar="SPEC",
        help="shape the hosts' links: RATE for every host (1gbit, 100mbit), hostI=RATE for one; "
        "repeatable; default unshaped",
    )
    up.add_argument(
        "--disks",
        type=Path,
        default=None,
        metavar="PATH",
        help="give each host a private disk that its commands see at PATH (backed by "
        "--dir/disks/HOST, removed when the hosts go down): what one host writes under PATH "
        "another reaches only over the network; default none, the machine's file system",
    )
    _dir_flag(up)
    run = actions.add_parser(
        "exec",
        help=f"run a command inside one host: {PROG} hosts exec host1 -- distsgd worker ...",
    )
    _dir_flag(run)
    run.add_argument(
        "host", help="the host's name (host0, host1, ...); then -- and the command to run"
    )


def add_k8s_command(sub: Any) -> None:
    """The ``k8s`` command: a rendered JobSet's pods run here."""
    k8s = sub.add_parser(
        "k8s",
        usage=f"{PROG} k8s OUT_DIR [--local-dir DIR] [--quiet]",
        help="run the pods of a rendered OUT_DIR on this machine, as Kubernetes would",
        description="Run every pod of OUT_DIR/jobset.yaml (written by distsgd k8s render) as a "
        "local process: the container's "
        "command and args, the environment Kubernetes gives it, host names mapped to loopback "
        "ports, each pod's own storage a folder of its own; the run control first, then the "
        "servers, the workers once the servers are ready, done when the workers are.",
    )
    k8s.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="the rendered manifests")
    k8s.add_argument(
        "--local-dir",
        type=Path,
        default=None,
        help="folder for the volumes (the claim, each pod's own storage) and logs "
        "(default OUT_DIR/local-<time>)",
    )
    k8s.add_argument("--quiet", action="store_true", help="hide the pods' log lines")


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """``hosts exec``'s command, after its ``--``, split off before argparse sees it (whose
    remainder arguments do not survive a ``--`` inside a subcommand); other commands whole."""
    if argv[:2] == ["hosts", "exec"] and "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def _dir_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_DIR,
        help=f"where `hosts up` records its hosts (hosts.json, 0600); default ./{DEFAULT_DIR}",
    )


def hosts_main(args: argparse.Namespace) -> int:
    from distsgd_emulate.hosts import parse_links
    from distsgd_emulate.machines import enter_argv, keep_hosts

    if args.hosts_command == "exec":
        argv = enter_argv(args.dir, args.host, args.command_argv)
        os.execvp(argv[0], argv)  # the command's exit status and signals are the caller's
    links = parse_links(args.link)
    stop = threading.Event()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, lambda *_: stop.set())
    try:
        keep_hosts(count=args.count, links=links, folder=args.dir, stop=stop, disks=args.disks)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"{PROG}: emulated hosts taken down", file=sys.stderr)
    return 0


def k8s_main(args: argparse.Namespace) -> int:
    from distsgd.launcher.progress import Console
    from distsgd_emulate.k8s_local import run_local

    return run_local(args.out_dir, local_dir=args.local_dir, console=Console(quiet=args.quiet))


def main(argv: Sequence[str] | None = None) -> int:
    """The console script; 2 and one line for a mistake (a ValueError, a bad flag)."""
    from distsgd.cluster import ClusterSpecError

    argv, command = split_command(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    args.command_argv = command
    try:
        return hosts_main(args) if args.command == "hosts" else k8s_main(args)
    except (ValueError, ClusterSpecError, OSError) as exc:
        print(f"{PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
