"""Emulated hosts on one machine: each host a network namespace of its own, joined to a switch
(a bridge in one more namespace) by a veth pair whose bandwidth the kernel's token-bucket
shaper (``tbf``) limits in both directions. The plan (how many hosts, addresses, links, which
task where) is :mod:`distsgd_emulate.hosts`; this module builds it and takes it down.

Layout, for hosts ``host0..hostN-1`` and a per-instance prefix ``P`` (``ds`` and 6 random hex
digits)::

    switch namespace:  lo, bridge P-br (198.18.0.254/24), ports P-p0 .. P-pN-1 (tbf each)
    host i namespace:  lo, eth0 (198.18.0.(i+1)/24, tbf), the peer of P-pi

Each namespace is held by a *keeper* (:mod:`distsgd_emulate.netns_keeper`): a process forked
from the creator, which unshares a new network namespace, asks for SIGKILL when the thread that
forked it ends (``PR_SET_PDEATHSIG``), and then execs ``sleep infinity`` (shown as
``distsgd-netns-keeper`` in ``ps``). The namespaces live by their keepers, not by a name
(``ip netns add``), which would outlive a SIGKILL of their creator: a keeper dies with it, and
with the last keeper of a namespace the namespace goes, and its links with it. So that ``ip
netns list`` shows them, the hosts of a set with a management link (one such set at a time on a
machine) also get names, ``distsgd-host0``, ... (``ip netns attach``, a bind mount under
/run/netns), removed by :meth:`EmulatedHosts.close`; a name left by a creator killed by SIGKILL
holds a namespace with only ``lo`` (its link went with the switch, which has no name) and is
removed when the next set starts. Links are made from inside the switch
namespace with their host end put straight into its host's namespace, so the machine's own
namespace never holds one of them, not even briefly.

Keepers tie themselves to the creating *thread*: create and close :class:`EmulatedHosts` from
a thread that lives as long as the hosts (the main thread, as the launcher does).

Privilege: as root the namespaces are made directly. Otherwise the switch keeper first makes a
user namespace in which it is root (where the kernel allows unprivileged user namespaces), the
host keepers join it, and every command (``ip``, ``tc``, the tasks) enters it too. Neither
possible: :func:`check_capable` refuses in one line.

Shaping (:mod:`distsgd_emulate.netns_shaping`: the tbf's sizes, the counting classes of each
host's bytes per destination): the rate comes from the host's :class:`LinkSpec`; this kernel has
no delay qdisc (``netem`` is absent), so a link's delay and jitter are recorded but not applied
(:class:`AppliedLink` says which parts were); each parameter-server call waits them in user
space instead (:mod:`distsgd.transport.delay`). The shaper
counts whole frames, headers included: one TCP transfer over a ``20mbit`` link carries
19.1-19.2 Mbit/s of payload (1448 of every 1514 bytes on the wire). Bulk transfers both ways
at once over one link get less each way (13-18 Mbit/s were measured on 20mbit): each
direction's ACKs wait behind the other's data in the shaper's FIFO queue, as on a real link
with a FIFO; this kernel has no flow-queueing qdisc (fq, fq_codel, sfq) to put under tbf.

Faults (``--inject-fault partition:`` and ``slow:`` under ``--hosts``): :meth:`EmulatedHosts.cut`
sets a host's switch port down (its ``eth0`` loses its carrier: nothing crosses either way, its
connections stay open) and :meth:`EmulatedHosts.heal` sets it up again, shapers untouched;
:meth:`EmulatedHosts.set_rate` replaces a host's ``tbf`` on both ends, and with None puts its
own link back.

By default the machine's own namespace has no link to the hosts: a host's address is not
reachable from it (where its default route leads to a proxy that accepts any connection, a
connection seems to succeed, to the proxy), and tasks in the hosts cannot reach its loopback.
With ``management=True`` (root only) one unshaped veth joins the creator's namespace to the
switch: its end there, ``P-m``, has :data:`MANAGEMENT_ADDRESS`, so the launcher reaches the
tasks' servers and the tasks reach the launcher (its rendezvous store). It is made inside the
switch namespace with the ``P-m`` end moved out, so it dies with the switch keeper; its bytes
are not in :meth:`EmulatedHosts.counters` (what a host exchanges with the launcher still
crosses, and is counted on, that host's own link).

Private disks (:mod:`distsgd_emulate.netns_disks`): by default the hosts share the machine's
file system. With ``disks=HostDisks(root=R, at=A)`` each host keeper also holds a mount
namespace in which the host's backing directory ``R/HOST`` (:meth:`EmulatedHosts.disk_of`) is
bind-mounted at ``A`` and ``R`` is hidden; :meth:`EmulatedHosts.enter` enters it too, keeping
the working directory. :meth:`EmulatedHosts.wipe` empties a lost host's disk.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import secrets
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from distsgd_emulate import netns_disks, netns_keeper, netns_shaping, netns_wiring
from distsgd_emulate.hosts import HOST_NETWORK, MANAGEMENT_ADDRESS, Host, HostPlan
from distsgd_emulate.netns_disks import HostDisks
from distsgd_emulate.netns_keeper import NetnsError
from distsgd_emulate.netns_lock import HostsLock
from distsgd_emulate.netns_shaping import MANAGEMENT_MINOR, tbf_sizes
from distsgd_emulate.netns_wiring import AppliedLink

__all__ = [
    "MANAGEMENT_ADDRESS",
    "AppliedLink",
    "EmulatedHosts",
    "HostDisks",
    "LinkBytes",
    "Privilege",
    "check_capable",
]

log = logging.getLogger(__name__)

LAUNCHER = "launcher"
"""In :meth:`EmulatedHosts.pair_counters`: what a host sent to the management address."""
ELSEWHERE = "other"
"""In :meth:`EmulatedHosts.pair_counters`: what a host sent to no host and not the launcher."""
COMMAND_TIMEOUT_S = 10.0
"""How long one ``ip``/``tc`` command or a keeper's start may take."""
TOOLS = ("ip", "tc", "nsenter", "sleep")
"""The programs this module runs (iproute2, util-linux, coreutils)."""


class Privilege(enum.StrEnum):
    """How the namespaces are made."""

    ROOT = "root"
    """Directly, with the caller's CAP_NET_ADMIN/CAP_SYS_ADMIN."""
    USER_NAMESPACE = "user-namespace"
    """Inside an unprivileged user namespace in which the keepers are root."""


@dataclass(frozen=True, kw_only=True)
class LinkBytes:
    """What went over one host's link, counted at its switch port (frames, headers included)."""

    host: str
    """The host's name."""
    sent: int
    """Bytes the host sent to the switch."""
    received: int
    """Bytes the switch delivered to the host."""


# --------------------------------------------------------------------------- privilege


def _userns_allowed() -> bool:
    for path, off in (
        ("/proc/sys/kernel/unprivileged_userns_clone", "0"),
        ("/proc/sys/user/max_user_namespaces", "0"),
    ):
        with contextlib.suppress(OSError):
            if Path(path).read_text().strip() == off:
                return False
    return True


def check_capable() -> Privilege:
    """How namespaces can be made here; ValueError, in one line, where they cannot."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise ValueError(
            f"emulated hosts need {', '.join(missing)} on PATH; install iproute2 (ip, tc), "
            "util-linux (nsenter) and coreutils (sleep)"
        )
    if not os.path.exists("/proc/self/ns/net"):
        raise ValueError(
            "emulated hosts need Linux network namespaces (no /proc/self/ns/net here); run on Linux"
        )
    if os.geteuid() == 0:
        return Privilege.ROOT
    if _userns_allowed():
        return Privilege.USER_NAMESPACE
    raise ValueError(
        "emulated hosts need CAP_NET_ADMIN: not root, and this kernel refuses unprivileged "
        "user namespaces; run as root or set sysctl kernel.unprivileged_userns_clone=1"
    )


# --------------------------------------------------------------------------- the hosts


class EmulatedHosts:
    """The hosts of a :class:`HostPlan` as network namespaces, while the context lasts.

    ``with EmulatedHosts(plan) as hosts: subprocess.run([*hosts.enter("host0"), "prog"])``.
    Tasks started with :meth:`enter` are the caller's to end: :meth:`close` ends only the
    keepers (then no link is left; a task still running keeps its host's namespace, with only
    ``lo`` in it).
    """

    def __init__(
        self,
        plan: HostPlan,
        *,
        timeout_s: float = COMMAND_TIMEOUT_S,
        management: bool = False,
        disks: HostDisks | None = None,
    ) -> None:
        self.plan = plan
        self.timeout_s = timeout_s
        self.management = management
        """Whether an unshaped link joins the creator's namespace to the switch (root only)."""
        names = [host.name for host in plan.hosts]
        self.disks = None if disks is None else netns_disks.DiskSet(disks, names)
        """Each host's private disk; None: the hosts share the machine's file system."""
        self.prefix = f"ds{secrets.token_hex(3)}"
        """Every link's name begins with it (``ds`` and 6 hex digits)."""
        self.privilege: Privilege | None = None
        """How the namespaces were made (None until :meth:`start`)."""
        self.keepers: dict[str, int] = {}
        """PID of each namespace's keeper, by host name, and ``"switch"``."""
        self.applied: tuple[AppliedLink, ...] = ()
        """What of each host's link is in effect, by host."""
        self.cut_off: set[str] = set()
        """Hosts cut off by :meth:`cut` and not healed yet."""
        self.rates: dict[str, int] = {}
        """Rates set by :meth:`set_rate` in place of a host's own link, bits/s, by host."""
        self.names: dict[str, str] = {}
        """Each host's ``ip netns`` name (``distsgd-host0``), by host: with a management link."""
        self._lock = HostsLock(str(HOST_NETWORK), what=f"emulated hosts {self.prefix}")
        self._carried: dict[str, dict[str, int]] = {}
        """Bytes counted per destination by counting classes since rebuilt (by :meth:`set_rate`
        between shaped and unshaped), by sending host, then destination."""

    # ---------------------------------------------------------------- names

    @property
    def bridge(self) -> str:
        """The bridge's name in the switch namespace."""
        return f"{self.prefix}-br"

    @property
    def management_link(self) -> str:
        """The creator's end of the management link (in the creator's namespace)."""
        return f"{self.prefix}-m"

    def port(self, host: Host) -> str:
        """The switch-side end of ``host``'s link."""
        return f"{self.prefix}-p{host.index}"

    def _host(self, host: Host | str | int) -> Host:
        if isinstance(host, Host):
            return host
        if isinstance(host, int):
            return self.plan.hosts[host]
        return self.plan.host(host)

    def _started(self, host: Host | str | int) -> Host:
        """``host``, once the hosts run; ValueError before :meth:`start` or after :meth:`close`."""
        if "switch" not in self.keepers:
            raise ValueError("the hosts are not started; change their links while they run")
        return self._host(host)

    def _ns(self, keeper: int, argv: Sequence[str]) -> list[str]:
        prefix = ["nsenter", f"--net=/proc/{keeper}/ns/net"]
        if self.privilege is Privilege.USER_NAMESPACE:
            user = self.keepers["switch"]
            prefix += [f"--user=/proc/{user}/ns/user", "--preserve-credentials"]
        return [*prefix, "--", *argv]

    def enter(self, host: Host | str | int) -> list[str]:
        """The argv prefix that starts a program in ``host``'s namespace.

        An argv prefix (``nsenter --net=/proc/KEEPER/ns/net --``), not a ``preexec_fn`` that
        calls setns: it works with every way the launcher starts a task (Popen, the fork
        server's exec, a shell line), runs no Python between fork and exec in a process with
        threads, and shows in ``ps``; it costs one exec.
        """
        name = self._host(host).name
        if name not in self.keepers:
            raise ValueError(f"{name} has no namespace; start the hosts (use `with`) first")
        argv = self._ns(self.keepers[name], [])
        return argv if self.disks is None else netns_disks.enter_argv(argv, self.keepers[name])

    def disk_of(self, host: Host | str | int) -> Path:
        """``host``'s private disk as the creator sees it: its backing directory."""
        if self.disks is None:
            raise ValueError("these hosts have no private disks; give EmulatedHosts(disks=...)")
        return self.disks.path(self._host(host).name)

    def wipe(self, host: Host | str | int) -> None:
        """``host`` lost its disk: everything in it removed (it stays, empty, where mounted)."""
        self.disk_of(host)  # refused without disks
        assert self.disks is not None
        self.disks.wipe(self._host(host).name)

    # ---------------------------------------------------------------- life

    def __enter__(self) -> EmulatedHosts:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close(check=kind is None)

    def start(self) -> None:
        """Make the namespaces, links and shapers; on failure nothing is left."""
        if self.keepers:
            raise ValueError("these hosts are already started; make a new EmulatedHosts")
        self.privilege = check_capable()
        if self.management and self.privilege is not Privilege.ROOT:
            raise ValueError(
                "emulated hosts with a link to the launcher need root (a user namespace may not "
                "add a link to this machine's namespace); run as root"
            )
        if self.management:  # one at a time on a machine (launcher/netns_lock.py)
            self._lock.acquire()
        try:
            if self.disks is not None:
                self.disks.prepare()
            self._start_keepers()
            netns_wiring.wire(self)
            if self.management:
                netns_wiring.wire_management(self)
                netns_wiring.name_hosts(self)
            self.applied = netns_wiring.shape(self)
        except BaseException:
            self.close(check=False)
            raise
        log.info(
            "emulated %d hosts (%s, links %s): keepers %s",
            len(self.plan.hosts),
            self.privilege,
            self.prefix,
            self.keepers,
        )
        for link in self.applied:
            if link.missing:
                log.warning(
                    "%s: %s not applied by the kernel (no delay qdisc here): parameter-server "
                    "calls wait it in user space (transport/delay.py); collective traffic does "
                    "not",
                    link.host,
                    ", ".join(link.missing),
                )

    def _start_keepers(self) -> None:
        userns = self.privilege is Privilege.USER_NAMESPACE
        switch = netns_keeper.fork_keeper(user_ns=None, new_user=userns, timeout_s=self.timeout_s)
        self.keepers["switch"] = switch
        if userns:
            try:
                netns_keeper.write_id_maps(switch)
            except OSError as e:
                raise NetnsError(
                    f"could not map this user into the hosts' user namespace: {e}; run as root"
                ) from e
        user_ns = f"/proc/{switch}/ns/user" if userns else None
        for host in self.plan.hosts:
            mounts = () if self.disks is None else self.disks.mounts(host.name)
            self.keepers[host.name] = netns_keeper.fork_keeper(
                user_ns=user_ns, new_user=False, timeout_s=self.timeout_s, mounts=mounts
            )

    def run(self, where: str, tool: str, script: str) -> None:
        """Run ``tool -batch -`` (``ip`` or ``tc``) in the namespace ``where`` (a host's name or
        ``"switch"``); NetnsError with the tool's stderr and the failed command, in one line."""
        argv = self._ns(self.keepers[where], [tool, "-batch", "-"])
        netns_wiring.batch(where, tool, argv, script, self.timeout_s)

    def run_here(self, tool: str, script: str) -> None:
        """:meth:`run` in the creator's own namespace."""
        netns_wiring.batch("this namespace", tool, [tool, "-batch", "-"], script, self.timeout_s)

    # ---------------------------------------------------------------- faults

    def cut(self, host: Host | str | int) -> None:
        """Cut ``host`` off the switch: its switch port goes down, so its ``eth0`` loses its
        carrier and no frame crosses its link either way until :meth:`heal`. Its tasks keep
        running and their connections stay open (TCP sends again once the link is back); the
        port's shaper stays as it was, and the host keeps its address and routes."""
        target = self._started(host)
        self.run("switch", "ip", f"link set {self.port(target)} down\n")
        self.cut_off.add(target.name)

    def heal(self, host: Host | str | int) -> None:
        """Undo :meth:`cut`: the port up again (no effect on a host not cut off)."""
        target = self._started(host)
        self.run("switch", "ip", f"link set {self.port(target)} up\n")
        self.cut_off.discard(target.name)

    def set_rate(self, host: Host | str | int, rate_bits: int | None) -> None:
        """Shape ``host``'s link to ``rate_bits`` both ways (``tbf`` replaced on its ``eth0``
        and its switch port, sized by :func:`tbf_sizes`); None: back to its link as started
        (its own shaper again, or none where it had none)."""
        target = self._started(host)
        was = self._egress_rate(target)
        if rate_bits is not None:
            self.rates[target.name] = rate_bits
        elif self.rates.pop(target.name, None) is None:
            return  # nothing set: its own link is in effect
        else:
            rate_bits = None if target.link is None else target.link.rate_bits
        self._reshape_egress(target, was, rate_bits)
        if rate_bits is None:
            port = f"qdisc del dev {self.port(target)} root\n"
        else:
            burst, limit = tbf_sizes(rate_bits)
            port = (
                f"qdisc replace dev {self.port(target)} root tbf rate {rate_bits}bit "
                f"burst {burst} limit {limit}\n"
            )
        self.run("switch", "tc", port)

    def _reshape_egress(self, host: Host, was: int | None, rate_bits: int | None) -> None:
        """``host``'s eth0 at ``rate_bits`` (None: unshaped), its counting kept: from one rate
        to another the tbf and its classes' queues change in place; between shaped and
        unshaped the tree is made again, and what its classes had counted carried over."""
        if was is not None and rate_bits is not None:
            minors = [minor for minor, _ in netns_wiring.destinations(self.plan, host)]
            sizes = tbf_sizes(rate_bits)
            script = netns_shaping.limit_script(
                "eth0", rate_bits=rate_bits, sizes=sizes, minors=minors
            )
            self.run(host.name, "tc", script)
            return
        if was == rate_bits:
            return
        counted = self._pair_counts(host)
        self.run(
            host.name,
            "tc",
            "qdisc del dev eth0 root\n" + netns_wiring.egress(self.plan, host, rate_bits),
        )
        self._carried[host.name] = counted

    def _egress_rate(self, host: Host) -> int | None:
        """The rate ``host``'s eth0 is shaped to (None: unshaped), as :attr:`rates` says."""
        if host.name in self.rates:
            return self.rates[host.name]
        return None if host.link is None else host.link.rate_bits

    def counters(self) -> dict[str, LinkBytes]:
        """Bytes each host has sent and received over its link so far, by host name (read
        from its switch port: what the port received, the host sent)."""
        if "switch" not in self.keepers:
            raise ValueError("the hosts are not started; count while they run")
        argv = self._ns(self.keepers["switch"], ["ip", "-j", "-s", "link", "show"])
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=self.timeout_s, check=True
            )
        except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as e:
            raise NetnsError(f"could not read the links' counters: {e}") from None
        ports = {entry["ifname"]: entry["stats64"] for entry in json.loads(done.stdout)}
        out = {}
        for host in self.plan.hosts:
            stats = ports[self.port(host)]
            out[host.name] = LinkBytes(
                host=host.name,
                sent=int(stats["rx"]["bytes"]),
                received=int(stats["tx"]["bytes"]),
            )
        return out

    def pair_counters(self) -> dict[str, dict[str, int]]:
        """Bytes each host has sent to each other host so far, by sender, then receiver (every
        host a key of each), and to :data:`LAUNCHER` and :data:`ELSEWHERE`; counted as the
        host sends, frames with headers, at its eth0 (one ``tc`` per host)."""
        if "switch" not in self.keepers:
            raise ValueError("the hosts are not started; count while they run")
        return {host.name: self._pair_counts(host) for host in self.plan.hosts}

    def _pair_counts(self, host: Host) -> dict[str, int]:
        """:meth:`pair_counters` for one sending host, with what a rebuilt tree had counted."""
        argv = self._ns(self.keepers[host.name], ["tc", "-s", "class", "show", "dev", "eth0"])
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=self.timeout_s, check=True
            )
        except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as e:
            raise NetnsError(f"could not read {host.name}'s counting classes: {e}") from None
        counted = netns_shaping.class_bytes(done.stdout)
        names = {netns_shaping.minor_of(other.index): other.name for other in self.plan.hosts}
        names |= {MANAGEMENT_MINOR: LAUNCHER, netns_shaping.DEFAULT_MINOR: ELSEWHERE}
        carried = self._carried.get(host.name, {})
        return {name: counted.get(minor, 0) + carried.get(name, 0) for minor, name in names.items()}

    def root_links(self) -> list[str]:
        """Links of this instance in the caller's own namespace (none, by design)."""
        try:
            done = subprocess.run(
                ["ip", "-br", "link"], capture_output=True, text=True, timeout=self.timeout_s
            )
        except subprocess.TimeoutExpired:
            raise NetnsError(f"ip -br link took over {self.timeout_s:g} s") from None
        names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
        return [name.split("@")[0] for name in names if name.startswith(self.prefix)]

    def close(self, *, check: bool = True) -> None:
        """End the keepers this instance started (by PID) and wait for them; with ``check``,
        NetnsError if a keeper did not end or a link of this instance is in sight.

        The management link is deleted first, by name: a namespace is taken down by the kernel
        some time after its last process ends, and our end of the link with it."""
        if self.management and "switch" in self.keepers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run(
                    ["ip", "link", "del", self.management_link],
                    capture_output=True,
                    timeout=self.timeout_s,
                )
        named = netns_keeper.unname_namespaces(list(self.names.values()), self.timeout_s)
        self.names = {}
        stuck = [
            f"{name} (pid {pid})"
            for name, pid in self.keepers.items()
            if not netns_keeper.end_keeper(pid, self.timeout_s)
        ]
        self.keepers = {}
        self._lock.release()
        mounted = [] if self.disks is None else self.disks.release()
        if not check:
            return
        if stuck or named:
            raise NetnsError(
                f"namespace keepers did not end: {', '.join(stuck) or 'none'}; names left in "
                f"/run/netns: {', '.join(named) or 'none'} (ip netns delete NAME)"
            )
        if mounted:
            raise NetnsError(f"the hosts' disks are mounted here: {', '.join(mounted)}")
        left = self.root_links()
        if left:
            raise NetnsError(f"links left behind: {', '.join(left)}; remove them with ip link del")
