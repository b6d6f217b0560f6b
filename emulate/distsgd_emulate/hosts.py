"""Emulated hosts, planned: how many, their addresses, which task runs on which, and the link
each one has. Pure data and decisions (no process, no socket); the executor that builds the
hosts as network namespaces is :mod:`distsgd_emulate.netns`; a local run's plan comes from its
config (:func:`distsgd.launcher.emulated.host_plan`).

Addresses come from 198.18.0.0/15, the range RFC 2544 sets aside for benchmarking (never routed
on the internet): host *i* is ``198.18.0.(i+1)`` on a /24 whose bridge is ``198.18.0.254``, so
at most 252 hosts.

A link is given as text, ``RATE[,DELAY[,JITTER]]``: ``1gbit``, ``100mbit,5ms``,
``10mbit,5ms,1ms``. Rates take ``bit``, ``kbit``, ``mbit`` or ``gbit`` (powers of 1000, as
``tc`` counts; :mod:`distsgd.cluster.rates`), times ``s``, ``ms`` or ``us``.
:func:`parse_links` reads a list of them: one without a name is every host's link,
``NAME=SPEC`` overrides it for one host, named by the host (``host2``) or by a task on it
(``worker1``, ``ps:0``).
"""

from __future__ import annotations

import ipaddress
import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from distsgd.cluster.rates import LINK_EXAMPLE, MIN_RATE, RATE_UNITS, quantity
from distsgd.cluster.spec import JOBS, ClusterSpecError, Role, TaskId

__all__ = [
    "HOST_NETWORK",
    "MANAGEMENT_ADDRESS",
    "MAX_HOSTS",
    "Host",
    "HostPlan",
    "LinkSpec",
    "Links",
    "Placement",
    "host_name",
    "link_delays",
    "parse_links",
    "place",
    "plan_hosts",
    "plan_machines",
]

HOST_NETWORK = ipaddress.IPv4Network("198.18.0.0/24")
"""The hosts' subnet: inside RFC 2544's benchmarking range 198.18.0.0/15."""
BRIDGE_ADDRESS = ipaddress.IPv4Address("198.18.0.254")
"""The bridge's own address on :data:`HOST_NETWORK`."""
MANAGEMENT_ADDRESS = "198.18.0.253"
"""The launcher's address on the hosts' network, on the management link (the emulated hosts'
creator; :mod:`distsgd_emulate.netns`)."""
MAX_HOSTS = 252
"""Host addresses run from .1 to .252 (.253 is the launcher's management address, .254 the
bridge, .255 the broadcast)."""

_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_HOST_RE = re.compile(r"^host(\d+)$")


class Placement(StrEnum):
    """How tasks are put on hosts (see :func:`place`)."""

    SPREAD = "spread"
    """Round-robin: servers first, then workers, each task on the next host."""
    PACK = "pack"
    """Contiguous blocks: fill host0 first, then host1, as evenly as the counts allow."""


def host_name(index: int) -> str:
    """The name of host ``index``: ``host0``, ``host1``, ..."""
    return f"host{index}"


# --------------------------------------------------------------------------- links


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """One host's link to the switch, the same in both directions."""

    rate_bits: int
    """Bandwidth in bits per second."""
    delay_s: float = 0.0
    """One-way delay added to every packet, in seconds."""
    jitter_s: float = 0.0
    """Random variation of the delay (at most ``delay_s``), in seconds."""

    def __post_init__(self) -> None:
        if isinstance(self.rate_bits, bool) or not isinstance(self.rate_bits, int):
            raise ValueError(f"link rate {self.rate_bits!r} is not an integer; give bits/s")
        if self.rate_bits < MIN_RATE:
            raise ValueError(f"link rate {self.rate_bits} bit/s is below 1kbit; use at least 1kbit")
        if not 0.0 <= self.delay_s <= 10.0:
            raise ValueError(f"link delay {self.delay_s} s is out of range; use 0 to 10 s")
        if not 0.0 <= self.jitter_s <= self.delay_s:
            raise ValueError(
                f"link jitter {self.jitter_s} s is negative or above the delay "
                f"{self.delay_s} s; use a jitter between 0 and the delay"
            )

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        """Read ``RATE[,DELAY[,JITTER]]``, e.g. ``"100mbit,5ms"``."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"link {text!r} is empty; give RATE[,DELAY[,JITTER]], {LINK_EXAMPLE}")
        parts = [p.strip() for p in text.split(",")]
        if len(parts) > 3:
            raise ValueError(
                f"link {text!r} has {len(parts)} parts; give RATE[,DELAY[,JITTER]], {LINK_EXAMPLE}"
            )
        rate = quantity(parts[0], RATE_UNITS, "rate", text)
        times = [quantity(p, _TIME_UNITS, "time", text) for p in parts[1:]]
        delay, jitter = (round(t * 1e6) / 1e6 for t in [*times, 0.0, 0.0][:2])
        return cls(rate_bits=round(rate), delay_s=delay, jitter_s=jitter)

    @property
    def text(self) -> str:
        """The spec written back as text (``parse(spec.text) == spec``)."""
        out = _rate_text(self.rate_bits)
        if self.delay_s or self.jitter_s:
            out += f",{_time_text(self.delay_s)}"
        if self.jitter_s:
            out += f",{_time_text(self.jitter_s)}"
        return out


def _rate_text(bits: int) -> str:
    for unit, size in reversed(RATE_UNITS.items()):
        if bits % size == 0:
            return f"{bits // size}{unit}"
    raise AssertionError("every integer is a whole number of bits")  # pragma: no cover


def _time_text(seconds: float) -> str:
    micros = round(seconds * 1e6)
    if micros % 1000:
        return f"{micros}us"
    return f"{micros // 1000}ms"


@dataclass(frozen=True, kw_only=True)
class Links:
    """The links asked for: one for every host, and overrides for some."""

    default: LinkSpec | None = None
    """Every host's link; None: unshaped (as fast as the machine moves packets)."""
    overrides: Mapping[str, LinkSpec] = field(default_factory=dict)
    """Link by host name (``host2``) or task name (``worker1``: the host that task is on)."""


def _override_key(name: str, whole: str) -> str:
    name = name.strip()
    if _HOST_RE.match(name):
        return name
    try:
        return TaskId.parse(name).name
    except ClusterSpecError:
        raise ValueError(
            f"link {whole!r}: {name!r} names no host or task; use hostN, psN or workerN before "
            "the =, e.g. worker1=10mbit"
        ) from None


def parse_links(texts: Sequence[str]) -> Links:
    """Read ``--link`` values: ``["1gbit", "worker1=10mbit"]`` gives 1gbit for every host and
    10mbit for worker1's host."""
    default: LinkSpec | None = None
    overrides: dict[str, LinkSpec] = {}
    for text in texts:
        name, sep, spec = text.rpartition("=") if isinstance(text, str) else ("", "", text)
        if not sep:
            if default is not None:
                raise ValueError(
                    f"link {text!r}: a second link for every host (the first was "
                    f"{default.text}); give one, and NAME=SPEC for the exceptions"
                )
            default = LinkSpec.parse(spec)
            continue
        key = _override_key(name, text)
        if key in overrides:
            raise ValueError(f"link {text!r}: {key} already has a link; give one per host or task")
        overrides[key] = LinkSpec.parse(spec)
    return Links(default=default, overrides=overrides)


# --------------------------------------------------------------------------- placement


def _ordered(tasks: Sequence[TaskId]) -> list[TaskId]:
    ordered = sorted(tasks, key=lambda t: (JOBS.index(t.job), t.index))
    for a, b in itertools.pairwise(ordered):
        if a == b:
            raise ValueError(f"task {a.name} is listed twice; place each task once")
    return ordered


def place(
    tasks: Sequence[TaskId], hosts: int, policy: Placement | str = Placement.SPREAD
) -> dict[TaskId, int]:
    """Which host (by index) each task runs on.

    Tasks are taken servers first, then workers, each by index (``ps0, ps1, worker0, ...``).
    ``spread`` (the default) deals them round-robin, as one would write a cluster file: task
    *k* of that order goes on host ``k % hosts``, so with 2 servers, 4 workers and 3 hosts:
    ps0->host0, ps1->host1, worker0->host2, worker1->host0, worker2->host1, worker3->host2.
    ``pack`` cuts the same order into ``hosts`` contiguous blocks as even as possible, the
    larger blocks first: ps0, ps1->host0; worker0, worker1->host1; worker2, worker3->host2.
    Every host gets at least one task: more hosts than tasks is refused.
    """
    try:
        policy = Placement(policy)
    except ValueError:
        choices = ", ".join(p.value for p in Placement)
        raise ValueError(f"placement {policy!r} is unknown; use one of {choices}") from None
    if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
        raise ValueError(f"{hosts!r} hosts; use 1 to {MAX_HOSTS} hosts")
    ordered = _ordered(tasks)
    if hosts > len(ordered):
        raise ValueError(
            f"{hosts} hosts for {len(ordered)} tasks would leave a host empty; "
            f"use at most {len(ordered)} hosts"
        )
    if policy is Placement.SPREAD:
        return {task: k % hosts for k, task in enumerate(ordered)}
    size, extra = divmod(len(ordered), hosts)
    out: dict[TaskId, int] = {}
    start = 0
    for host in range(hosts):
        end = start + size + (1 if host < extra else 0)
        out.update({task: host for task in ordered[start:end]})
        start = end
    return out


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True, kw_only=True)
class Host:
    """One emulated host."""

    index: int
    """Its number, from 0."""
    name: str
    """``host<index>``."""
    address: str
    """Its IPv4 address on :data:`HOST_NETWORK` (``198.18.0.<index+1>``)."""
    link: LinkSpec | None
    """Its link to the switch; None: unshaped."""
    tasks: tuple[TaskId, ...]
    """The tasks placed on it, servers first."""


@dataclass(frozen=True, kw_only=True)
class HostPlan:
    """The hosts of a run, the tasks on each and their links."""

    hosts: tuple[Host, ...]
    """The hosts, by index."""
    policy: Placement
    """How the tasks were placed."""
    prefix_len: int = HOST_NETWORK.prefixlen
    """The subnet's prefix length (every host and the bridge are on one /24)."""
    bridge_address: str = str(BRIDGE_ADDRESS)
    """The bridge's address."""

    def host_of(self, task: TaskId) -> Host:
        """The host ``task`` runs on."""
        for host in self.hosts:
            if task in host.tasks:
                return host
        raise ValueError(f"task {task.name} is on no host of this plan; place it first")

    def round_trip(self, a: TaskId, b: TaskId) -> tuple[float, float]:
        """The delay of the links between tasks ``a`` and ``b``, both ways, and its jitter:
        ``(2 x (delay_a + delay_b), jitter_a + jitter_b)`` seconds, as a packet crosses the
        sender's link to the switch and the receiver's from it; (0, 0) on one host."""
        one, two = self.host_of(a), self.host_of(b)
        if one is two:
            return 0.0, 0.0
        links = [host.link for host in (one, two) if host.link is not None]
        return (
            2.0 * sum(link.delay_s for link in links),
            sum(link.jitter_s for link in links),
        )

    def server_addresses(self) -> tuple[str, ...]:
        """The addresses of the hosts with a parameter server on them: where clients dial
        (what a server's TLS certificate must name)."""
        return tuple(
            host.address for host in self.hosts if any(t.job == Role.PS for t in host.tasks)
        )

    def host(self, name: str) -> Host:
        """The host called ``name`` (``host0``, ...)."""
        for host in self.hosts:
            if host.name == name:
                return host
        raise ValueError(f"no host {name!r}; use host0..host{len(self.hosts) - 1}")


def _host_link(index: int, tasks: Sequence[TaskId], links: Links) -> LinkSpec | None:
    name = host_name(index)
    if name in links.overrides:
        return links.overrides[name]
    asked = {t.name: links.overrides[t.name] for t in tasks if t.name in links.overrides}
    if len(set(asked.values())) > 1:
        which = ", ".join(f"{k}={v.text}" for k, v in sorted(asked.items()))
        raise ValueError(
            f"{name} holds tasks with different links ({which}); give one link, or "
            f"{name}=SPEC, for the tasks that share a host"
        )
    return next(iter(asked.values()), links.default)


def plan_hosts(
    *,
    count: int,
    tasks: Sequence[TaskId],
    policy: Placement | str = Placement.SPREAD,
    links: Links | None = None,
) -> HostPlan:
    """Place ``tasks`` on ``count`` hosts (:func:`place`) and give each host its link."""
    links = links or Links()
    placed = place(tasks, count, policy)
    known = {host_name(i) for i in range(count)} | {t.name for t in placed}
    unknown = sorted(set(links.overrides) - known)
    if unknown:
        raise ValueError(
            f"link for {', '.join(unknown)}: no such host or task in this run; "
            f"use host0..host{count - 1} or a task of the run"
        )
    ordered = _ordered(list(placed))
    hosts = []
    for i in range(count):
        on = tuple(t for t in ordered if placed[t] == i)
        hosts.append(
            Host(
                index=i,
                name=host_name(i),
                address=str(HOST_NETWORK.network_address + i + 1),
                link=_host_link(i, on, links),
                tasks=on,
            )
        )
    return HostPlan(hosts=tuple(hosts), policy=Placement(policy))


def plan_machines(*, count: int, links: Links | None = None) -> HostPlan:
    """``count`` hosts with no task placed on them (``distsgd-emulate hosts up``: the user
    starts the tasks by hand, as on real machines); a link override names a host
    (``host1=10mbit``)."""
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_HOSTS:
        raise ValueError(f"{count!r} hosts; use 1 to {MAX_HOSTS} hosts")
    links = links or Links()
    names = [host_name(i) for i in range(count)]
    unknown = sorted(set(links.overrides) - set(names))
    if unknown:
        raise ValueError(f"link for {', '.join(unknown)}: no such host; use host0..host{count - 1}")
    hosts = tuple(
        Host(
            index=i,
            name=name,
            address=str(HOST_NETWORK.network_address + i + 1),
            link=links.overrides.get(name, links.default),
            tasks=(),
        )
        for i, name in enumerate(names)
    )
    return HostPlan(hosts=hosts, policy=Placement.SPREAD)


def link_delays(plan: HostPlan, worker: int, servers: int) -> list[list[float]]:
    """Per ps task, the [round trip, jitter] between worker ``worker``'s host and the
    server's (``TaskEnv.ps_link_delays``); none where no link gives a delay."""
    task = TaskId(job=Role.WORKER, index=worker)
    pairs = [list(plan.round_trip(task, TaskId(job=Role.PS, index=i))) for i in range(servers)]
    return pairs if any(rtt > 0 for rtt, _ in pairs) else []
