"""A link's delay, added in user space to each call of a parameter-server client.

The kernel here has no delay qdisc (netem), so an emulated host's ``--link RATE,DELAY[,JITTER]``
gets its rate from the kernel's shaper and its delay from this: every call a worker makes to a
server on another host (a pull, a push, a heartbeat, ...) waits the round trip of the two hosts'
links before it goes out. It is a fixed wait per request and answer, not a delay per packet:
it does not stretch TCP's own round trips (window growth, acknowledgements) the way netem
would, and collective traffic (torch.distributed) does not see it.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

__all__ = ["LinkDelay"]

MAX_DELAY_S = 60.0
"""The most a round trip may add (a typo's guard: ``--link 1gbit,5s`` is 20 s a call)."""


@dataclass(frozen=True, kw_only=True)
class LinkDelay:
    """The delay one client adds to each of its calls."""

    round_trip_s: float
    """Added to every call: both ways across both hosts' links, seconds."""
    jitter_s: float = 0.0
    """Each direction varies by up to this much either way, uniformly, seconds."""
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)
    """Where the jitter comes from."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.round_trip_s <= MAX_DELAY_S:
            raise ValueError(
                f"link round trip {self.round_trip_s} s is out of range; use 0 to {MAX_DELAY_S} s"
            )
        if not 0.0 <= self.jitter_s <= self.round_trip_s / 2:
            raise ValueError(
                f"link jitter {self.jitter_s} s is out of range; use 0 to half the round trip "
                f"({self.round_trip_s / 2} s)"
            )

    def sample(self) -> float:
        """One call's wait: the round trip, each direction moved by up to the jitter."""
        jitter = self.jitter_s
        spread = self.rng.uniform(-jitter, jitter) + self.rng.uniform(-jitter, jitter)
        return max(0.0, self.round_trip_s + spread)

    def wait(self) -> float:
        """Sleep one call's wait; the seconds slept."""
        seconds = self.sample()
        if seconds > 0:
            time.sleep(seconds)
        return seconds
