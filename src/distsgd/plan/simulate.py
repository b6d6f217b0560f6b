"""A run played event by event on the cost model's parts: queues at the servers and on their
links, shared cores, stragglers. For clusters larger than one machine can run (``distsgd plan
--simulate``; 256 workers and 32 servers, 1,000 steps each, in seconds).

Every worker is a small state machine (pull, compute, push; rounds for ``sync``; a barrier and
a ring for ``collective``) whose next action is an event in a heap, processed in time order.
An action reserves what it uses, first come first served, from its event's time on:

- a **link** (with ``Cluster.link``): each server's and each worker's link has a way out and a
  way in, each free from some time on; a transfer of ``b`` bytes holds both ends' ways for
  ``b / R`` (a server's piece of a pull on the server's way out, the worker's whole pull on its
  way in; the transfer ends when both have carried it);
- a **core** (with ``Cluster.cores``): ``K`` cores, each burst of CPU (a step's compute, a
  transfer's ``cpu(b)``) takes the core free soonest;
- a **server**: one process each, applying pushes in arrival order, ``(B / M) * s`` each (the
  last part of a push's time over the path, which includes it; more where pushes queue).

While one way of a server's link carries a transfer, one starting the other way moves at
``Cluster.duplex`` of the rate (each way's acknowledgements queue behind the other's data).

Two kinds of exchange share a link fairly instead, ending together when the last would have in
turn: a synchronous round's pulls (asked as the round closes; in turn where
``Cluster.turns`` is 0.5 or more), and, across hosts, the exchanges
of windowed asynchronous schemes (DOWNPOUR, EASGD: ``period`` > 1) whose windows end within one
step of each other, up to as many workers as compute side by side (``min(N, cores)``, the cost
model's assumption). Their workers start together, compute their windows side by side and hit
the servers' links at once; measured on emulated hosts, each such exchange took about twice as
long as one alone (docs/performance.md, "The cost model"), and served one after the other they
would drift apart instead.

A push's staleness is the number of updates its server applied between the worker's pull and
this push's application. The model's assumptions hold here too (pieces balanced over the
servers, the path's figures fixed); what the simulator adds is contention and variance: queues
where the roofline of :mod:`distsgd.plan.cost` only takes the smallest bound, and compute
times drawn per step (:class:`Stragglers`).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from distsgd.plan.cost import Cluster, Path, Setting, Workload, server_s_per_byte


@dataclass(frozen=True, kw_only=True)
class Stragglers:
    """How compute times vary: per step, and per worker."""

    sigma: float = 0.0
    """Each step's compute is ``c`` times a log-normal draw of this sigma (mean 1)."""
    slow: int = 0
    """This many workers (the last ones) are ``factor`` times slower at every step."""
    factor: float = 1.0

    def __post_init__(self) -> None:
        if not (self.sigma >= 0 and math.isfinite(self.sigma)):
            raise ValueError(f"straggler sigma must be >= 0, got {self.sigma}")
        if self.slow < 0 or not self.factor >= 1:
            raise ValueError("slow workers: a count >= 0 and a factor >= 1")


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """What a simulated run measured."""

    rate: float
    """Worker-steps per second, summed over the workers."""
    seconds: float
    """Simulated time until the last worker finished."""
    worker_steps: int
    server_busy: tuple[float, ...]
    """Each server's share of the run spent applying pushes."""
    link_busy: tuple[float, ...]
    """Each server's link: the busier way's share of the run carrying bytes (empty: no link)."""
    staleness: dict[int, int]
    """Pushes (one per server piece) by their staleness."""

    def staleness_mean(self) -> float:
        total = sum(self.staleness.values())
        return sum(k * v for k, v in self.staleness.items()) / total if total else 0.0


class _Machine:
    """The shared resources: cores, links, servers; each method reserves and returns when done."""

    def __init__(self, cluster: Cluster, servers: int) -> None:
        self.link = cluster.link
        self.duplex = cluster.duplex
        k = cluster.cores
        self.cores: list[float] | None = [0.0] * max(1, round(k)) if k is not None else None
        n = cluster.workers
        self.s_out, self.s_in = np.zeros(servers), np.zeros(servers)
        self.s_out_busy, self.s_in_busy = np.zeros(servers), np.zeros(servers)
        self.w_out, self.w_in = [0.0] * n, [0.0] * n
        self.server = np.zeros(servers)
        self.server_busy = np.zeros(servers)

    def cpu(self, t: float, seconds: float) -> float:
        """A burst of CPU from ``t``: when it ends (at once on a core of its own)."""
        if self.cores is None:
            return t + seconds
        start = max(t, self.cores[0])
        heapq.heapreplace(self.cores, start + seconds)
        return start + seconds

    def wire(self, t: float, piece: float, worker: int, outbound: bool) -> np.ndarray | float:
        """Each server's piece of ``piece`` bytes over its link and the worker's (``outbound``:
        server to worker); when each piece has arrived (``t`` where there are no links)."""
        if self.link is None:
            return t
        alone = piece / self.link
        ways, busy = (self.s_out, self.s_out_busy) if outbound else (self.s_in, self.s_in_busy)
        other = self.s_in if outbound else self.s_out
        start = np.maximum(ways, t)
        hold = np.where(other > start, alone / self.duplex, alone)  # the other way is busy
        np.add(start, hold, out=ways)
        busy += hold
        mine = self.w_in if outbound else self.w_out
        mine[worker] = max(mine[worker], t) + alone * len(ways)
        return np.maximum(ways, mine[worker])

    def wire_together(
        self, t: float, piece: float, workers: int, *, outbound: bool = True
    ) -> float:
        """``workers`` transfers of ``piece`` bytes to or from each server, all at ``t`` (a
        synchronous round's pulls, or windows that end together): concurrent flows share a
        link fairly, so they end together, when the last would have in turn."""
        if self.link is None:
            return t
        hold = workers * piece / self.link
        ways, busy = (self.s_out, self.s_out_busy) if outbound else (self.s_in, self.s_in_busy)
        start = np.maximum(ways, t)
        np.add(start, hold, out=ways)
        busy += hold
        return float(np.max(ways))

    def apply(self, arrivals: np.ndarray | float, seconds: float) -> np.ndarray:
        """When each server has applied its piece: a push's time over the path includes the
        update (the path's figures are measured so), so the update takes the last ``seconds``
        before the arrival, later only where the server is still busy with earlier pushes."""
        start = np.maximum(self.server, np.subtract(arrivals, seconds))
        np.add(start, seconds, out=self.server)
        self.server_busy += seconds
        return self.server.copy()


def simulate(
    setting: Setting,
    workload: Workload,
    cluster: Cluster,
    path: Path,
    *,
    steps: int,
    stragglers: Stragglers | None = None,
    seed: int = 0,
    staggered: bool = False,
) -> SimResult:
    """Play ``steps`` steps of every worker; see the module docstring. ``staggered``: play
    windowed exchanges across hosts first come first served (the regime where they fall
    apart) instead of together."""
    if steps < 1:
        raise ValueError(f"simulate at least 1 step, got {steps}")
    draws = _Draws(stragglers or Stragglers(), cluster.workers, workload.step.value, seed)
    return _Run(setting, workload, cluster, path, steps, draws, staggered=staggered).play()


@dataclass(frozen=True, kw_only=True)
class _Costs:
    """What one worker's actions take: seconds and bytes, from the setting, model and path."""

    c: float
    """A step's compute (before the stragglers' draws)."""
    up: float
    """Bytes of a push, and of a pull (``down``)."""
    down: float
    cpu_up: float
    """A push's CPU (``cpu_down``: a pull's)."""
    t_up: float
    """A push's time over the path, the server's part included."""
    cpu_down: float
    apply_s: float
    """A server's time to apply its piece of a push."""
    ring_bytes: float
    """Bytes a worker sends in a ring all-reduce, and its CPU (``ring_cpu``)."""
    ring_cpu: float

    @classmethod
    def of(cls, setting: Setting, workload: Workload, path: Path, n: int, m: int) -> _Costs:
        b = workload.param_bytes.value
        up = b * setting.push_factor
        down = b * setting.pull_factor if path.encoded_pulls else b
        pull_encode = setting.pull_encode if path.encoded_pulls else 0.0
        a = path.latency.value
        ring_bytes = 2 * (n - 1) / n * up
        return cls(
            c=workload.step.value,
            up=up,
            down=down,
            cpu_up=a + b * setting.push_encode + up / (path.push_cpu or path.push).value,
            t_up=a + b * setting.push_encode + up / path.push.value,  # the server's too
            cpu_down=a + b * pull_encode + down / path.pull.value,
            apply_s=b / m * server_s_per_byte(path),
            ring_bytes=ring_bytes,
            ring_cpu=2 * (n - 1) * a + b * setting.push_encode + ring_bytes / path.push.value,
        )


@dataclass(kw_only=True)
class _Group:
    """Windowed exchanges across hosts: windows that end within a step of each other exchange
    together, up to ``size`` workers."""

    size: int
    """As many workers as compute side by side (the cost model's)."""
    members: list[tuple[float, int]] = field(default_factory=list)
    """(when its window ended, worker) of each member so far."""
    flush_at: float = math.inf
    """When the group exchanges even if not full: a step after its first member."""


class _Run:
    def __init__(
        self,
        setting: Setting,
        workload: Workload,
        cluster: Cluster,
        path: Path,
        steps: int,
        draws: _Draws,
        *,
        staggered: bool,
    ) -> None:
        self.ex = ex = setting.exchange
        self.n, self.m = n, m = cluster.workers, max(1, cluster.ps)
        self.steps = steps
        self.cost = _Costs.of(setting, workload, path, n, m)
        self.machine = _Machine(cluster, m)
        self.draws = draws
        self.done = [0] * n
        self.versions = np.zeros(m)
        self.base: list[np.ndarray] = [np.zeros(m) for _ in range(n)]
        self.stale: Counter[int] = Counter()
        self.heap: list[tuple[float, int, int, str]] = []
        """The actions to play, in time order (ties in the order they were scheduled)."""
        self.seq = itertools.count()
        self.finished = 0.0
        self.pending: list[float] = []  # this round's push arrivals (sync) or arrivals (ring)
        self.left = [ex.period] * n  # steps left before this window's exchange
        self.inflight = [False] * n  # overlap: an exchange of this worker travels
        self.waiting: list[float | None] = [None] * n  # overlap: computed, waiting for it
        size = max(1, min(n, math.floor(cluster.cores or n)))
        windowed = ex.kind == "async" and ex.period > 1 and not ex.overlap
        together = windowed and cluster.link is not None and size > 1 and not staggered
        self.group = _Group(size=size) if together else None
        """Windowed exchanges across hosts: windows that end together exchange together."""
        self.in_turn = cluster.link is not None and cluster.turns >= 0.5
        """A synchronous round's pulls served in turn, not shared (``Cluster.turns``)."""

    def at(self, t: float, worker: int, action: str) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), worker, action))

    def play(self) -> SimResult:
        first, start = "compute" if self.ex.kind == "collective" else "pull", 0.0
        if self.group is not None:  # every worker's first pull at once: they share the links
            start = self.machine.wire_together(0.0, self.cost.down / self.m, self.n)
            first = "compute"
        for w in range(self.n):
            self.at(start, w, first)
        while self.heap:
            t, _, w, action = heapq.heappop(self.heap)
            getattr(self, "_" + action)(t, w)
        seconds = max(self.finished, 1e-12)
        total = sum(self.done)
        m = self.machine
        links = np.maximum(m.s_out_busy, m.s_in_busy) / seconds if m.link else np.zeros(0)
        servers = self.ex.kind != "collective"
        return SimResult(
            rate=total / seconds,
            seconds=seconds,
            worker_steps=total,
            server_busy=tuple(float(x) for x in m.server_busy / seconds) if servers else (),
            link_busy=tuple(float(x) for x in links) if servers else (),
            staleness=dict(sorted(self.stale.items())),
        )

    # ---------------------------------------------------------------- parameter servers

    def _pull(self, t: float, w: int) -> None:
        arrived = self.machine.wire(t, self.cost.down / self.m, w, outbound=True)
        ready = max(float(np.max(arrived)), self.machine.cpu(t, self.cost.cpu_down))
        self.base[w] = self.versions.copy()
        self.at(ready, w, "compute" if not self.ex.overlap or self.done[w] == 0 else "fetched")

    def _fetched(self, t: float, w: int) -> None:
        """Overlap: this worker's exchange is over; a worker that waited for it goes on."""
        self.inflight[w] = False
        self.finished = max(self.finished, t)
        computed, self.waiting[w] = self.waiting[w], None
        if computed is not None:
            self._exchange(max(t, computed), w)

    def _compute(self, t: float, w: int) -> None:
        """One step on a core; the window's next one after it, else the exchange."""
        end = self.machine.cpu(t, self.draws.next(w))
        self.done[w] += 1
        self.finished = max(self.finished, end)
        self.left[w] -= 1
        if self.left[w] > 0 and self.done[w] < self.steps:
            self.at(end, w, "compute")
            return
        self.left[w] = self.ex.period
        self.at(end, w, "ring" if self.ex.kind == "collective" else "computed")

    def _computed(self, t: float, w: int) -> None:
        group = self.group
        if group is not None:  # windows that end within a step of each other exchange together
            group.members.append((t, w))
            if len(group.members) == group.size:  # as many as compute side by side
                self._together(t, w)
            elif len(group.members) == 1:
                group.flush_at = t + self.cost.c
                self.at(group.flush_at, w, "together")
            return
        if not self.ex.overlap:
            self._push(t, w)
        elif self.inflight[w]:  # wait for the exchange before this one
            self.waiting[w] = t
        else:
            self._exchange(t, w)

    def _exchange(self, t: float, w: int) -> None:
        """Overlap: start this worker's exchange (push, then pull) and its next steps at once."""
        self.inflight[w] = True
        self._push(t, w)
        if self.done[w] < self.steps:
            self.at(t, w, "compute")

    def _push(self, t: float, w: int) -> None:
        arrived = self.machine.wire(t, self.cost.up / self.m, w, outbound=False)
        sent = max(self.machine.cpu(t, self.cost.cpu_up), t + self.cost.t_up)
        applied = self.machine.apply(np.maximum(arrived, sent), self.cost.apply_s)
        if self.ex.kind == "sync":  # each push applied (summed) as it comes; the last closes
            self.pending.append(float(np.max(applied)))
            if len(self.pending) == self.n:
                self._close_round()
            return
        self.stale.update((self.versions - self.base[w]).astype(int).tolist())
        self.versions += 1
        self._next(w, float(np.max(applied)))

    def _together(self, t: float, _: int) -> None:
        """The windows that ended since the first of the group: their pushes share the
        servers' links, then their pulls (the cost model's assumption, measured on DOWNPOUR
        across hosts: each exchange took twice as long as one alone)."""
        g = self.group
        if g is None or not g.members or (t < g.flush_at and len(g.members) < g.size):
            return  # flushed already (the group filled up), or a stale timer
        group, g.members, g.flush_at = g.members, [], math.inf
        start = min(at for at, _ in group)
        k = len(group)
        pushed = self.machine.wire_together(start, self.cost.up / self.m, k, outbound=False)
        for at, w in group:
            sent = max(self.machine.cpu(at, self.cost.cpu_up), pushed)
            applied = self.machine.apply(np.full(self.m, sent), self.cost.apply_s)
            self.stale.update((self.versions - self.base[w]).astype(int).tolist())
            self.versions += 1
            pushed = max(pushed, float(np.max(applied)))
        pulled = self.machine.wire_together(pushed, self.cost.down / self.m, k)
        for _at, w in group:
            ready = max(pulled, self.machine.cpu(pushed, self.cost.cpu_down))
            self.base[w] = self.versions.copy()
            self.finished = max(self.finished, ready)
            if self.done[w] < self.steps:
                self.at(ready, w, "compute")

    def _close_round(self) -> None:
        end, self.pending = max(self.pending), []
        self.versions += 1
        self.finished = max(self.finished, end)
        left = [w for w in range(self.n) if self.done[w] < self.steps]
        self.stale[0] += self.m * self.n
        if self.in_turn:  # the links serve the pulls one after another
            for w in left:
                self.base[w] = self.versions.copy()
                self._pull(end, w)
            return
        pulled = self.machine.wire_together(end, self.cost.down / self.m, len(left))
        for w in left:  # every worker's pull of the new round, asked as it closes
            self.base[w] = self.versions.copy()
            self.at(max(pulled, self.machine.cpu(end, self.cost.cpu_down)), w, "compute")

    def _next(self, w: int, exchanged: float) -> None:
        self.finished = max(self.finished, exchanged)
        if self.ex.overlap or self.done[w] < self.steps:  # overlap: the pull, then "fetched"
            self.at(exchanged, w, "pull")

    # ---------------------------------------------------------------- collective

    def _ring(self, t: float, w: int) -> None:
        self.pending.append(t)
        if len(self.pending) < self.n:
            return
        start, self.pending = max(self.pending), []
        link = self.machine.link
        wire = self.cost.ring_bytes / link if link is not None else 0.0
        ends = [
            max(start + wire, self.machine.cpu(start, self.cost.ring_cpu)) for _ in range(self.n)
        ]
        end = max(ends)
        self.finished = max(self.finished, end)
        for v in range(self.n):
            if self.done[v] < self.steps:
                self.at(end, v, "compute")


class _Draws:
    """Compute times: ``c`` times each worker's factor times a per-step log-normal draw."""

    def __init__(self, stragglers: Stragglers, workers: int, c: float, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.sigma = stragglers.sigma
        slow = min(stragglers.slow, workers)
        self.base = [c * stragglers.factor if w >= workers - slow else c for w in range(workers)]
        self.cache: list[float] = []

    def next(self, worker: int) -> float:
        if self.sigma == 0:
            return self.base[worker]
        if not self.cache:  # drawn in blocks: one numpy call per 4096 steps
            mu = -(self.sigma**2) / 2  # mean 1
            self.cache = self.rng.lognormal(mu, self.sigma, 4096).tolist()
        return self.base[worker] * self.cache.pop()


def histogram_quantile(counts: dict[int, int], q: float) -> int | None:
    """The ``q`` quantile of a histogram (value -> count); None where it counts nothing."""
    total = sum(counts.values())
    if total <= 0:
        return None
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= q * total:
            return value
    return max(counts)
