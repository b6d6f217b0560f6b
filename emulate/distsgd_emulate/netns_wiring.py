"""The wiring of emulated hosts (:class:`~distsgd_emulate.netns.EmulatedHosts`) as they start:
the switch's bridge, one veth pair per host with its addresses, the management link to the
creator's namespace, the hosts' ``ip netns`` names, and each link's shapers and counting classes
(:mod:`distsgd_emulate.netns_shaping`); and the one way every ``ip``/``tc`` script runs
(:func:`batch`). See :mod:`distsgd_emulate.netns` for the layout these build.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING

from distsgd_emulate import netns_keeper, netns_shaping
from distsgd_emulate.hosts import MANAGEMENT_ADDRESS, Host, HostPlan, LinkSpec
from distsgd_emulate.netns_keeper import NetnsError
from distsgd_emulate.netns_shaping import MANAGEMENT_MINOR, tbf_sizes

if TYPE_CHECKING:
    from distsgd_emulate.netns import EmulatedHosts

__all__ = [
    "AppliedLink",
    "batch",
    "destinations",
    "egress",
    "name_hosts",
    "shape",
    "wire",
    "wire_management",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class AppliedLink:
    """What of a host's link was applied to its namespace's interfaces."""

    host: str
    """The host's name."""
    spec: LinkSpec | None
    """The link asked for; None: unshaped."""
    rate_bits: int | None
    """The rate the shaper enforces in each direction, bits/s; None: no shaper."""
    burst_bytes: int | None
    """The token bucket's size (``tbf`` burst); None: no shaper."""
    limit_bytes: int | None
    """The bytes that may queue behind the bucket (``tbf`` limit); None: no shaper."""
    delay_applied: bool
    """Whether the spec's delay and jitter are in effect (not on a kernel without netem; true
    where none was asked)."""

    @property
    def missing(self) -> tuple[str, ...]:
        """The parts of the spec not in effect, as text (``("delay 5ms",)``)."""
        if self.spec is None or self.delay_applied:
            return ()
        out = []
        if self.spec.delay_s:
            out.append(f"delay {self.spec.delay_s * 1e3:g}ms")
        if self.spec.jitter_s:
            out.append(f"jitter {self.spec.jitter_s * 1e3:g}ms")
        return tuple(out)


def batch(where: str, tool: str, full: list[str], script: str, timeout_s: float) -> None:
    """Run ``full`` (``tool -batch -``, in a namespace or here) with ``script`` on its input;
    NetnsError with the tool's stderr and the failed command, in one line."""
    try:
        done = subprocess.run(full, input=script, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise NetnsError(
            f"{tool} in {where} took over {timeout_s:g} s; is the machine busy?"
        ) from None
    if done.returncode == 0:
        return
    lines = script.splitlines()
    failed = re.search(r"Command failed -:(\d+)", done.stderr)
    command = lines[int(failed.group(1)) - 1] if failed else "; ".join(lines)
    stderr = re.sub(r"\s*Command failed -:\d+\s*", " ", done.stderr).strip().rstrip(".")
    raise NetnsError(
        f"{tool} failed in {where} (exit {done.returncode}): {stderr}; "
        f"the command was: {tool} {command}"
    )


def wire(hosts: EmulatedHosts) -> None:
    """The bridge, one veth pair per host (host end straight into its namespace), the
    addresses; no IPv6 link-local addresses, so the links carry only the run's bytes."""
    plan = hosts.plan
    lines = [
        "link set lo up",
        f"link add {hosts.bridge} type bridge",
        f"link set {hosts.bridge} addrgenmode none",
        f"addr add {plan.bridge_address}/{plan.prefix_len} dev {hosts.bridge}",
        f"link set {hosts.bridge} up",
    ]
    for host in plan.hosts:
        port = hosts.port(host)
        lines += [
            f"link add {port} type veth peer name eth0 netns {hosts.keepers[host.name]}",
            f"link set {port} addrgenmode none",
            f"link set {port} master {hosts.bridge}",
            f"link set {port} up",
        ]
    hosts.run("switch", "ip", "\n".join(lines) + "\n")
    for host in plan.hosts:
        script = (
            "link set lo up\n"
            "link set eth0 addrgenmode none\n"
            f"addr add {host.address}/{plan.prefix_len} dev eth0\n"
            "link set eth0 up\n"
        )
        hosts.run(host.name, "ip", script)


def wire_management(hosts: EmulatedHosts) -> None:
    """The unshaped veth from the switch to the creator's namespace (see the module's
    docstring): made in the switch namespace, one end moved to ours, so it goes with the
    switch keeper."""
    port, mine = f"{hosts.prefix}-mp", hosts.management_link
    if netns_keeper.address_here(MANAGEMENT_ADDRESS, hosts.timeout_s):
        raise ValueError(
            f"{MANAGEMENT_ADDRESS} is already on a link of this machine (another run on "
            "emulated hosts?); wait for it to end, one run on emulated hosts at a time"
        )
    hosts.run(
        "switch",
        "ip",
        f"link add {port} type veth peer name {mine} netns {os.getpid()}\n"
        f"link set {port} addrgenmode none\n"
        f"link set {port} master {hosts.bridge}\n"
        f"link set {port} up\n",
    )
    script = (
        f"link set {mine} addrgenmode none\n"
        f"addr add {MANAGEMENT_ADDRESS}/{hosts.plan.prefix_len} dev {mine}\n"
        f"link set {mine} up\n"
    )
    hosts.run_here("ip", script)


def name_hosts(hosts: EmulatedHosts) -> None:
    """Name each host's namespace for ``ip netns`` (``distsgd-host0``, ...), once the
    names a creator killed by SIGKILL left are removed (ours to remove: we hold the lock)."""
    stale = netns_keeper.stale_names()
    if stale:
        log.warning("removing emulated hosts' names left behind: %s", ", ".join(stale))
        netns_keeper.unname_namespaces(stale, hosts.timeout_s)
    for host in hosts.plan.hosts:
        name = netns_keeper.NAME_PREFIX + host.name
        try:
            netns_keeper.name_namespace(name, hosts.keepers[host.name], hosts.timeout_s)
        except NetnsError as e:  # a convenience: the hosts work without their names
            log.warning("the hosts are not named for `ip netns list`: %s", e)
            return
        hosts.names[host.name] = name


def shape(hosts: EmulatedHosts) -> tuple[AppliedLink, ...]:
    """``tbf`` on both ends of each shaped host's link: its eth0 (what the host sends) and
    its switch port (what it receives); on every host's eth0 the counting classes
    (:mod:`distsgd_emulate.netns_shaping`)."""
    applied, switch_lines = [], []
    for host in hosts.plan.hosts:
        rate = None if host.link is None else host.link.rate_bits
        hosts.run(host.name, "tc", egress(hosts.plan, host, rate))
        if rate is None or host.link is None:
            applied.append(
                AppliedLink(
                    host=host.name,
                    spec=None,
                    rate_bits=None,
                    burst_bytes=None,
                    limit_bytes=None,
                    delay_applied=True,
                )
            )
            continue
        burst, limit = tbf_sizes(rate)
        qdisc = f"root tbf rate {rate}bit burst {burst} limit {limit}"
        switch_lines.append(f"qdisc add dev {hosts.port(host)} {qdisc}")
        applied.append(
            AppliedLink(
                host=host.name,
                spec=host.link,
                rate_bits=rate,
                burst_bytes=burst,
                limit_bytes=limit,
                delay_applied=not (host.link.delay_s or host.link.jitter_s),
            )
        )
    if switch_lines:
        hosts.run("switch", "tc", "\n".join(switch_lines) + "\n")
    return tuple(applied)


def destinations(plan: HostPlan, host: Host) -> list[tuple[int, str]]:
    """(counting class, address) of every place ``host`` sends to that is counted apart."""
    out = [
        (netns_shaping.minor_of(other.index), other.address)
        for other in plan.hosts
        if other.index != host.index
    ]
    return [*out, (MANAGEMENT_MINOR, MANAGEMENT_ADDRESS)]


def egress(plan: HostPlan, host: Host, rate_bits: int | None) -> str:
    """The ``tc`` script that shapes (at ``rate_bits``, None: not) and counts ``host``'s
    eth0."""
    return netns_shaping.egress_script(
        "eth0",
        rate_bits=rate_bits,
        sizes=None if rate_bits is None else tbf_sizes(rate_bits),
        destinations=destinations(plan, host),
    )
