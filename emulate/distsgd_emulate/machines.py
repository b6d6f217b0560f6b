"""Emulated machines for tasks started by hand (``distsgd-emulate hosts up`` / ``hosts exec``).

``distsgd run --hosts N`` makes its hosts and places its own tasks on them. For the commands of
docs/guide/many-machines.md (one ``distsgd server`` or ``distsgd worker`` per machine, a cluster
file, a secret, mutual TLS) the hosts must outlive any one command: ``hosts up`` makes them,
records them in ``DIR/hosts.json`` (0600) and keeps them until it is sent SIGINT or SIGTERM;
``hosts exec HOST -- COMMAND`` runs a command inside one of them. This machine reaches every
host at its address (198.18.0.1, .2, ...) over the management link, from 198.18.0.253.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from distsgd.util import write_atomic
from distsgd_emulate.hosts import MANAGEMENT_ADDRESS, Links, plan_machines
from distsgd_emulate.netns import EmulatedHosts
from distsgd_emulate.netns_disks import HostDisks
from distsgd_emulate.netns_disks import enter_argv as disk_enter_argv

__all__ = ["STATE_FILE", "enter_argv", "keep_hosts"]

log = logging.getLogger(__name__)

STATE_FILE = "hosts.json"
"""The record ``hosts up`` writes in its folder while the hosts are up."""


def keep_hosts(
    *,
    count: int,
    links: Links,
    folder: Path,
    stop: threading.Event,
    announce: bool = True,
    disks: Path | None = None,
) -> None:
    """Make ``count`` emulated hosts, record them in ``folder``, keep them until ``stop`` is
    set, then take them down and remove the record (also when interrupted). ``disks``: each
    host sees a private disk there (backed by ``folder/disks/HOST``, removed at the end)."""
    private = None if disks is None else HostDisks(root=folder / "disks", at=disks, keep=False)
    plan = plan_machines(count=count, links=links)
    hosts = EmulatedHosts(plan, management=True, disks=private)
    folder.mkdir(parents=True, exist_ok=True)
    state = folder / STATE_FILE
    hosts.start()
    try:
        record = {
            "pid": os.getpid(),
            "prefix": hosts.prefix,
            "this_machine": MANAGEMENT_ADDRESS,
            "disks": None if private is None else str(private.at),
            "hosts": [
                {
                    "name": host.name,
                    "address": host.address,
                    "link": None if host.link is None else host.link.text,
                    "keeper": hosts.keepers[host.name],
                    "netns": hosts.names.get(host.name),
                }
                for host in hosts.plan.hosts
            ],
        }
        write_atomic(state, json.dumps(record, indent=2) + "\n")
        os.chmod(state, 0o600)
        if announce:
            _announce(record, folder)
        stop.wait()
    finally:
        state.unlink(missing_ok=True)
        hosts.close(check=False)
        log.info("emulated hosts %s taken down", hosts.prefix)


def _announce(record: dict, folder: Path) -> None:
    listed = ", ".join(
        f"{h['name']} {h['address']}" + (f" ({h['link']})" if h["link"] else "")
        for h in record["hosts"]
    )
    named = record["hosts"][0]["netns"]
    also = f" (or `ip netns exec {named} COMMAND`; `ip netns list` shows them)" if named else ""
    log.warning(
        "%d emulated hosts up: %s; this machine is %s to them. Run a task on one with "
        "`distsgd hosts exec --dir %s HOST -- COMMAND`%s; Ctrl-C takes them down.",
        len(record["hosts"]),
        listed,
        record["this_machine"],
        folder,
        also,
    )


def enter_argv(folder: Path, host: str, command: Sequence[str]) -> list[str]:
    """The argv that runs ``command`` inside ``host`` of the hosts recorded in ``folder``;
    ValueError, naming the fix, when they are not up or ``host`` is not one of them."""
    state = folder / STATE_FILE
    try:
        record = json.loads(state.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"no emulated hosts are up in {folder}; start them with `distsgd hosts up N "
            f"--dir {folder}` first"
        ) from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{state}: unreadable ({e}); restart `distsgd hosts up`") from None
    if not command:
        raise ValueError("no command to run; give one after --, e.g. -- distsgd server ...")
    hosts = {h.get("name"): h for h in record.get("hosts", []) if isinstance(h, dict)}
    if host not in hosts:
        names = ", ".join(sorted(str(name) for name in hosts))
        raise ValueError(f"no host {host!r} in {state}; use one of {names}")
    keeper = hosts[host].get("keeper")
    owner = record.get("pid")
    if not isinstance(keeper, int) or not isinstance(owner, int) or _parent(keeper) != owner:
        raise ValueError(
            f"the hosts in {state} are gone (their keeper {keeper} no longer belongs to "
            f"`distsgd hosts up`, pid {owner}); start them again"
        )
    prefix = ["nsenter", f"--net=/proc/{keeper}/ns/net", "--"]
    if record.get("disks"):  # its private disk: its mount namespace too
        return [*disk_enter_argv(prefix, keeper), *command]
    return [*prefix, *command]


def _parent(pid: int) -> int | None:
    """The parent PID of ``pid`` from /proc, or None if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    return None
