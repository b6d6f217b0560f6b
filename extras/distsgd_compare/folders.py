"""The run folders of a comparison's entries (``OUT/runs/<folder>``) and the check that no two
entries repeat each other.

A plain entry's folder is its scheme's name (``hogwild``); a variant's is the name and its
settings joined by ``_`` (``downpour_server_lr=1``, characters other than letters, digits and
``. _ = + -`` turned into ``-``), with ``-2``, ``-3`` ... appended should two folders still
coincide.
"""

from __future__ import annotations

import dataclasses
import re

from distsgd.schemes.entries import SchemeEntry

UNSAFE = re.compile(r"[^A-Za-z0-9._=+-]+")
"""Characters a folder name made from an entry does not keep (each run becomes ``-``)."""
FOLDER_LIMIT = 100
"""Longest run folder name made from a variant (a longer one is cut, then made unique)."""

BASELINE_FOLDER = "baseline-1-worker"
"""The run folder of the ``--baseline`` entry."""


def _folder(entry: SchemeEntry) -> str:
    if entry.baseline:
        return BASELINE_FOLDER
    if not entry.is_variant:
        return entry.scheme
    text = "_".join([entry.scheme, *(f"{key}={value}" for key, value in entry.settings)])
    return UNSAFE.sub("-", text)[:FOLDER_LIMIT]


def with_folders(entries: list[SchemeEntry]) -> tuple[SchemeEntry, ...]:
    """Each entry with a run folder of its own (compared case-insensitively: some file
    systems are)."""
    taken: set[str] = set()
    out = []
    for entry in entries:
        base = _folder(entry)
        folder, n = base, 1
        while folder.casefold() in taken:
            n += 1
            folder = f"{base}-{n}"
        taken.add(folder.casefold())
        out.append(dataclasses.replace(entry, folder=folder))
    return tuple(out)


def check_duplicates(entries: list[SchemeEntry]) -> None:
    seen: dict[str, SchemeEntry] = {}
    for entry in entries:
        if entry.label in seen:
            raise ValueError(
                f"--schemes lists {entry.label} twice; give each entry once "
                "(runs with the same settings differ only by noise)"
            )
        seen[entry.label] = entry
    same: dict[tuple[str, str, str], SchemeEntry] = {}
    for entry in entries:
        key = (
            entry.scheme,
            repr(sorted(entry.options.items())),
            repr(sorted(entry.overrides.items())),
        )
        if key in same:
            raise ValueError(
                f"--schemes lists {same[key].label} and {entry.label}, the same settings; give "
                f"them once (to see the noise between runs, vary the seed: "
                f"{entry.scheme}(seed=1))"
            )
        same[key] = entry
