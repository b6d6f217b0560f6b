"""Packages of the distribution that live outside the library's core (``distsgd_emulate``;
``distsgd_rebalance``, ``distsgd_compare``, ``distsgd_k8s``): imported inside a function, where
a run or a command asks for what they do."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def installed(package: str, needed_by: str) -> Iterator[None]:
    """Around an import of ``package``: ValueError (one line) where it is not installed;
    ``needed_by`` names what asked for it (``emulated hosts``, ``--rebalance auto``)."""
    try:
        yield
    except ModuleNotFoundError as e:
        if e.name != package:
            raise
        raise ValueError(
            f"{needed_by} needs the {package} package, which is not installed; install "
            "distsgd with it (pip install -e . in a checkout installs every package)"
        ) from None
