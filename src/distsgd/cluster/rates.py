"""A link's rate as text (``10mbit``, ``1gbit``), as ``--link``, ``slow:`` faults and
``distsgd plan --link`` write it: bits per second in powers of 1000, as ``tc`` counts. The
emulated hosts' links (:mod:`distsgd_emulate.hosts`) read their rates and times with it."""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["LINK_EXAMPLE", "MIN_RATE", "RATE_UNITS", "parse_rate", "quantity"]

RATE_UNITS = {"bit": 1, "kbit": 1_000, "mbit": 1_000_000, "gbit": 1_000_000_000}
"""A rate's units, in bits per second."""
MIN_RATE = 1_000
"""The slowest rate a link may have (1kbit)."""
LINK_EXAMPLE = "e.g. 1gbit, 100mbit,5ms or worker1=10mbit"
"""How a ``--link`` is written, for the error messages."""

_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_QUANTITY_RE = re.compile(rf"^{_NUMBER}\s*([a-z]+)$")


def quantity(text: str, units: Mapping[str, float], what: str, whole: str) -> float:
    """``text`` (a number and one of ``units``) in the base unit; ValueError naming the link
    ``whole`` it is part of and its ``what`` (rate, time) where it is not one."""
    match = _QUANTITY_RE.match(text.strip().lower())
    if match is None or match.group(2) not in units:
        names = ", ".join(units)
        raise ValueError(
            f"link {whole!r}: bad {what} {text.strip()!r}; write a number and a unit "
            f"({names}), {LINK_EXAMPLE}"
        )
    return float(match.group(1)) * units[match.group(2)]


def parse_rate(text: str) -> int:
    """A rate as text (``10mbit``, ``1gbit``) in bits/s, as a link's RATE is read; ValueError
    where it is not one, or below 1kbit."""
    bits = round(quantity(text, RATE_UNITS, "rate", text))
    if bits < MIN_RATE:
        raise ValueError(f"rate {text.strip()!r} is below 1kbit; use at least 1kbit")
    return bits
