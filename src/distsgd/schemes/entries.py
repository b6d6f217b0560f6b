"""The entries of ``--schemes`` (``distsgd compare``, ``distsgd plan``): a scheme's name, or a
*variant* with its own settings in parentheses, ``downpour(server_lr=1)`` or
``hogwild(lr=0.15)``.

:func:`split_schemes` cuts the flag's text into entries, :func:`parse_entry` turns one into a
:class:`SchemeEntry`. An entry's label is the entry as written (legend, table rows,
compare.json); a comparison names its run folder (``distsgd_compare.folders``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from distsgd import schemes
from distsgd.control.config import TrainConfig

FORM = "NAME or NAME(KEY=VALUE,...), e.g. downpour(server_lr=1)"
"""How an entry of ``--schemes`` is written (for error messages)."""

PER_COMPARISON = {"eval_every": "--eval-every N", "validation": "--tune and --validation X"}
"""TrainConfig fields a variant may not set: every run of a comparison shares them."""

_KINDS: dict[str, type] = {"int": int, "float": float, "str": str}
_BARE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


@dataclass(frozen=True, kw_only=True)
class SchemeEntry:
    """One entry of ``--schemes``: a scheme, with the settings of a variant if it has some."""

    label: str
    """The entry as written (legend, table row, compare.json)."""
    scheme: str
    options: dict[str, Any] = field(default_factory=dict)
    """The variant's scheme options (over the global scheme flags)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """The variant's TrainConfig fields (over the global training flags)."""
    settings: tuple[tuple[str, str], ...] = ()
    """(field name, value as written) of each setting, in order; names the run folder."""
    folder: str = ""
    """Its run folder under ``OUT/runs`` (unique within the comparison)."""
    baseline: bool = False
    """The one-worker baseline of ``--baseline`` (allreduce alone, the same total samples)."""

    @property
    def is_variant(self) -> bool:
        return bool(self.settings)


def split_schemes(text: str) -> tuple[str, ...]:
    """``--schemes`` cut at the commas outside parentheses, each entry stripped ('' -> ())."""
    if not text.strip():
        return ()
    entries: list[str] = []
    depth, start = 0, 0
    for i, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth < 0:
                raise _malformed(text[start:].split(",")[0].strip(), "a ')' without its '('")
        elif char == "," and depth == 0:
            entries.append(text[start:i].strip())
            start = i + 1
    entries.append(text[start:].strip())
    if depth > 0:
        raise _malformed(entries[-1], "a '(' without its ')'")
    return tuple(entries)


def _malformed(text: str, cause: str, fix: str = f"write {FORM}") -> ValueError:
    return ValueError(f"--schemes entry '{text}': {cause}; {fix}")


def _field(scheme: str, key: str) -> tuple[dataclasses.Field[Any], bool] | None:
    """The options field (True) or TrainConfig field (False) that ``key`` names."""
    name = key.replace("-", "_")
    found = [(f, True) for f in dataclasses.fields(schemes.get(scheme).options) if f.name == name]
    found += [(f, False) for f in dataclasses.fields(TrainConfig) if f.name == name]
    return found[0] if found else None


def kind_of(f: dataclasses.Field[Any]) -> type:
    """The type a config field's value is read as from text (``int``, ``float``, else ``str``)."""
    return _KINDS.get(str(f.type), str)


def _example(f: dataclasses.Field[Any]) -> str:
    default = f.default if f.default is not dataclasses.MISSING else "..."
    return f"{f.name}={default if default != '' else '...'}"


def parse_entry(text: str) -> SchemeEntry:
    """One entry of ``--schemes``: ``NAME`` or ``NAME(KEY=VALUE,...)``.

    Keys are the scheme's options or TrainConfig fields (``-`` for ``_`` allowed), values are
    converted by the field's type; a ``str`` value may hold commas (``sync(worker_lrs=0.1,0.2)``:
    a piece without ``=`` that is not a bare name continues it). Malformed text, an unknown
    scheme or key, or a value of the wrong type -> ValueError (one line: cause and fix). The
    values themselves are checked later, with the global flags, by the run's LaunchConfig.
    """
    label = text.strip()
    if not label:
        raise ValueError("an empty name in --schemes; give names separated by commas")
    if "(" not in label and ")" not in label:
        schemes.get(label)  # unknown -> ValueError listing the catalogue
        return SchemeEntry(label=label, scheme=label)
    name, inner = _variant(label)
    found = _settings(label, name, inner)
    options: dict[str, Any] = {}
    overrides: dict[str, Any] = {}
    for f, is_option, value in found:
        (options if is_option else overrides)[f.name] = _converted(label, f, value)
    return SchemeEntry(
        label=label,
        scheme=name,
        options=options,
        overrides=overrides,
        settings=tuple((f.name, value) for f, _, value in found),
    )


_Setting = tuple[dataclasses.Field[Any], bool, str]
"""A variant's setting: the field it names, whether a scheme option (else TrainConfig), the
value as written."""


def _variant(label: str) -> tuple[str, str]:
    """``NAME(INNER)`` -> (NAME, INNER), NAME a known scheme and INNER not empty."""
    if label.count("(") != label.count(")"):
        raise _malformed(label, "unbalanced parentheses")
    match = re.fullmatch(r"([^()]*)\(([^()]*)\)", label, re.DOTALL)
    if match is None:
        raise _malformed(label, "one pair of parentheses, at the end, is allowed")
    name, inner = match.group(1).strip(), match.group(2).strip()
    if not name:
        raise _malformed(label, "no scheme name before '('")
    try:
        schemes.get(name)
    except ValueError as exc:
        raise ValueError(f"--schemes entry '{label}': {exc}") from None
    if not inner:
        raise _malformed(
            label, "nothing inside the parentheses", f"give KEY=VALUE pairs or write just {name}"
        )
    return name, inner


def _settings(label: str, name: str, inner: str) -> list[_Setting]:
    """The ``KEY=VALUE`` settings inside the parentheses, in order (values as written)."""
    found: list[_Setting] = []
    for piece in (p.strip() for p in inner.split(",")):
        if "=" not in piece:
            if found and piece and kind_of(found[-1][0]) is str and not _BARE_NAME.fullmatch(piece):
                f, is_option, value = found[-1]  # a str value holding commas goes on
                found[-1] = (f, is_option, f"{value},{piece}")
                continue
            raise _no_equals(label, name, piece)
        key, _, value = (part.strip() for part in piece.partition("="))
        if not key:
            raise _malformed(label, f"'{piece}' has no key", "write KEY=VALUE pairs")
        known = _field(name, key)
        if known is None:
            raise _unknown_key(label, name, key)
        f, is_option = known
        if f.name in PER_COMPARISON:
            raise _malformed(
                label,
                f"{f.name} is one setting for the whole comparison (all runs evaluate "
                "equally often)",
                f"drop it from the entry and give {PER_COMPARISON[f.name]}",
            )
        if any(g.name == f.name for g, _, _ in found):
            raise _malformed(label, f"{f.name} is given twice", "give it once")
        if not value:
            raise _malformed(label, f"{f.name} has an empty value", f"give one, e.g. {_example(f)}")
        found.append((f, is_option, value))
    return found


def _no_equals(label: str, name: str, piece: str) -> ValueError:
    if not piece:
        return _malformed(
            label,
            "an empty setting (two commas in a row, or one before ')')",
            "separate KEY=VALUE pairs with single commas",
        )
    named = _field(name, piece)
    example = _example(named[0]) if named else f"{piece}=VALUE"
    return _malformed(label, f"'{piece}' has no '='", f"write KEY=VALUE, e.g. {example}")


def _unknown_key(label: str, name: str, key: str) -> ValueError:
    own = ", ".join(f.name for f in dataclasses.fields(schemes.get(name).options))
    train = ", ".join(
        f.name for f in dataclasses.fields(TrainConfig) if f.name not in PER_COMPARISON
    )
    if own:
        cause = f"{name} has no option '{key}'"
        fix = f"use one of its options ({own}) or a TrainConfig field ({train})"
    else:
        cause = f"'{key}' is no TrainConfig field, and {name} has no options of its own"
        fix = f"use a TrainConfig field ({train})"
    return _malformed(label, cause, fix)


def _converted(label: str, f: dataclasses.Field[Any], value: str) -> Any:
    kind = kind_of(f)
    try:
        return kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise _malformed(
            label, f"{f.name}={value} is not {what}", f"give {what}, e.g. {_example(f)}"
        ) from None
