"""When and what to move between parameter servers (``--rebalance auto``): a pure decision on
measured per-piece load; the launcher carries it out (:mod:`distsgd_rebalance.mover`) and
the servers move the pieces (:mod:`distsgd.ps.moves`).

The load a piece brings its server is the bytes it moves there per second, pushes and pulls
together: a server's link carries exactly these bytes, and its update and write-ahead log work
grows with them (the cost model, :mod:`distsgd.plan.cost`, counts a server's time the same
way). A shard's load is the sum over its pieces, ``L_s = sum_p r_p``.

A move takes pieces ``P`` from the most loaded shard ``h`` to the least loaded ``c``:

    L_h' = L_h - r(P),   L_c' = L_c + r(P),   r(P) = sum_{p in P} r_p

It is made only when ``L_h > (1 + margin) * mean(L)`` (the bottleneck stands out), and only
if the most loaded shard after it is lower by at least ``min_gain`` of ``L_h`` (a move costs a
pause of the pieces' pushes, so a move that gains little is not worth it). ``P`` is chosen
largest first among the pieces that fit in half the gap, ``r_p <= (L_h - L_c) / 2 - r(P)``,
which brings the two shards closest to even without overshooting; if no piece fits, the one
piece whose move lowers the maximum most. Pieces never split: a piece that alone is more
than the mean stays where it is, and the result says why nothing moved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DEFAULT_MARGIN = 0.2
"""Move when the busiest shard carries more than (1 + this) x the mean load."""
DEFAULT_MIN_GAIN = 0.05
"""...and the move lowers the busiest shard's load by at least this share of it."""


@dataclass(frozen=True, kw_only=True)
class Move:
    """Pieces to move from one shard to another, with the loads before and after (predicted)."""

    keys: tuple[str, ...]
    source: int
    dest: int
    before: tuple[float, ...]
    """Each shard's load (bytes/s) measured over the window."""
    after: tuple[float, ...]
    """Each shard's load once the pieces have moved, as the same rates predict."""

    @property
    def gain(self) -> float:
        """How much the busiest shard's load drops, as a share of it."""
        return 1.0 - max(self.after) / max(self.before) if max(self.before) > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class Decision:
    """A move, or None with the reason nothing moves (for the log)."""

    move: Move | None
    why: str


def decide(
    rates: Mapping[str, float],
    owner: Mapping[str, int],
    num_shards: int,
    *,
    margin: float = DEFAULT_MARGIN,
    min_gain: float = DEFAULT_MIN_GAIN,
) -> Decision:
    """The move that evens the load most (see the module docstring), given each piece's rate
    (``rates``, bytes/s) and its shard (``owner``)."""
    if num_shards < 2:
        return Decision(move=None, why="one server: nowhere to move to")
    loads = [0.0] * num_shards  # each shard's: the sum of its pieces' rates
    for key, rate in rates.items():
        loads[owner[key]] += rate
    total = sum(loads)
    if total <= 0:
        return Decision(move=None, why="no load measured yet")
    hot = max(range(num_shards), key=lambda s: (loads[s], -s))
    cold = min(range(num_shards), key=lambda s: (loads[s], s))
    mean = total / num_shards
    if loads[hot] <= (1 + margin) * mean:
        return Decision(
            move=None, why=f"balanced: the busiest server carries {loads[hot] / mean:.2f}x the mean"
        )
    keys = _choose(rates, owner, hot, (loads[hot] - loads[cold]) / 2)
    if not keys:
        return Decision(move=None, why=f"no piece of ps{hot} can move without overshooting")
    moved = sum(rates[k] for k in keys)
    after = list(loads)
    after[hot] -= moved
    after[cold] += moved
    move = Move(keys=tuple(keys), source=hot, dest=cold, before=tuple(loads), after=tuple(after))
    if move.gain < min_gain:
        return Decision(move=None, why=f"a move would gain {move.gain:.0%} only")
    return Decision(move=move, why=f"ps{hot} carries {loads[hot] / mean:.2f}x the mean")


def _choose(
    rates: Mapping[str, float], owner: Mapping[str, int], hot: int, half_gap: float
) -> list[str]:
    """Pieces of ``hot``, largest first, that fit in ``half_gap``; else the one piece whose
    move lowers the maximum most (if any does)."""
    mine = sorted(
        (k for k in rates if owner[k] == hot and rates[k] > 0), key=lambda k: (-rates[k], k)
    )
    chosen: list[str] = []
    room = half_gap
    for key in mine:
        if rates[key] <= room:
            chosen.append(key)
            room -= rates[key]
    if chosen:
        return chosen
    fits = [k for k in mine if rates[k] < 2 * half_gap]  # lowers max(L_h - r, L_c + r)
    return [min(fits, key=lambda k: (abs(rates[k] - half_gap), k))] if fits else []


def piece_rates(
    before: Mapping[str, int], after: Mapping[str, int], seconds: float
) -> dict[str, float]:
    """Per-piece bytes/s between two readings of the counters (a piece missing from
    ``before`` counts from zero; a counter that went down, a restarted server, gives 0)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    return {k: max(0, v - before.get(k, 0)) / seconds for k, v in after.items()}


def summary(move: Move, sizes: Sequence[int] | None = None) -> str:
    """One line for the console."""
    before, after = (", ".join(f"{x / 1e6:.1f}" for x in xs) for xs in (move.before, move.after))
    what = f"{len(move.keys)} piece(s)" + (f", {sum(sizes) / 1e6:.2f} MB" if sizes else "")
    return f"moving {what} ps{move.source} -> ps{move.dest}; MB/s per server {before} -> {after}"
