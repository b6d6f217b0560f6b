"""What one ``distsgd compare`` runs: :class:`CompareConfig`, the entries of ``--schemes`` with
the settings given for all, each checked before the first run, and the :class:`LaunchConfig` of
each of their runs (tuning, repeats, the one-worker baseline). :mod:`distsgd_compare.run` runs
them."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distsgd import schemes
from distsgd.launcher.config import (
    DEFAULT_CHECKPOINT_SECONDS,
    DEFAULT_MAX_RESTARTS,
    ClusterSize,
    Durability,
    Hosting,
    LaunchConfig,
)
from distsgd.schemes.entries import SchemeEntry, parse_entry
from distsgd.transport.security import TlsConfig
from distsgd_compare.folders import check_duplicates, with_folders
from distsgd_compare.tune import DEFAULT_VALIDATION, TuneKey, grid, parse_tune, setting_text

BASELINE_LABEL = "1 worker (allreduce)"
"""The label of the ``--baseline`` row."""


@dataclass(frozen=True, kw_only=True)
class CompareConfig:
    """A comparison of schemes on this machine; every run gets the same script and options."""

    schemes: tuple[str, ...] = field(
        metadata={"help": "the entries of --schemes (NAME or NAME(KEY=VALUE,...)), in order"}
    )
    script: str = field(metadata={"help": "the training script (calls distsgd.train)"})
    script_args: tuple[str, ...] = field(default=(), metadata={"help": "arguments for the script"})
    label: str = field(
        default="", metadata={"help": "the model's name in titles ('' = the script's file name)"}
    )
    workers: int = field(default=2, metadata={"help": "worker tasks of every run"})
    ps: int | None = field(
        default=None,
        metadata={"help": "ps tasks of parameter-server schemes (default 1); others run without"},
    )
    scheme_options: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "scheme options; each applies to every listed scheme that has it"},
    )
    overrides: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "TrainConfig fields to override in every run"}
    )
    out: Path | None = field(
        default=None,
        metadata={"help": "output folder, new or empty (default ./distsgd-compare/<time>)"},
    )
    target: float | None = field(
        default=None,
        metadata={"help": "target test accuracy (default 95% of the best final accuracy)"},
    )
    points: int = field(
        default=20, metadata={"help": "evaluations per curve to aim for (sets eval_every)"}
    )
    threads: int = field(
        default=0, metadata={"help": "torch threads per worker (0 = cores / workers)"}
    )
    checkpoint_every: int = field(default=0, metadata={"help": "checkpoint every N steps"})
    checkpoint_seconds: float = field(
        default=DEFAULT_CHECKPOINT_SECONDS, metadata={"help": "checkpoint every N s"}
    )
    max_restarts: int = field(
        default=DEFAULT_MAX_RESTARTS, metadata={"help": "restarts allowed per task in a row"}
    )
    faults: tuple[str, ...] = field(default=(), metadata={"help": "--inject-fault specs"})
    tls: TlsConfig | None = field(default=None, metadata={"help": "mutual TLS for every task"})
    command: str = field(default="", metadata={"help": "the command line, for the report"})
    tune: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "--tune KEY=V1,V2,... flags: each entry runs every combination on a "
            "validation split and keeps its best (distsgd_compare.tune)"
        },
    )
    validation: float = field(
        default=0.0,
        metadata={"help": "fraction of train_data the tuning runs hold out (0 = 0.2 with tune)"},
    )
    repeats: int = field(
        default=1, metadata={"help": "final runs per entry, with seeds --seed + i (default 0)"}
    )
    baseline: bool = field(
        default=False,
        metadata={"help": "add a one-worker allreduce run over the same total samples"},
    )
    entries: tuple[SchemeEntry, ...] = field(init=False, repr=False, compare=False)
    """``schemes`` parsed, each with its run folder; the baseline last when asked for."""
    tune_keys: tuple[TuneKey, ...] = field(init=False, repr=False, compare=False)
    """``tune`` parsed."""

    def __post_init__(self) -> None:
        if not self.schemes:
            raise ValueError(
                "no schemes to compare; give --schemes A,B (list: distsgd run --help-scheme)"
            )
        entries = [parse_entry(text) for text in self.schemes]
        check_duplicates(entries)
        if self.baseline:
            if self.workers == 1:
                raise ValueError(
                    "--baseline with --workers 1: every run is one worker already; drop "
                    "--baseline or give --workers N (N > 1)"
                )
            entries.append(SchemeEntry(label=BASELINE_LABEL, scheme="allreduce", baseline=True))
        object.__setattr__(self, "entries", with_folders(entries))
        self._check_scheme_options()
        if self.repeats < 1:
            raise ValueError(
                f"--repeats must be at least 1, got {self.repeats}; give --repeats 1 (one run "
                "per entry) or more"
            )
        object.__setattr__(
            self, "tune_keys", parse_tune(self.tune, [e.scheme for e in self.entries])
        )
        if self.validation and not self.tune_keys:
            raise ValueError(
                "--validation is the held-out fraction of --tune's runs; add --tune KEY=V1,V2 "
                "or drop --validation"
            )
        if not 0.0 <= self.validation < 1.0:
            raise ValueError(
                f"--validation must be a fraction in (0, 1), got {self.validation}; e.g. 0.2"
            )
        if "validation" in self.overrides:
            raise ValueError(
                "validation is set by --tune's runs only (give --validation X with --tune)"
            )
        if self.ps and not any(_uses_ps(e.scheme) for e in self.entries):
            raise ValueError(
                f"--ps {self.ps}: none of {', '.join(self.schemes)} uses parameter servers; "
                "drop --ps"
            )
        if self.target is not None and not 0.0 < self.target <= 1.0:
            raise ValueError(f"--target must be an accuracy in (0, 1], got {self.target}")
        if self.points < 2:
            raise ValueError(f"points must be at least 2, got {self.points}")
        if self.out is not None and _occupied(self.out):
            raise ValueError(
                f"--out {self.out} exists and is not empty; give a new or empty folder"
            )
        for entry in self.entries:
            for setting in self.grid_for(entry) or [{}]:
                try:
                    self.launch_config(
                        entry, Path("."), self.planned_eval_every() or 1, setting=setting
                    )
                except ValueError as exc:
                    where = f" with --tune {setting_text(setting)}" if setting else ""
                    raise ValueError(f"{entry.label}{where}: {exc}") from None

    def _check_scheme_options(self) -> None:
        for option in self.scheme_options:
            if not any(option in _option_names(e.scheme) for e in self.entries):
                flag = "--" + option.replace("_", "-")
                owners = [n for n in schemes.names() if option in _option_names(n)]
                raise ValueError(
                    f"{flag} is an option of {', '.join(owners) or 'no scheme'}, none of which "
                    f"is in --schemes; drop {flag} or add "
                    f"{owners[0] if owners else 'its scheme'} to --schemes"
                )

    def entry(self, label: str) -> SchemeEntry:
        """The entry of ``--schemes`` written ``label``."""
        return {entry.label: entry for entry in self.entries}[label]

    def options_for(self, entry: SchemeEntry | str) -> dict[str, Any]:
        """The scheme options of an entry (or label): the global ones its scheme has, then its
        own (a variant's value wins)."""
        entry = self.entry(entry) if isinstance(entry, str) else entry
        own = _option_names(entry.scheme)
        return {**{k: v for k, v in self.scheme_options.items() if k in own}, **entry.options}

    def overrides_for(self, entry: SchemeEntry | str) -> dict[str, Any]:
        """The TrainConfig overrides of an entry (or label): the global ones, then its own."""
        entry = self.entry(entry) if isinstance(entry, str) else entry
        return {**self.overrides, **entry.overrides}

    def tuned_keys(self, entry: SchemeEntry) -> tuple[TuneKey, ...]:
        """The ``--tune`` keys of an entry: its scheme's options and the TrainConfig fields,
        less those the entry fixes itself."""
        own = _option_names(entry.scheme)
        return tuple(
            k
            for k in self.tune_keys
            if (not k.option or k.name in own)
            and k.name not in entry.options
            and k.name not in entry.overrides
        )

    def grid_for(self, entry: SchemeEntry) -> list[dict[str, Any]]:
        """The settings an entry's tuning runs try ([] = it is not tuned)."""
        return grid(self.tuned_keys(entry))

    @property
    def validation_fraction(self) -> float:
        """The held-out fraction of the tuning runs."""
        return self.validation or DEFAULT_VALIDATION

    def seeds(self, entry: SchemeEntry) -> list[int | None]:
        """The seed of each final run of an entry: ``--seed`` (or the entry's, default 0) + i;
        a single run without ``--seed`` keeps the script's own (None)."""
        base = self.overrides_for(entry).get("seed")
        if self.repeats == 1:
            return [None if base is None else int(base)]
        return [int(base or 0) + i for i in range(self.repeats)]

    def planned_eval_every(self) -> int | None:
        """``eval_every`` when it is known before any run: given, or ``steps / points``."""
        if "eval_every" in self.overrides:
            return int(self.overrides["eval_every"])
        steps = int(self.overrides.get("steps", 0))
        return max(1, round(steps / self.points)) if steps else None

    def launch_config(
        self,
        entry: SchemeEntry,
        run_dir: Path,
        eval_every: int,
        *,
        setting: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> LaunchConfig:
        """The run of an entry (validated by :class:`LaunchConfig`), with a tuned ``setting``
        (scheme options and TrainConfig fields) and ``extra`` TrainConfig fields (seed,
        validation). The baseline runs one worker ``workers`` times as many steps (given
        ``--steps``; ``--epochs`` already count all workers' passes together), evaluating
        ``workers`` times less often per step: the same samples and evaluations."""
        own = _option_names(entry.scheme)
        setting = setting or {}
        options = {**self.options_for(entry), **{k: v for k, v in setting.items() if k in own}}
        overrides = {
            **self.overrides_for(entry),
            **{k: v for k, v in setting.items() if k not in own},
            **(extra or {}),
        }
        workers = self.workers
        if entry.baseline:
            workers = 1
            if overrides.get("steps"):
                overrides["steps"] = int(overrides["steps"]) * self.workers
            eval_every *= self.workers
        return LaunchConfig(
            script=self.script,
            script_args=self.script_args,
            scheme=entry.scheme,
            scheme_options=options,
            overrides={**overrides, "eval_every": eval_every},
            size=ClusterSize(workers=workers, ps=self.ps if _uses_ps(entry.scheme) else None),
            durability=Durability(
                checkpoint_every=self.checkpoint_every,
                checkpoint_seconds=self.checkpoint_seconds,
                max_restarts=self.max_restarts,
            ),
            hosting=Hosting(threads=self.threads, tls=self.tls),
            run_dir=run_dir,
            faults=self.faults,
        )

    def resolved_out(self) -> Path:
        if self.out is not None:
            return self.out
        base = Path("distsgd-compare") / time.strftime("%Y%m%d-%H%M%S")
        path, n = base, 1
        while path.exists():
            n += 1
            path = base.with_name(f"{base.name}-{n}")
        return path


def _occupied(path: Path) -> bool:
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


def _uses_ps(name: str) -> bool:
    return schemes.get(name).uses_parameter_servers


def _option_names(name: str) -> set[str]:
    return {f.name for f in dataclasses.fields(schemes.get(name).options)}
