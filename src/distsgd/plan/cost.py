"""The cost model: a run's worker-steps per second, its bottleneck and staleness, from parts.

Parts (each measured or assumed; :class:`Part` says which):

- ``c``: the seconds one training step computes on one worker (forward, backward, the batch and
  the loop's own work), one thread.
- ``B``: the model's bytes in float32. An exchange moves ``B * f`` bytes, where ``f`` is the
  wire's factor: 1 for float32, 1/2 for bf16 or fp16, 1/4 for int8, ``2k`` for top-k of a
  fraction ``k`` (a 4-byte index beside each 4-byte value); pulls and pushes have their own.
- A data path (shared memory, the tensor socket, gloo's TCP): a fixed cost ``a`` per call and
  a throughput ``beta`` (bytes/s) for pulls and for pushes. On a path that is not a shaped
  link the transfer is CPU work (copies, serialisation, the server's update): one core busy.
- ``R``: a link's rate in bytes/s each way (full duplex); none on one host.
- ``K``: the cores the tasks share where they share one machine (a local run, emulated hosts).
- ``D`` and ``Q`` (links only, measured on emulated hosts by ``distsgd_emulate.link_probe``):
  each way's share of its rate while pulls go out and pushes come in at once, and how far transfers
  the same way started together go in turn (``Q`` = 1) rather than share and end together
  (0). Where a transfer outgrows the link's queue both depart from the ideal (100 Mbit/s:
  ``D`` about 0.65, ``Q`` about 0.5; 1 Gbit/s: about 0.8 and 0.15).

For ``N`` workers, ``M`` servers (pieces balanced over them) and an exchange every ``P`` steps
(``period``), one transfer of ``b`` bytes takes ``t(b) = a + e + b / min(beta, R)`` and costs
``cpu(b) = a + e + b / beta``, where ``e`` is the CPU its encoding and decoding take (0 for
float32; assumed per float32 byte, from the figures in ``distsgd/ps/compression.py``). With
``u = B * f_push`` and ``d = B * f_pull`` (``d = B`` over shared memory, whose pulls stay
float32):

``async`` (each worker: pull, compute, push; no worker waits for another)::

    T_step   = c + (t(d) + t(u)) / P            (overlap: max(c, (t(d) + t(u)) / P))
    X_serial = N / T_step
    X_link   = P * M * D * R / max(d, u)        (each way of a server's link carries d or u
                                                 per exchange of every worker; D with 2 or
                                                 more workers, whose pulls and pushes cross)

With a window (``P > 1``) over links, the workers that compute side by side (``min(N, K)``)
exchange at the same moment and share the servers' links, so an exchange takes at least
``min(N, K) * (u + d) / (M * R)``.

``sync`` (rounds: all push, the servers apply, all pull; a server's link carries N of each,
and its process takes the round's N pushes one after another while no worker computes; on K
shared cores the N steps of a round take ``c * max(1, N / K)``)::

    T_round  = max(t(u), N * u / (M * R), N * B / M * s) + max(t(d), N * d / (M * R))
    T_step   = c * max(1, N / K) + ((1 - Q) * T_round + Q * T_turn) / P
    T_turn   = max(t(d) + t(u) + (N - 1) * max(u, d) / (M * D * R), N * B / M * s + t(d))
    X_serial = N / T_step

(``T_turn``: the round pipelined, each worker's pull in turn and its push as the next pull
goes out, the two ways at ``D``; ``Q`` = 0 on one host.)

``collective`` (ring all-reduce of the whole model; each worker sends and receives
``2 (N - 1) / N * u`` bytes in ``2 (N - 1)`` messages)::

    T_step   = c + (2 (N - 1) * a + 2 (N - 1) / N * u / min(beta, R)) / P
    X_serial = N / T_step

Through parameter servers a server's own work (checking, logging and applying each push, ``s``
seconds per float32 byte, one push after another) bounds the rate::

    X_server = P * M / (B * s)

and on shared cores, for every kind, the CPU a worker-step needs bounds the rate::

    X_cpu = K / (c + (cpu(d) + cpu(u)) / P)        (collective: cpu of its messages)

The prediction is the smallest bound, and the bottleneck is the bound that gave it (a
roofline: the bounds are each exact in their own regime, and the rate is over-estimated where
two of them are close). Staleness, in updates applied by others between a worker's pull and
the server's application of its push: ``async``: ``(N - 1) / N * X / P * (P * c + t(u))``
(one more own step under overlap); ``sync`` and ``collective``: 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distsgd.plan.traffic import Exchange


@dataclass(frozen=True, kw_only=True)
class Part:
    """One number of the model, and where it came from."""

    value: float
    """The value, in SI units (seconds, bytes, bytes/s)."""
    source: str
    """``measured: ...`` or ``assumed: ...``: how the value was found."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.value) or self.value < 0:
            raise ValueError(f"a cost-model part must be finite and >= 0, got {self.value}")


@dataclass(frozen=True, kw_only=True)
class Path:
    """A data path's figures: the fixed cost of a call and the throughputs of pulls and pushes."""

    name: str
    """``shared memory``, ``tensor socket`` or ``gloo``."""
    latency: Part
    """Seconds a call costs whatever its size (``a``)."""
    pull: Part
    """Bytes/s of a pull (``beta``); for gloo, of the all-reduce's traffic."""
    push: Part
    """Bytes/s of a push, the server's update included."""
    encoded_pulls: bool = True
    """Whether ``--pull-dtype`` applies on this path (shared memory pulls stay float32)."""
    push_cpu: Part | None = None
    """Bytes/s of a push's CPU work where its time (``push``) also holds waiting (the
    server's write-ahead log, the page cache's writeback); None: the same as ``push``."""
    server: Part | None = None
    """Seconds a server spends per pushed float32 byte, one push after another (its update
    and its log); None: :data:`SERVER_APPLY_S_PER_BYTE`."""

    def __post_init__(self) -> None:
        if self.pull.value <= 0 or self.push.value <= 0:
            raise ValueError(f"path {self.name}: throughputs must be > 0")


@dataclass(frozen=True, kw_only=True)
class Workload:
    """The model being trained."""

    param_bytes: Part
    """``B``: its float32 bytes."""
    step: Part
    """``c``: seconds of one step's compute, one thread."""

    def __post_init__(self) -> None:
        if self.param_bytes.value <= 0:
            raise ValueError("a model has more than 0 bytes")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Where the run's tasks are."""

    workers: int
    """``N``."""
    ps: int
    """``M`` (0 for collective schemes)."""
    link: float | None = None
    """``R``: each host's link, bytes/s each way; None where the tasks share one host."""
    cores: float | None = None
    """``K``: cores the tasks share (one machine, or emulated hosts on it); None: plenty."""
    duplex: float = 1.0
    """``D``: each way's share of its rate while a server's link carries pulls out and pushes
    in at once (measured by ``distsgd_emulate.link_probe``; 1: the ways do not slow each other)."""
    turns: float = 0.0
    """``Q``: how far transfers the same way, started together (a synchronous round's pulls),
    go in turn rather than share the link and end together: 0 to 1 (measured as ``D``)."""

    def __post_init__(self) -> None:
        if not 0 < self.duplex <= 1:
            raise ValueError(f"duplex must be in (0, 1], got {self.duplex}")
        if not 0 <= self.turns <= 1:
            raise ValueError(f"turns must be in [0, 1], got {self.turns}")
        if self.workers < 1:
            raise ValueError(f"a cluster needs at least 1 worker, got {self.workers}")
        if self.ps < 0:
            raise ValueError(f"--ps must be >= 0, got {self.ps}")
        if self.link is not None and self.link <= 0:
            raise ValueError(f"a link's rate must be > 0 bytes/s, got {self.link}")
        if self.cores is not None and self.cores <= 0:
            raise ValueError(f"cores must be > 0, got {self.cores}")


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One scheme with its options and wire, as the model sees it."""

    label: str
    """How tables name it (the flags that make it)."""
    exchange: Exchange
    """Its communication pattern, options applied."""
    push_factor: float = 1.0
    """Bytes a push sends per float32 byte (``f_push``)."""
    pull_factor: float = 1.0
    """Bytes a pull brings per float32 byte (``f_pull``)."""
    push_encode: float = 0.0
    """CPU seconds per float32 byte to encode a push and decode it (0 for float32)."""
    pull_encode: float = 0.0
    """CPU seconds per float32 byte to encode a pull and decode it (0 for float32)."""

    def __post_init__(self) -> None:
        for name in ("push_factor", "pull_factor"):
            value = getattr(self, name)
            if not 0 < value <= 2:
                raise ValueError(f"{name} must be in (0, 2], got {value}")
        if not (self.push_encode >= 0 and self.pull_encode >= 0):
            raise ValueError("encoding costs must be >= 0")


@dataclass(frozen=True)
class Bound:
    """One limit on the rate: ``rate`` worker-steps/s, because of ``name``."""

    name: str
    rate: float


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What the model predicts for one setting on one cluster."""

    setting: Setting
    rate: float
    """Worker-steps per second, summed over the workers."""
    bottleneck: str
    """The bound that set ``rate``: ``compute and exchange`` (a worker's own loop), ``cpu``
    (the shared cores), ``server link``, ``server``."""
    bounds: tuple[Bound, ...]
    """Every bound, in the order computed."""
    bytes_per_step: float
    """Bytes a worker sends and receives per step (an exchange's share)."""
    server_link_bytes_per_step: float
    """Bytes one server's link carries, both ways, per worker-step of the cluster (0 for a
    collective scheme)."""
    staleness: float
    """Expected updates by others between a worker's pull and its push's application."""
    staggered: float | None = None
    """(Windowed schemes across hosts) the rate if the workers' exchanges fall apart instead
    of together, each alone on the servers' links: such runs settle in either regime, which
    one depends on how their first exchanges fell (docs/performance.md, "The cost model");
    ``rate`` is the together one. None where there is one regime."""


SERVER_APPLY_S_PER_BYTE = Part(
    value=0.6e-3 / 2.7e6,
    source="assumed: a push's finiteness check and SGD update inside the server, 0.6 ms per "
    "2.7 MB (docs/performance.md, profiled)",
)
"""The server's own CPU per pushed float32 byte."""


MIN_TRANSFER_SHARE = 0.1
"""The least share of a measured time that the transfer in it must take for its rate to be
read from it: below, the transfer is within the noise of the parts taken off (a step's compute,
measured in another run), and the rate it would give is not a measurement (the demo's
all-reduce once read as 153 GB/s: a step no longer than the compute, divided by a floor)."""


def transfer_rate(
    nbytes: float, seconds: float, *, fixed: float, assumed: Part, source: str
) -> Part:
    """Bytes/s of moving ``nbytes`` in a measured ``seconds`` of which ``fixed`` is not the
    transfer (the calls' latency, a step's compute): ``nbytes / (seconds - fixed)`` as
    ``source`` says, or ``assumed`` (saying why) where that rest is under
    :data:`MIN_TRANSFER_SHARE` of ``seconds``."""
    rest = seconds - fixed
    if nbytes > 0 and rest > 0 and rest >= MIN_TRANSFER_SHARE * seconds:
        return Part(value=nbytes / rest, source=source)
    why = (
        f"{source} gave {seconds * 1e3:.3g} ms with {fixed * 1e3:.3g} ms of it not the "
        "transfer: too little left to measure"
    )
    return Part(value=assumed.value, source=f"{assumed.source} ({why})")


def server_s_per_byte(path: Path) -> float:
    """A server's seconds per pushed float32 byte on ``path``."""
    return (path.server or SERVER_APPLY_S_PER_BYTE).value


def _transfer(
    nbytes: float, beta: float, encode: float, path: Path, link: float | None
) -> tuple[float, float]:
    """(seconds, CPU-seconds) of one call moving ``nbytes`` over ``path`` (and a link), with
    ``encode`` CPU-seconds of encoding on its ends."""
    rate = beta if link is None else min(beta, link)
    fixed = path.latency.value + encode
    return fixed + nbytes / rate, fixed + nbytes / beta


def predict(setting: Setting, workload: Workload, cluster: Cluster, path: Path) -> Prediction:
    """The rate, bottleneck, bytes and staleness of ``setting`` (the module's equations)."""
    ex = setting.exchange
    n, m, p = cluster.workers, max(cluster.ps, 1), ex.period
    c, b = workload.step.value, workload.param_bytes.value
    up = b * setting.push_factor
    down = b * setting.pull_factor if path.encoded_pulls else b
    if ex.kind == "collective":
        return _collective(setting, c, up, cluster, path)
    t_up, _ = _transfer(up, path.push.value, b * setting.push_encode, path, cluster.link)
    beta_cpu = (path.push_cpu or path.push).value
    _, cpu_up = _transfer(up, beta_cpu, b * setting.push_encode, path, cluster.link)
    pull_encode = b * setting.pull_encode if path.encoded_pulls else 0.0
    t_down, cpu_down = _transfer(down, path.pull.value, pull_encode, path, cluster.link)
    bounds: list[Bound] = []
    alone: float | None = None  # a windowed exchange's time without others on the link
    if ex.kind == "async":
        exchange = t_up + t_down
        if p > 1 and cluster.link is not None:
            exchange, alone = _together(exchange, up, down, n, m, cluster), exchange
        step = max(c, exchange / p) if ex.overlap else c + exchange / p
        bounds.append(Bound("compute and exchange", n / step))
        if cluster.link is not None:
            both = cluster.duplex if n > 1 else 1.0  # others' pushes come in as pulls go out
            bounds.append(Bound("server link", p * m * both * cluster.link / max(up, down)))
    else:
        serial = n * b / m * server_s_per_byte(path)  # the round's pushes, one after another
        computed = c * max(1.0, n / cluster.cores) if cluster.cores else c
        step = computed + _round(t_up, t_down, up, down, serial, cluster) / p
        bounds.append(Bound("compute and exchange", n / step))
    bounds.append(Bound("server", p * m / (b * server_s_per_byte(path))))
    if cluster.cores is not None:
        bounds.append(Bound("cpu", cluster.cores / (c + (cpu_up + cpu_down) / p)))
    rate, bottleneck = _smallest(bounds)
    staggered = None
    if alone is not None:
        step = max(c, alone / p) if ex.overlap else c + alone / p
        staggered = _smallest([Bound("", n / step), *bounds[1:]])[0]
    extra = 1.0 if ex.overlap else 0.0
    stale = (n - 1) / n * rate / p * (p * c + t_up) + extra if ex.kind == "async" else 0.0
    return Prediction(
        setting=setting,
        rate=rate,
        bottleneck=bottleneck,
        bounds=tuple(bounds),
        bytes_per_step=(up + down) / p,
        server_link_bytes_per_step=(up + down) / (p * m),
        staleness=stale,
        staggered=staggered if staggered is not None and staggered > rate * 1.001 else None,
    )


def _round(
    t_up: float, t_down: float, up: float, down: float, serial: float, cluster: Cluster
) -> float:
    """A synchronous round's exchange: its pushes, then its pulls, each sharing the servers'
    links and ending together; with links whose same-way transfers go in turn (``Q``), a
    share ``Q`` of it pipelined instead: the pulls one after another, each worker pushing as
    its pull ends, so that the two ways overlap at ``D`` of the rate."""
    n, m, link = cluster.workers, max(cluster.ps, 1), cluster.link
    shared = (lambda x: n * x / (m * link)) if link else (lambda x: 0.0)
    together = max(t_up, shared(up), serial) + max(t_down, shared(down))
    if link is None or cluster.turns == 0:
        return together
    piece = max(up, down) / (m * link)
    in_turn = max(t_down + t_up + (n - 1) * piece / cluster.duplex, serial + t_down)
    return (1 - cluster.turns) * together + cluster.turns * in_turn


def _together(exchange: float, up: float, down: float, n: int, m: int, cluster: Cluster) -> float:
    """A windowed scheme's exchange over links: workers that compute their windows side by
    side (as many as there are cores) exchange at the same moment and share the servers'
    links fairly, so they finish together and stay in step (measured: DOWNPOUR's pull and
    push took twice Hogwild's on the same link, two workers at 1 Gbit/s)."""
    assert cluster.link is not None
    side_by_side = min(n, max(1, int(cluster.cores))) if cluster.cores else n
    shared = side_by_side / (m * cluster.link)
    return max(exchange, shared * (up + down))


def _collective(setting: Setting, c: float, up: float, cluster: Cluster, path: Path) -> Prediction:
    """The ring all-reduce's bounds (the module's ``collective`` equations)."""
    n, p = cluster.workers, setting.exchange.period
    sent = 2 * (n - 1) / n * up
    messages = 2 * (n - 1)
    beta = path.push.value
    rate_link = beta if cluster.link is None else min(beta, cluster.link)
    fixed = messages * path.latency.value + setting.push_encode * up / setting.push_factor
    t_comm = fixed + sent / rate_link
    cpu_comm = fixed + sent / beta
    step = max(c, t_comm / p) if setting.exchange.overlap else c + t_comm / p
    bounds = [Bound("compute and exchange", n / step)]
    if cluster.cores is not None:
        bounds.append(Bound("cpu", cluster.cores / (c + cpu_comm / p)))
    rate, bottleneck = _smallest(bounds)
    return Prediction(
        setting=setting,
        rate=rate,
        bottleneck=bottleneck,
        bounds=tuple(bounds),
        bytes_per_step=2 * sent / p,
        server_link_bytes_per_step=0.0,
        staleness=0.0,
    )


def _smallest(bounds: list[Bound]) -> tuple[float, str]:
    low = min(bounds, key=lambda bound: bound.rate)
    return low.rate, low.name
