"""The core's one way to the emulators: the package :mod:`distsgd_emulate` (emulated hosts as
network namespaces, their link faults and samples, the link probe), shipped beside ``distsgd``
but no part of it. No other module of ``distsgd`` imports it (tests/test_import_graph.py), and
this one only when it is needed: a run with ``--hosts`` (lose-host and network faults need
them) and ``distsgd plan --link``'s probe. A run without emulated hosts never loads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distsgd.control.faults import Fault
    from distsgd.control.metrics import MetricsWriter
    from distsgd.launcher.config import LaunchConfig
    from distsgd_emulate.link_faults import LinkFaults
    from distsgd_emulate.link_probe import LinkProbe
    from distsgd_emulate.link_sampler import LinkSampler
    from distsgd_emulate.netns import EmulatedHosts

__all__ = [
    "EmulatedHosts",
    "LinkProbe",
    "NoHosts",
    "close_hosts",
    "installed",
    "link_faults",
    "link_sampler",
    "probe_link",
    "start_hosts",
]

PACKAGE = "distsgd_emulate"
"""The emulators' package (``emulate/distsgd_emulate`` in a checkout)."""


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Around an import of :mod:`distsgd_emulate`: ValueError (one line) where the package is
    not installed."""
    try:
        yield
    except ModuleNotFoundError as e:
        if e.name != PACKAGE:
            raise
        raise ValueError(
            f"emulated hosts need the {PACKAGE} package, which is not installed; install "
            "distsgd with it (pip install -e . in a checkout installs both)"
        ) from None


class NoHosts:
    """The link faults and link samples of a run without emulated hosts: none."""

    def poll(self, step: int) -> None:
        """No network fault to apply."""

    def restore(self, step: int) -> list[dict[str, Any]]:
        """No network fault to undo."""
        return []

    def start(self) -> None:
        """No link to sample."""

    def stop(self) -> dict[str, dict[str, float]]:
        """No busiest window."""
        return {}


def start_hosts(config: LaunchConfig, run_dir: Path) -> EmulatedHosts | None:
    """The run's emulated hosts, started (``distsgd_emulate.emulation.start_hosts``); None
    without ``--hosts``. Call from the thread that will close them."""
    if not config.hosts:
        return None
    with installed():
        from distsgd_emulate import emulation
    return emulation.start_hosts(config, run_dir)


def close_hosts(
    hosts: EmulatedHosts | None,
    run_dir: Path,
    faults: Sequence[dict[str, Any]] = (),
    busiest: dict[str, dict[str, float]] | None = None,
) -> None:
    """Record the hosts' bytes and faults in ``hosts.json`` and take them down (nothing
    without hosts)."""
    if hosts is None:
        return
    from distsgd_emulate import emulation  # loaded: the hosts were made

    emulation.close_hosts(hosts, run_dir, faults, busiest)


def link_faults(
    faults: Sequence[Fault],
    hosts: EmulatedHosts | None,
    *,
    events: MetricsWriter,
    note: Callable[[str], None],
    run_dir: Path,
) -> LinkFaults | NoHosts:
    """The run's partitions and slow links (``distsgd_emulate.link_faults.LinkFaults``); none
    without hosts (a partition is then the worker's own, simulated)."""
    if hosts is None:
        return NoHosts()
    from distsgd_emulate.link_faults import LinkFaults

    return LinkFaults(faults, hosts, events=events, note=note, run_dir=run_dir)


def link_sampler(hosts: EmulatedHosts | None, run_dir: Path) -> LinkSampler | NoHosts:
    """The hosts' bytes over time into ``links.jsonl`` (``distsgd_emulate.link_sampler``);
    nothing sampled without hosts."""
    if hosts is None:
        return NoHosts()
    from distsgd_emulate.link_sampler import LinkSampler

    return LinkSampler(hosts, run_dir)


def probe_link(rate: str, nbytes: int, *, workers: int) -> LinkProbe:
    """A link of ``rate`` measured on emulated hosts (``distsgd_emulate.link_probe``);
    ValueError (one line) where they cannot be made here."""
    with installed():
        from distsgd_emulate.link_probe import probe_link as probe
    return probe(rate, nbytes, workers=workers)
