"""Measuring a shaped link for the cost model (``distsgd plan --link RATE``): how transfers of
one server's share of the model behave on emulated hosts whose links run at RATE.

A server's link carries whole-shard transfers: pulls out, pushes in. Alone, a transfer moves at
the link's rate; but where a transfer is larger than what the link's queue holds, two effects
set in that a rate alone does not predict (measured on 100 Mbit/s links, whose queue holds
about 0.7 MB, with 2.7 MB transfers; neither at 1 Gbit/s, whose queue holds 6.25 MB):

- **both ways at once**: a pull going out and a push coming in slow each other: each way's
  acknowledgements wait behind the other way's data in the queue, and the two ways together
  carried about 65% of twice the rate (:attr:`LinkProbe.duplex`);
- **one way, started together**: two pulls released at the same moment did not share the link
  and end together, as at 1 Gbit/s; one ended well before the other, as if served in turn
  (:attr:`LinkProbe.turns`).

:func:`probe_link` measures both on three to five emulated hosts (host0 serving, the others
pulling and pushing as the run's workers would), with a stdlib-only peer program, and removes
every namespace it made; it needs what emulated hosts need (root, or user namespaces).
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from distsgd.cluster.spec import TaskId
from distsgd_emulate.hosts import parse_links, plan_hosts

log = logging.getLogger(__name__)

PORT = 7000
"""The peer server's port on host0's own address (a namespace of this probe's)."""

MAX_PROBE_BYTES = 64 * 2**20
"""A transfer of the probe moves at most this many bytes (larger shards behave alike)."""

MAX_PEERS = 4
"""Hosts that pull and push at once in the both-ways measure, at most."""

TOGETHER_ROUNDS = 8
"""Pairs of pulls started together, one pair at a time, in the in-turn-or-shared measure."""

PHASE_SECONDS = 4.0
"""About how long the both-ways measure runs (more transfers on fast links, at least 4)."""

MIN_DUPLEX = 0.01
"""The least :attr:`LinkProbe.duplex` reported (a link whose ways starve each other)."""

PEER = r"""
import json, socket, sys, threading, time
def recvn(s, n, buf):
    view = memoryview(buf)[:n]; got = 0
    while got < n:
        k = s.recv_into(view[got:], n - got)
        if not k: raise EOFError
        got += k
mode, addr, port, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
data, buf = b"x" * size, bytearray(size)
if mode == "serve":
    ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((addr, port)); ls.listen(16); print("ready", flush=True)
    def handle(c):
        mine = bytearray(size)
        try:
            while True:
                recvn(c, 1, mine)
                if mine[0] == 80: c.sendall(data)
                else: recvn(c, size, mine); c.sendall(b"k")
        except (EOFError, OSError): pass
        finally: c.close()
    while True:
        c, _ = ls.accept(); threading.Thread(target=handle, args=(c,), daemon=True).start()
else:
    ops, starts = sys.argv[5], json.loads(sys.argv[6])
    s = socket.create_connection((addr, port), timeout=60)
    out = []
    for op, start in zip(ops, starts):
        while time.time() < start: time.sleep(0.0005)
        a = time.perf_counter()
        if op == "P": s.sendall(b"P"); recvn(s, size, buf)
        else: s.sendall(b"U" + data); recvn(s, 1, buf)
        out.append(time.perf_counter() - a)
    print(json.dumps(out))
"""
"""The peer program (stdlib only: it runs in the hosts' namespaces with ``python -S``):
``serve ADDR PORT SIZE`` answers "P" with SIZE bytes (a pull) and reads SIZE bytes after "U"
(a push); ``run ADDR PORT SIZE OPS STARTS`` does each op of OPS at its start time (0: at once
after the previous) and prints each op's seconds."""


_Runner = Callable[[Sequence[tuple[int, str, list[float]]]], list[list[float]]]
"""Runs peers: (host index, ops, start times) each; returns each one's op seconds."""


@dataclass(frozen=True, kw_only=True)
class LinkProbe:
    """What :func:`probe_link` measured."""

    rate: str
    """The link, as given (``100mbit``)."""
    nbytes: int
    """Bytes of one transfer."""
    alone_s: float
    """Seconds of one transfer with the link to itself (the median of several)."""
    duplex: float
    """Each way's share of what it carries alone while pulls go out and pushes come in at once
    (``peers`` hosts alternating): 1 where the two ways do not slow each other."""
    turns: float
    """How far two transfers the same way, started together, go in turn rather than share:
    0 when they end together, 1 when one ends at half the time the two take (or sooner)."""
    peers: int
    """Hosts that pulled and pushed at once in the both-ways measure."""

    def describe(self) -> str:
        return (
            f"measured on emulated hosts at {self.rate}: {self.nbytes / 1e6:.2f} MB in "
            f"{self.alone_s * 1e3:.0f} ms alone; both ways at once (pulls out, pushes in, "
            f"{self.peers} hosts) each way at {self.duplex:.0%}; two pulls started together "
            f"{'in turn' if self.turns >= 0.5 else 'sharing'} ({self.turns:.2f})"
        )


def turns_of(pairs: Sequence[tuple[float, float]]) -> float:
    """:attr:`LinkProbe.turns` from the seconds of pairs of transfers started together."""
    ratios = [min(a, b) / max(a, b) for a, b in pairs if max(a, b) > 0]
    if not ratios:
        return 0.0
    return min(1.0, max(0.0, 2.0 * (1.0 - statistics.fmean(ratios))))


def duplex_of(alone_s: float, nbytes: int, spans: Sequence[Sequence[float]]) -> float:
    """:attr:`LinkProbe.duplex` from each peer's op seconds in the both-ways measure: the bytes
    all moved over the longest span, against both ways at the alone rate; at least
    :data:`MIN_DUPLEX`, so the model's divisions stay finite."""
    moved = nbytes * sum(len(ops) for ops in spans)
    span = max(sum(ops) for ops in spans)
    if span <= 0 or alone_s <= 0:
        return 1.0
    return min(1.0, max(MIN_DUPLEX, moved / span / (2 * nbytes / alone_s)))


def probe_link(rate: str, nbytes: int, *, workers: int, timeout: float = 120.0) -> LinkProbe:
    """Measure a link of ``rate`` with transfers of ``nbytes`` (see the module docstring);
    ``workers`` hosts (2 to :data:`MAX_PEERS`) pull and push at once in the both-ways measure.
    ValueError (one line) where emulated hosts cannot be made or a peer fails."""
    from distsgd_emulate.netns import EmulatedHosts

    size = max(64 * 1024, min(int(nbytes), MAX_PROBE_BYTES))
    peers = max(2, min(workers, MAX_PEERS))
    tasks = [TaskId.parse(f"worker{i}") for i in range(peers + 1)]
    plan = plan_hosts(count=peers + 1, tasks=tasks, links=parse_links([rate]))
    with EmulatedHosts(plan) as hosts:
        address = plan.host("host0").address
        args = [address, str(PORT), str(size)]
        server = subprocess.Popen(
            [*hosts.enter("host0"), sys.executable, "-S", "-c", PEER, "serve", *args],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != "ready":
                raise ValueError(f"the link probe's server on {rate} did not start")

            def run(jobs: Sequence[tuple[int, str, list[float]]]) -> list[list[float]]:
                peer = [sys.executable, "-S", "-c", PEER, "run", *args]
                procs = [
                    subprocess.Popen(
                        [*hosts.enter(f"host{h}"), *peer, ops, json.dumps(starts)],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                    for h, ops, starts in jobs
                ]
                return [_answer(p, timeout) for p in procs]

            return _measure(run, rate, size, peers)
        finally:
            server.kill()
            server.wait(timeout=10)


def _answer(proc: subprocess.Popen[str], timeout: float) -> list[float]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        raise ValueError(f"the link probe's transfers took over {timeout:.0f}s") from None
    if proc.returncode != 0:
        last = (err.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"a link probe peer failed: {last}")
    return [float(x) for x in json.loads(out)]


def _measure(run: _Runner, rate: str, size: int, peers: int) -> LinkProbe:
    """The three measures (alone, two pulls together, both ways) with the peers ``run``s."""
    soon = time.time() + 0.5  # the peers start (and connect) within this
    alone = run([(1, "PPPP", [soon, 0, 0, 0])])[0]
    alone_s = statistics.median(alone[1:])
    gap = 4 * alone_s + 0.2
    starts = [time.time() + 0.5 + i * gap for i in range(TOGETHER_ROUNDS)]
    pulls = "P" * TOGETHER_ROUNDS
    first, second = run([(1, pulls, starts), (2, pulls, starts)])
    pairs = list(zip(first, second, strict=True))
    ops = max(6, min(48, round(PHASE_SECONDS / alone_s / max(1.0, peers / 2))))
    begin = time.time() + 0.5
    jobs = [
        (h, ("PU" if h % 2 else "UP") * (ops // 2), [begin] + [0.0] * (ops // 2 * 2 - 1))
        for h in range(1, peers + 1)
    ]
    both = run(jobs)
    got = LinkProbe(
        rate=rate,
        nbytes=size,
        alone_s=alone_s,
        duplex=duplex_of(alone_s, size, both),
        turns=turns_of(pairs),
        peers=peers,
    )
    log.info("link probe: %s", got.describe())
    return got
