"""``distsgd hosts up`` and ``distsgd hosts exec``: emulated machines for tasks started by hand.

``up N`` makes N network namespaces with their own addresses joined by a switch (root), keeps
them until SIGINT or SIGTERM and then removes every namespace and link; ``exec HOST --
COMMAND`` runs a command inside one (``distsgd.launcher.machines``). See the README's
"Many machines".
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

DEFAULT_DIR = Path("distsgd-hosts")
"""Where ``hosts up`` records its hosts unless ``--dir`` says otherwise."""


def add_command(sub: Any) -> None:
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
        help="run a command inside one host: distsgd hosts exec host1 -- distsgd worker ...",
    )
    _dir_flag(run)
    run.add_argument(
        "host", help="the host's name (host0, host1, ...); then -- and the command to run"
    )


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


def main(args: argparse.Namespace) -> int:
    from distsgd.cluster.hosts import parse_links
    from distsgd.launcher.machines import enter_argv, keep_hosts

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
    print("distsgd: emulated hosts taken down", file=sys.stderr)
    return 0
