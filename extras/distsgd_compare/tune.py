"""``distsgd compare --tune KEY=V1,V2,...`` and ``--repeats K``: fair comparisons.

* :func:`parse_tune` reads the ``--tune`` flags (repeatable: several keys make a grid, every
  combination is tried); a key is a training flag's field (``lr``, ``momentum``,
  ``batch_size`` ...) or an option of a listed scheme (``server_lr``, ``alpha`` ...), which is
  tuned only for the schemes that have it. An entry of ``--schemes`` that fixes a key itself
  (``hogwild(lr=0.15)``) keeps its value and is not tuned on that key.
* Each tuning run trains on the training set minus a held-out validation part and is scored on
  that part (``TrainConfig.validation``, the runtime's ``validation`` module); the test set is
  not read. :func:`pick_best` chooses the setting with the best final validation accuracy
  (lowest validation loss when the script reports no accuracy); runs that failed or diverged
  are never chosen; a tie goes to the setting listed first.
* The final runs then use the whole training set and the test set, ``--repeats`` times with
  seeds ``--seed + i`` (``--seed`` default 0); :func:`spread` gives their mean and spread
  (the sample standard deviation, and min and max).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from distsgd import schemes
from distsgd.control.config import TrainConfig
from distsgd.schemes.entries import kind_of

FORM = "lr=0.03,0.1,0.3"
"""How a ``--tune`` flag is written (for error messages)."""

NOT_TUNABLE = {
    "seed": "--repeats K runs each entry with seeds --seed + i",
    "eval_every": "all runs evaluate equally often; give --eval-every N",
    "validation": "--validation sets the held-out fraction of the tuning runs",
}
"""Training fields ``--tune`` refuses, and why."""

DEFAULT_VALIDATION = 0.2
"""Fraction of the training set the tuning runs hold out, unless ``--validation`` says."""

STALLED = "did not learn"
"""A tuning run's status when it ended at chance while its parameters barely moved (a setting
too small or too short to learn; never chosen, like a diverged one)."""


@dataclass(frozen=True, kw_only=True)
class TuneKey:
    """One ``--tune`` flag: a key and the values to try, in the order given."""

    name: str
    """The TrainConfig field or scheme option (``_`` form)."""
    values: tuple[Any, ...]
    option: bool
    """True: a scheme option (tuned for the schemes that have it); False: a TrainConfig field."""

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError(f"--tune {self.name}: no values; write KEY=V1,V2,..., e.g. {FORM}")


@dataclass(frozen=True, kw_only=True)
class Trial:
    """One tuning run of an entry: its setting and its validation score."""

    setting: dict[str, Any]
    status: str
    accuracy: float | None = None
    loss: float | None = None
    run_dir: str = ""


def _option_fields(names: Sequence[str]) -> dict[str, dataclasses.Field[Any]]:
    # the first listed scheme's field of a name wins: it is written last
    return {f.name: f for n in reversed(names) for f in dataclasses.fields(schemes.get(n).options)}


def _convert(key: str, kind: type, text: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        what, example = ("an integer", f"{key}=1,2") if kind is int else ("a number", FORM)
        raise ValueError(
            f"--tune {key}: '{text}' is not {what}; give {what.split()[1]}s, e.g. {example}"
        ) from None


def parse_tune(texts: Sequence[str], scheme_names: Sequence[str]) -> tuple[TuneKey, ...]:
    """The ``--tune`` flags as :class:`TuneKey` objects; ``scheme_names`` are the schemes of
    ``--schemes`` (whose options may be tuned). A malformed flag, an unknown or untunable key,
    a key given twice, an empty, repeated or wrongly typed value -> ValueError (one line:
    cause and fix)."""
    train = {f.name: f for f in dataclasses.fields(TrainConfig)}
    options = _option_fields(scheme_names)
    keys: list[TuneKey] = []
    for text in texts:
        key, eq, rest = (part.strip() for part in text.partition("="))
        if not eq or not key:
            raise ValueError(f"--tune {text!r}: no '='; write KEY=V1,V2,..., e.g. {FORM}")
        name = key.replace("-", "_")
        if name in NOT_TUNABLE:
            raise ValueError(f"--tune {key}: not tunable ({NOT_TUNABLE[name]}); drop it")
        if name in train:
            f, option = train[name], False
        elif name in options:
            f, option = options[name], True
        else:
            own = ", ".join(sorted(options)) or "none"
            fields = ", ".join(n for n in train if n not in NOT_TUNABLE)
            raise ValueError(
                f"--tune {key}: '{key}' is no training field and no option of "
                f"{', '.join(scheme_names) or 'the listed schemes'}; use a training field "
                f"({fields}) or one of their options ({own})"
            )
        if any(k.name == name for k in keys):
            raise ValueError(f"--tune {key} is given twice; give one --tune {key}=V1,V2,...")
        pieces = [p.strip() for p in rest.split(",")]
        if not rest or any(not p for p in pieces):
            raise ValueError(
                f"--tune {text!r}: an empty value; give values separated by single commas, "
                f"e.g. {name}=0.03,0.1,0.3"
            )
        values = tuple(_convert(name, kind_of(f), p) for p in pieces)
        if len(set(values)) != len(values):
            raise ValueError(f"--tune {text!r}: a value is listed twice; give each value once")
        keys.append(TuneKey(name=name, values=values, option=option))
    return tuple(keys)


def grid(keys: Sequence[TuneKey]) -> list[dict[str, Any]]:
    """Every combination of the keys' values (the first key varies slowest)."""
    if not keys:
        return []
    return [
        {k.name: v for k, v in zip(keys, combo, strict=True)}
        for combo in itertools.product(*(k.values for k in keys))
    ]


def setting_text(setting: dict[str, Any]) -> str:
    """``lr=0.1,momentum=0.9`` (a folder name and a table cell)."""
    return ",".join(f"{key}={value}" for key, value in setting.items())


def pick_best(trials: Sequence[Trial]) -> Trial | None:
    """The trial with the best validation score: highest accuracy, or lowest loss when no
    trial has an accuracy; only finished (``ok``) trials count; ties go to the first. None when
    no trial finished with a score."""
    done = [t for t in trials if t.status == "ok"]
    by_accuracy = [t for t in done if t.accuracy is not None and math.isfinite(t.accuracy)]
    if by_accuracy:
        return max(by_accuracy, key=lambda t: t.accuracy or 0.0)  # max keeps the first of ties
    by_loss = [t for t in done if t.loss is not None and math.isfinite(t.loss)]
    return min(by_loss, key=lambda t: t.loss or 0.0) if by_loss else None


@dataclass(frozen=True, kw_only=True)
class Spread:
    """Mean and spread of one number over an entry's repeats."""

    mean: float
    std: float
    """Sample standard deviation (n - 1); 0 for a single run."""
    low: float
    high: float
    n: int


def spread(values: Sequence[float | None]) -> Spread | None:
    """Mean, sample std, min and max of the values that are not None (None: none are)."""
    got = [float(v) for v in values if v is not None]
    if not got:
        return None
    std = statistics.stdev(got) if len(got) > 1 else 0.0
    return Spread(mean=statistics.fmean(got), std=std, low=min(got), high=max(got), n=len(got))
