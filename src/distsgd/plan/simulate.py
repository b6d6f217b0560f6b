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
import math
from collections import Counter
from dataclasses import dataclass

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
    run = _Run(setting, workload, cluster, path, steps, stragglers or Stragglers(), seed)
    run.together = run.together and not staggered
    return run.play()


class _Run:
    def __init__(
        self,
        setting: Setting,
        workload: Workload,
        cluster: Cluster,
        path: Path,
        steps: int,
        stragglers: Stragglers,
        seed: int,
    ) -> None:
        ex = setting.exchange
        self.kind, self.period, self.overlap = ex.kind, ex.period, ex.overlap
        self.n, self.m = cluster.workers, max(1, cluster.ps)
        self.steps = steps
        b = workload.param_bytes.value
        self.c = workload.step.value
        self.up = b * setting.push_factor
        self.down = b * setting.pull_factor if path.encoded_pulls else b
        pull_encode = setting.pull_encode if path.encoded_pulls else 0.0
        a = path.latency.value
        self.cpu_up = a + b * setting.push_encode + self.up / (path.push_cpu or path.push).value
        self.t_up = a + b * setting.push_encode + self.up / path.push.value  # the server's too
        self.cpu_down = a + b * pull_encode + self.down / path.pull.value
        self.apply_s = b / self.m * server_s_per_byte(path)
        self.ring_bytes = 2 * (self.n - 1) / self.n * self.up
        self.ring_cpu = (
            2 * (self.n - 1) * a + b * setting.push_encode + self.ring_bytes / (path.push.value)
        )
        self.machine = _Machine(cluster, self.m)
        self.draws = _Draws(stragglers, self.n, self.c, seed)
        self.done = [0] * self.n
        self.versions = np.zeros(self.m)
        self.base: list[np.ndarray] = [np.zeros(self.m) for _ in range(self.n)]
        self.stale: Counter[int] = Counter()
        self.events: list[tuple[float, int, int, str]] = []
        self.seq = 0
        self.finished = 0.0
        self.pending: list[float] = []  # this round's push arrivals (sync) or arrivals (ring)
        self.left = [self.period] * self.n  # steps left before this window's exchange
        self.inflight = [False] * self.n  # overlap: an exchange of this worker travels
        self.waiting: list[float | None] = [None] * self.n  # overlap: computed, waiting for it
        cores = cluster.cores or self.n
        self.group_size = max(1, min(self.n, math.floor(cores)))
        """As many workers as compute side by side exchange together (the cost model's)."""
        self.together = (
            self.kind == "async"
            and self.period > 1
            and not self.overlap
            and cluster.link is not None
            and self.group_size > 1
        )
        """Windowed exchanges across hosts: windows that end together exchange together."""
        self.in_turn = cluster.link is not None and cluster.turns >= 0.5
        """A synchronous round's pulls served in turn, not shared (``Cluster.turns``)."""
        self.group: list[tuple[float, int]] = []
        self.flush_at = math.inf

    def at(self, t: float, worker: int, action: str) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, worker, action))

    def play(self) -> SimResult:
        first = "compute" if self.kind == "collective" else "pull"
        if self.together:  # every worker's first pull at once: they share the links too
            pulled = self.machine.wire_together(0.0, self.down / self.m, self.n)
            first = "compute"
        for w in range(self.n):
            self.at(pulled if self.together else 0.0, w, first)
        while self.events:
            t, _, w, action = heapq.heappop(self.events)
            getattr(self, "_" + action)(t, w)
        seconds = max(self.finished, 1e-12)
        total = sum(self.done)
        m = self.machine
        links = np.maximum(m.s_out_busy, m.s_in_busy) / seconds if m.link else np.zeros(0)
        return SimResult(
            rate=total / seconds,
            seconds=seconds,
            worker_steps=total,
            server_busy=tuple(float(x) for x in m.server_busy / seconds)
            if self.kind != "collective"
            else (),
            link_busy=tuple(float(x) for x in links) if self.kind != "collective" else (),
            staleness=dict(sorted(self.stale.items())),
        )

    # ---------------------------------------------------------------- parameter servers

    def _pull(self, t: float, w: int) -> None:
        arrived = self.machine.wire(t, self.down / self.m, w, outbound=True)
        ready = max(float(np.max(arrived)), self.machine.cpu(t, self.cpu_down))
        self.base[w] = self.versions.copy()
        if not self.overlap or self.done[w] == 0:
            self.at(ready, w, "compute")
            return
        self.at(ready, w, "fetched")

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
        self.left[w] = self.period
        self.at(end, w, "ring" if self.kind == "collective" else "computed")

    def _computed(self, t: float, w: int) -> None:
        if self.together:  # windows that end within a step of each other exchange together
            self.group.append((t, w))
            if len(self.group) == self.group_size:  # as many as compute side by side
                self._together(t, w)
            elif len(self.group) == 1:
                self.flush_at = t + self.c
                self.at(self.flush_at, w, "together")
            return
        if not self.overlap:
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
        arrived = self.machine.wire(t, self.up / self.m, w, outbound=False)
        sent = max(self.machine.cpu(t, self.cpu_up), t + self.t_up)
        applied = self.machine.apply(np.maximum(arrived, sent), self.apply_s)
        if self.kind == "sync":  # each push applied (summed) as it comes; the last closes
            self.pending.append(float(np.max(applied)))
            if len(self.pending) == self.n:
                self._close_round()
            return
        for gap in self.versions - self.base[w]:
            self.stale[int(gap)] += 1
        self.versions += 1
        self._next(w, float(np.max(applied)))

    def _together(self, t: float, _: int) -> None:
        """The windows that ended since the first of the group: their pushes share the
        servers' links, then their pulls (the cost model's assumption, measured on DOWNPOUR
        across hosts: each exchange took twice as long as one alone)."""
        if not self.group or (t < self.flush_at and len(self.group) < self.group_size):
            return  # flushed already (the group filled up), or a stale timer
        group, self.group = self.group, []
        self.flush_at = math.inf
        start = min(at for at, _ in group)
        k = len(group)
        pushed = self.machine.wire_together(start, self.up / self.m, k, outbound=False)
        for at, w in group:
            sent = max(self.machine.cpu(at, self.cpu_up), pushed)
            applied = self.machine.apply(np.full(self.m, sent), self.apply_s)
            for gap in self.versions - self.base[w]:
                self.stale[int(gap)] += 1
            self.versions += 1
            pushed = max(pushed, float(np.max(applied)))
        pulled = self.machine.wire_together(pushed, self.down / self.m, k)
        for _at, w in group:
            ready = max(pulled, self.machine.cpu(pushed, self.cpu_down))
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
        pulled = self.machine.wire_together(end, self.down / self.m, len(left))
        for w in left:  # every worker's pull of the new round, asked as it closes
            self.base[w] = self.versions.copy()
            self.at(max(pulled, self.machine.cpu(end, self.cpu_down)), w, "compute")

    def _next(self, w: int, exchanged: float) -> None:
        self.finished = max(self.finished, exchanged)
        if self.overlap:
            self.at(exchanged, w, "pull")  # the exchange's pull, then "fetched"
        elif self.done[w] < self.steps:
            self.at(exchanged, w, "pull")

    # ---------------------------------------------------------------- collective

    def _ring(self, t: float, w: int) -> None:
        self.pending.append(t)
        if len(self.pending) < self.n:
            return
        start, self.pending = max(self.pending), []
        link = self.machine.link
        wire = self.ring_bytes / link if link is not None else 0.0
        ends = [max(start + wire, self.machine.cpu(start, self.ring_cpu)) for _ in range(self.n)]
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
