"""Map typed config dataclasses onto argparse flags (``field_name`` -> ``--field-name``), and
read back the values that several commands share (``--checkpoint-every``, the default script)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distsgd import schemes
from distsgd.control.config import TrainConfig
from distsgd.launcher.config import DEFAULT_CHECKPOINT_SECONDS
from distsgd.launcher.config import DEMO_SCRIPT as DEMO_SCRIPT  # where it was first named
from distsgd.schemes.entries import kind_of

"""The script of ``distsgd demo``, and of ``compare`` and ``k8s render`` without SCRIPT."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def add_training_flags(parser: argparse.ArgumentParser) -> None:
    """--batch-size, --epochs, --lr ...: override the script's TrainConfig."""
    group = parser.add_argument_group("training (override the script's distsgd.TrainConfig)")
    for f in dataclasses.fields(TrainConfig):
        group.add_argument(
            _flag(f.name),
            dest="train." + f.name,
            type=kind_of(f),
            default=argparse.SUPPRESS,
            metavar=f.name.upper(),
            help=f"{f.metadata.get('help', '')} (default {_default(f)})",
        )


def add_scheme_flags(parser: argparse.ArgumentParser) -> None:
    """--scheme and every scheme's options (checked against the chosen scheme later)."""
    parser.add_argument(
        "--scheme", default="sync", choices=schemes.names(), help="training scheme (default sync)"
    )
    add_scheme_option_flags(parser)


def _owners() -> dict[str, list[tuple[str, dataclasses.Field[Any]]]]:
    """Option name -> (scheme, field) of every scheme that has it, in catalogue order."""
    owners: dict[str, list[tuple[str, dataclasses.Field[Any]]]] = {}
    for name in schemes.names():
        for f in dataclasses.fields(schemes.get(name).options):
            owners.setdefault(f.name, []).append((name, f))
    return owners


def _flag_type(fields: list[dataclasses.Field[Any]]) -> type:
    kinds = {kind_of(f) for f in fields}
    if len(kinds) == 1:
        return kinds.pop()
    return float if kinds == {int, float} else str


def _shared_help(owned: list[tuple[str, dataclasses.Field[Any]]]) -> str:
    """Help of an option several schemes have: each one's default, honestly."""
    text = str(owned[0][1].metadata.get("help", ""))
    defaults = ", ".join(f"{scheme} {_default(f)}" for scheme, f in owned)
    return f"{text} (default: {defaults}; see --help-scheme)"


def add_scheme_option_flags(parser: argparse.ArgumentParser) -> None:
    """Every scheme's options as flags; an option several schemes share is one flag whose help
    names each scheme's default."""
    groups: dict[str, argparse._ArgumentGroup] = {}

    def group(key: str, title: str) -> argparse._ArgumentGroup:
        if key not in groups:
            groups[key] = parser.add_argument_group(title)
        return groups[key]

    for option, owned in _owners().items():
        if len(owned) == 1:
            scheme, f = owned[0]
            where = group(scheme, f"{scheme} options")
            text = f"{f.metadata.get('help', '')} (default {_default(f)})"
        else:
            where = group("", "options of several schemes (each scheme has its own default)")
            text = f"{', '.join(s for s, _ in owned)}: {_shared_help(owned)}"
        kind: dict[str, Any] = (
            {"action": "store_true"}  # a switch: --overlap
            if all(str(f.type) == "bool" for _, f in owned)
            else {"type": _flag_type([f for _, f in owned]), "metavar": option.upper()}
        )
        where.add_argument(
            _flag(option), dest="scheme." + option, default=argparse.SUPPRESS, help=text, **kind
        )


class HelpSchemeAction(argparse.Action):
    """``--help-scheme NAME``: print the scheme's summary, math and options, then exit 0;
    ``--help-scheme`` alone: the catalogue, one scheme a line."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        if values is None:
            for name in schemes.names():
                sys.stdout.write(f"{name:10s} {schemes.get(name).summary}\n")
            # stderr: stdout stays one scheme per line for scripts
            sys.stderr.write(
                f"each scheme's math, paper and options: {parser.prog} --help-scheme NAME\n"
            )
            parser.exit(0)
        try:
            text = scheme_help(str(values))
        except ValueError as exc:
            sys.stderr.write(f"distsgd: error: {exc}\n")
            parser.exit(2)
        sys.stdout.write(text)
        parser.exit(0)


def add_help_scheme_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--help-scheme",
        action=HelpSchemeAction,
        nargs="?",
        metavar="NAME",
        help="list the schemes, or show one's math, paper and options with its defaults; exit",
    )


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    """--cluster, --ps-hosts, --worker-hosts: the cluster of a task started by hand."""
    group = parser.add_argument_group(
        "cluster (first given wins: --cluster, host lists, TF_CONFIG)"
    )
    group.add_argument("--cluster", metavar="FILE", help="cluster spec, .toml or .json")
    group.add_argument(
        "--ps-hosts", "--ps_hosts", dest="ps_hosts", help="comma-separated ps addresses"
    )
    group.add_argument(
        "--worker-hosts",
        "--worker_hosts",
        dest="worker_hosts",
        help="comma-separated worker addresses",
    )


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    """--tls-cert, --tls-key, --tls-ca."""
    group = parser.add_argument_group("mutual TLS (all three, or none)")
    group.add_argument("--tls-cert", type=Path, help="this task's certificate (PEM)")
    group.add_argument("--tls-key", type=Path, help="this task's private key (PEM)")
    group.add_argument(
        "--tls-ca", type=Path, help="the CA certificate every task's certificate is signed by"
    )


def scheme_help(name: str) -> str:
    """What ``--help-scheme NAME`` prints (unknown name -> ValueError listing the schemes)."""
    spec = schemes.get(name)
    kind = (
        "parameter servers" if spec.uses_parameter_servers else "collective (no parameter servers)"
    )
    lines = [f"{spec.name}: {spec.summary}", f"runs on: {kind}", ""]
    doc = _module_doc(spec.rules)
    if doc:
        lines += [doc, ""]
    fields = dataclasses.fields(spec.options)
    if not fields:
        lines.append(f"options: none (distsgd run --scheme {name} SCRIPT)")
    else:
        lines.append(f"options (flags of distsgd run, demo and compare; {name}'s defaults):")
        for f in fields:
            metavar = f.name.upper()
            lines.append(f"  {_flag(f.name)} {metavar}")
            lines.append(f"      {f.metadata.get('help', '')} (default {_default(f)})")
    return "\n".join(lines) + "\n"


def _module_doc(obj: Any) -> str:
    module = inspect.getmodule(obj)
    return inspect.cleandoc(module.__doc__ or "") if module is not None else ""


def collect(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    return {k[len(prefix) :]: v for k, v in vars(args).items() if k.startswith(prefix)}


def scheme_options(args: argparse.Namespace) -> dict[str, Any]:
    """The scheme flags given, checked to belong to ``args.scheme``."""
    given = collect(args, "scheme.")
    own = {f.name for f in dataclasses.fields(schemes.get(args.scheme).options)}
    for name in given:
        if name not in own:
            owners = [scheme for scheme, _ in _owners()[name]]
            raise ValueError(
                f"{_flag(name)} is an option of {', '.join(owners)}, not of {args.scheme}; "
                f"drop it or pick --scheme {owners[0]}"
            )
    return given


def checkpoint_every(text: str | None) -> tuple[int, float]:
    """'50' -> 50 steps; '30s' -> 30 seconds; '0' -> off; None -> the default cadence."""
    if text is None:
        return 0, DEFAULT_CHECKPOINT_SECONDS
    try:
        if text.endswith("s"):
            return 0, float(text[:-1])
        return int(text), 0.0
    except ValueError:
        raise ValueError(
            f"--checkpoint-every {text!r}: give steps (50), seconds (30s) or 0 (off)"
        ) from None
