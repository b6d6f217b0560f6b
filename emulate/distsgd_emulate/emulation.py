"""A local run on emulated hosts (``--hosts``): the hosts made before the first task, and
their record in the run folder, ``hosts.json`` (the plan, the placement, the links as applied,
the network faults applied with their times (:mod:`distsgd_emulate.link_faults`) and, once the
run ends, the bytes each host's link carried, and ``pair_bytes``: the bytes each host sent to
each other host, to the launcher and elsewhere, :meth:`EmulatedHosts.pair_counters`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distsgd.util import write_atomic
from distsgd_emulate.hosts import MANAGEMENT_ADDRESS, HostPlan
from distsgd_emulate.link_sampler import WINDOW_S
from distsgd_emulate.netns import EmulatedHosts
from distsgd_emulate.netns_disks import HostDisks
from distsgd_emulate.netns_keeper import NetnsError

__all__ = ["HOSTS_FILE", "close_hosts", "record_faults", "start_hosts"]

log = logging.getLogger(__name__)

HOSTS_FILE = "hosts.json"
"""The emulated hosts of a run, in its folder."""


def start_hosts(plan: HostPlan, run_dir: Path) -> EmulatedHosts:
    """The run's emulated hosts (``plan``), started, with a management link to this namespace
    (the launcher reaches the servers, the workers its rendezvous store). Call from the thread
    that will close them (the keepers die with it)."""
    # each host its own disk, seen by its tasks at RUN_DIR/wal (their logs, their replicas')
    disks = HostDisks(root=run_dir / "disks", at=run_dir / "wal", keep=False)
    hosts = EmulatedHosts(plan, management=True, disks=disks)
    hosts.start()
    try:
        _write(run_dir, hosts, counters=None, faults=())
    except BaseException:
        hosts.close(check=False)
        raise
    return hosts


def record_faults(run_dir: Path, hosts: EmulatedHosts, faults: Sequence[dict[str, Any]]) -> None:
    """``hosts.json`` again, with the network faults applied so far (no counters yet)."""
    _write(run_dir, hosts, counters=None, faults=faults)


def close_hosts(
    hosts: EmulatedHosts | None,
    run_dir: Path,
    faults: Sequence[dict[str, Any]] = (),
    busiest: dict[str, dict[str, float]] | None = None,
) -> None:
    """Record each host's bytes, per pair of hosts, its ``busiest`` window's rates (from
    :mod:`distsgd_emulate.link_sampler`) and the network ``faults`` applied in ``hosts.json``,
    then take the hosts down (after the tasks have ended). A failure to count is
    logged, never raised: the hosts go down either way."""
    if hosts is None:
        return
    try:
        counted = {
            name: {"sent": link.sent, "received": link.received}
            for name, link in hosts.counters().items()
        }
        pairs = hosts.pair_counters()
        _write(run_dir, hosts, counters=counted, faults=faults, pairs=pairs, busiest=busiest)
    except (NetnsError, OSError, ValueError) as e:
        log.warning("could not record the hosts' byte counters: %s", e)
    finally:
        hosts.close(check=False)


def _write(
    run_dir: Path,
    hosts: EmulatedHosts,
    *,
    counters: dict[str, Any] | None,
    faults: Sequence[dict[str, Any]],
    pairs: dict[str, dict[str, int]] | None = None,
    busiest: dict[str, dict[str, float]] | None = None,
) -> None:
    plan = hosts.plan
    applied = {link.host: link for link in hosts.applied}
    record = {
        "placement": plan.policy.value,
        "privilege": str(hosts.privilege),
        "prefix": hosts.prefix,
        "launcher_address": MANAGEMENT_ADDRESS,
        "keepers": dict(hosts.keepers),
        "hosts": [
            {
                "name": host.name,
                "address": host.address,
                "tasks": [task.name for task in host.tasks],
                "link": None if host.link is None else host.link.text,
                "rate_bits": applied[host.name].rate_bits,
                "burst_bytes": applied[host.name].burst_bytes,
                "limit_bytes": applied[host.name].limit_bytes,
                "not_applied": list(applied[host.name].missing),
            }
            for host in plan.hosts
        ],
        "faults": list(faults),
        "bytes": counters,
        "pair_bytes": pairs,
        "busiest_window": None if busiest is None else {"window_s": WINDOW_S, "hosts": busiest},
    }
    write_atomic(run_dir / HOSTS_FILE, json.dumps(record, indent=2) + "\n")
