"""Map typed config dataclasses onto argparse flags (``field_name`` -> ``--field-name``)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable
from typing import Any

from distsgd import schemes
from distsgd.runtime.config import TrainConfig

_TYPES: dict[str, type] = {"int": int, "float": float, "str": str}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_dataclass_flags(
    group: argparse._ArgumentGroup, cls: type, seen: set[str], dest_prefix: str
) -> None:
    for f in dataclasses.fields(cls):
        if f.name in seen:
            continue
        seen.add(f.name)
        kind = _TYPES.get(str(f.type), str)
        group.add_argument(
            _flag(f.name),
            dest=dest_prefix + f.name,
            type=kind,
            default=argparse.SUPPRESS,
            metavar=f.name.upper(),
            help=f"{f.metadata.get('help', '')} (default {f.default})",
        )


def add_training_flags(parser: argparse.ArgumentParser) -> None:
    """--batch-size, --epochs, --lr ...: override the script's TrainConfig."""
    group = parser.add_argument_group("training (override the script's distsgd.TrainConfig)")
    add_dataclass_flags(group, TrainConfig, set(), "train.")


def add_scheme_flags(parser: argparse.ArgumentParser) -> None:
    """--scheme and every scheme's options (checked against the chosen scheme later)."""
    parser.add_argument(
        "--scheme", default="sync", choices=schemes.names(), help="training scheme (default sync)"
    )
    seen: set[str] = set()
    for name in schemes.names():
        spec = schemes.get(name)
        if dataclasses.fields(spec.options):
            group = parser.add_argument_group(f"{name} options")
            add_dataclass_flags(group, spec.options, seen, "scheme.")


def collect(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    return {k[len(prefix) :]: v for k, v in vars(args).items() if k.startswith(prefix)}


def scheme_options(args: argparse.Namespace) -> dict[str, Any]:
    """The scheme flags given, checked to belong to ``args.scheme``."""
    given = collect(args, "scheme.")
    spec = schemes.get(args.scheme)
    own = {f.name for f in dataclasses.fields(spec.options)}
    for name in given:
        if name not in own:
            owners = [s for s in schemes.names() if name in _field_names(schemes.get(s).options)]
            raise ValueError(
                f"{_flag(name)} is an option of {', '.join(owners)}, not of {args.scheme}; "
                f"drop it or pick --scheme {owners[0]}"
            )
    return given


def _field_names(cls: type) -> Iterable[str]:
    return (f.name for f in dataclasses.fields(cls))
