"""The ``tc`` scripts of an emulated host's egress (its ``eth0``) and the reading of its counts:
bytes per destination, so a run can say how much each pair of hosts exchanged.

Layout on a host's ``eth0``::

    shaped:    tbf (handle 1:, the link's rate) -> htb 10: (counting only) -> classes
    unshaped:  htb 10: at root (counting only) -> classes

    class 10:M per other host (M = its index + 1, hex), 10:fd the launcher's management
    address, 10:fe everything else (the default: ARP, the bridge's address)

The htb classes run at 100 Gbit/s each, far above any link: they never shape, they count (a
``u32`` filter on the destination address picks the class; this kernel has no ``tc`` actions
to count with). Under a tbf each class has a ``bfifo`` leaf with the tbf's own queue limit
(:func:`tbf_sizes`): a tbf's limit is that of its child queue, which the
htb takes the place of. The switch ports' shapers (what a host receives) count nothing: every
byte a host receives another host sent, and counted.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = [
    "COUNT_HANDLE",
    "DEFAULT_MINOR",
    "MANAGEMENT_MINOR",
    "class_bytes",
    "egress_script",
    "limit_script",
    "minor_of",
    "tbf_sizes",
]

COUNT_HANDLE = "10:"
"""The counting htb's handle on a host's ``eth0``."""
MANAGEMENT_MINOR = 0xFD
"""The class of what a host sends to the launcher (the management address)."""
DEFAULT_MINOR = 0xFE
"""The class of what a host sends to no host and not to the launcher."""
_GSO_BYTES = 64 * 1024
_SHAPER_TICK_S = 0.002
_QUEUE_S = 0.05
_COUNT_RATE = "100gbit"
_QUANTUM = 60_000  # bytes a class may send per round; only to keep htb from warning
_CLASS = re.compile(r"^class htb 10:([0-9a-f]+) .*?\n\s*Sent (\d+) bytes", re.MULTILINE)


def tbf_sizes(rate_bits: int) -> tuple[int, int]:
    """The ``tbf`` burst and limit, in bytes, for a rate in bits/s.

    burst = max(64 KiB, rate x 2 ms): at least one full GSO packet (veth hands the shaper
    packets of up to 64 KiB; a bucket smaller than a packet makes tbf cut it into MTU-sized
    pieces), and at high rates enough tokens for the 2 ms a shaper's wake-up may take.
    limit = burst + max(64 KiB, rate x 50 ms): a queue of about 50 ms at the rate. Measured on
    a 20mbit link fed by a 1gbit one (2.5 MB, one TCP stream): with 20 ms the sender's link
    carried 38% more than the payload (drops in the full queue, sent again), with 50 ms
    10-20%, with 100 ms 1-4%; the payload rate was 19.2 Mbit/s with each. Transfers both ways
    at once did no better with the longer queue (13-17 Mbit/s each way with 50 ms, 12-14 with
    100 ms), so 50 ms it is.
    """
    rate_bytes = rate_bits / 8
    burst = max(_GSO_BYTES, round(rate_bytes * _SHAPER_TICK_S))
    return burst, burst + max(_GSO_BYTES, round(rate_bytes * _QUEUE_S))


def minor_of(index: int) -> int:
    """The counting class (minor number) of the host with ``index`` as a destination."""
    assert 0 <= index < MANAGEMENT_MINOR - 1, index
    return index + 1


def egress_script(
    dev: str,
    *,
    rate_bits: int | None,
    sizes: tuple[int, int] | None,
    destinations: Sequence[tuple[int, str]],
) -> str:
    """``tc -batch`` lines that shape (where ``rate_bits``) and count ``dev``'s egress.

    ``sizes``: the tbf's (burst, limit) in bytes (with ``rate_bits``); ``destinations``: (class
    minor, IPv4 address) of each address counted apart from the default class."""
    lines = []
    if rate_bits is None:
        parent = "root"
        limit = None
    else:
        assert sizes is not None
        burst, limit = sizes
        lines.append(_tbf("add", dev, rate_bits, burst, limit))
        parent = "parent 1:1"
    lines.append(
        f"qdisc add dev {dev} {parent} handle {COUNT_HANDLE} htb default {DEFAULT_MINOR:x}"
    )
    for minor in [*(m for m, _ in destinations), DEFAULT_MINOR]:
        lines.append(
            f"class add dev {dev} parent {COUNT_HANDLE} classid {COUNT_HANDLE}{minor:x} "
            f"htb rate {_COUNT_RATE} quantum {_QUANTUM}"
        )
        if limit is not None:
            lines.append(f"qdisc add dev {dev} parent {COUNT_HANDLE}{minor:x} bfifo limit {limit}")
    for minor, address in destinations:
        lines.append(
            f"filter add dev {dev} parent {COUNT_HANDLE} protocol ip u32 "
            f"match ip dst {address}/32 flowid {COUNT_HANDLE}{minor:x}"
        )
    return "\n".join(lines) + "\n"


def limit_script(dev: str, *, rate_bits: int, sizes: tuple[int, int], minors: Sequence[int]) -> str:
    """``tc -batch`` lines that set a shaped ``dev``'s tbf to a new rate and its counting
    classes' queues to the new limit, keeping the classes (and their counts)."""
    burst, limit = sizes
    lines = [_tbf("replace", dev, rate_bits, burst, limit)]
    for minor in [*minors, DEFAULT_MINOR]:
        lines.append(f"qdisc change dev {dev} parent {COUNT_HANDLE}{minor:x} bfifo limit {limit}")
    return "\n".join(lines) + "\n"


def _tbf(verb: str, dev: str, rate_bits: int, burst: int, limit: int) -> str:
    return (
        f"qdisc {verb} dev {dev} root handle 1: tbf rate {rate_bits}bit burst {burst} limit {limit}"
    )


def class_bytes(text: str) -> dict[int, int]:
    """Bytes sent through each counting class (by minor) in ``tc -s class show`` output."""
    return {int(minor, 16): int(sent) for minor, sent in _CLASS.findall(text)}
