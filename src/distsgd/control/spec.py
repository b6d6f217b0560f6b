"""A run's settings, typed: :class:`RunSpec`, the run folder's one settings file (``config.json``).

The launcher saves it when a run starts (``distsgd run``, ``distsgd demo``, under Ray too); every
reader loads it back through :meth:`RunSpec.load`: ``distsgd run --resume``,
``distsgd elastic scale`` and ``distsgd elastic join``. The worker counts are checked in one place,
:func:`check_worker_bounds`, which the launcher's own config calls too; the highest count a
server takes is the parameter server's own check (``ps.rules.check_max_workers``).

Torch-free, like the rest of ``distsgd.control``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from distsgd.control.config import TrainConfig
from distsgd.control.folder import CONFIG_FILE
from distsgd.ps.rules import check_max_workers
from distsgd.util import write_atomic

RUN_SPEC_VERSION = 1
"""The format of ``config.json`` this distsgd writes. Files written before the field existed
have the same content and no ``version``: they read as version 1."""


def check_worker_bounds(*, workers: int, min_workers: int, max_workers: int) -> None:
    """``--workers``, ``--min-workers`` and ``--max-workers`` (0 = ``--workers``): a one-line
    ValueError (cause; fix) unless ``1 <= min <= workers <= max``."""
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    if min_workers < 0 or max_workers < 0:
        raise ValueError("--min-workers and --max-workers must be 0 (= --workers) or more")
    check_max_workers(max_workers)
    low, high = min_workers or workers, max_workers or workers
    if not 1 <= low <= workers <= high:
        raise ValueError(
            f"--min-workers {low}, --workers {workers}, --max-workers {high}: "
            "need 1 <= min <= workers <= max"
        )


_SAVED = (
    "script",
    "script_args",
    "scheme",
    "scheme_options",
    "overrides",
    "workers",
    "ps",
    "run_id",
)
"""The fields every saved ``config.json`` has had; the others have defaults for older files."""


def _whole(name: str, value: object, low: int) -> None:
    """ValueError unless ``value`` is an int (not a bool) of at least ``low``."""
    if type(value) is not int or value < low:
        raise ValueError(f"{name} must be a whole number of at least {low}, got {value!r}")


class WorkerBounds(Protocol):
    """The worker counts of a run as both its launch settings
    (:class:`~distsgd.launcher.config.ClusterSize`) and its saved :class:`RunSpec` read them
    (0 for a bound: ``workers``); each subclasses it for these properties."""

    workers: int
    min_workers: int
    max_workers: int

    @property
    def lowest_workers(self) -> int:
        """``min_workers``, or ``workers`` when not given."""
        return self.min_workers or self.workers

    @property
    def highest_workers(self) -> int:
        """``max_workers``, or ``workers`` when not given."""
        return self.max_workers or self.workers

    @property
    def elastic(self) -> bool:
        """Whether the run may change size while it runs (``distsgd elastic scale``)."""
        return self.lowest_workers != self.highest_workers


@dataclass(frozen=True, kw_only=True)
class RunSpec(WorkerBounds):
    """What a run is: its script, scheme, training settings and size. Saved as the run folder's
    ``config.json`` (:meth:`save`) and read back by every tool (:meth:`load`)."""

    version: int = RUN_SPEC_VERSION
    """The file format (:data:`RUN_SPEC_VERSION`); a newer one is refused when loaded."""
    script: str
    """The training script, an absolute path."""
    script_args: tuple[str, ...] = ()
    """The script's own arguments."""
    scheme: str
    """The training scheme's name (``distsgd run --help-scheme`` lists them)."""
    scheme_options: dict[str, Any] = field(default_factory=dict)
    """The scheme's options, as given (checked by the scheme when the run starts)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """:class:`~distsgd.control.config.TrainConfig` fields changed from their defaults."""
    workers: int
    """Worker tasks the run starts with."""
    ps: int
    """Parameter-server tasks (0: a collective scheme)."""
    threads_per_worker: int = 0
    """Torch threads of each worker (0: not recorded, in files of older runs)."""
    run_id: str
    """Identifies the run to its servers; kept when it is resumed."""
    checkpoint_every: int = 0
    """Checkpoint every N steps of each worker (0: by time only)."""
    checkpoint_seconds: float = 0.0
    """Checkpoint every N seconds (0 with ``checkpoint_every`` 0: off)."""
    min_workers: int = 0
    """Fewest workers an elastic run goes on with (0: ``workers``)."""
    max_workers: int = 0
    """Most workers an elastic run may grow to (0: ``workers``)."""

    def __post_init__(self) -> None:
        if self.version != RUN_SPEC_VERSION:
            raise ValueError(
                f"settings of format version {self.version!r}, this distsgd reads "
                f"{RUN_SPEC_VERSION}; use the distsgd version that wrote them"
            )
        for name in ("script", "scheme", "run_id"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be text, got {getattr(self, name)!r}")
        if not self.script or not self.scheme:
            raise ValueError("script and scheme must be given; name the training script and scheme")
        if not all(isinstance(a, str) for a in self.script_args):
            raise ValueError(f"script_args must be text, got {list(self.script_args)!r}")
        for name in ("scheme_options", "overrides"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a JSON object, got {getattr(self, name)!r}")
        unknown = sorted(set(self.overrides) - {f.name for f in dataclasses.fields(TrainConfig)})
        if unknown:
            raise ValueError(
                f"overrides: {', '.join(unknown)} are no training settings; see distsgd run --help"
            )
        TrainConfig().replace(**self.overrides)  # each value valid
        for name, low in (("workers", 1), ("ps", 0), ("threads_per_worker", 0)):
            _whole(name, getattr(self, name), low)
        for name in ("checkpoint_every", "min_workers", "max_workers"):
            _whole(name, getattr(self, name), 0)
        if isinstance(self.checkpoint_seconds, bool) or not (
            isinstance(self.checkpoint_seconds, (int, float)) and self.checkpoint_seconds >= 0
        ):
            raise ValueError(
                f"checkpoint_seconds must be 0 or more seconds, got {self.checkpoint_seconds!r}"
            )
        check_worker_bounds(
            workers=self.workers, min_workers=self.min_workers, max_workers=self.max_workers
        )

    @property
    def dynamic_world_size(self) -> bool:
        """Whether the run was started with ``--world-size dynamic`` (workers may join)."""
        return self.overrides.get("world_size") == "dynamic"

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["script_args"] = list(self.script_args)
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        """The spec in ``text``; ValueError naming what is wrong (not JSON, another format
        version, a missing field, a field this version does not know, a bad value)."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        data.setdefault("version", RUN_SPEC_VERSION)  # written before the field existed
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown settings {', '.join(unknown)}")
        missing = [name for name in _SAVED if name not in data]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
        if isinstance(data["script_args"], list):
            data["script_args"] = tuple(data["script_args"])
        return cls(**data)

    def save(self, folder: Path) -> None:
        """Write the spec as ``folder/config.json``, atomically, readable by its owner only."""
        write_atomic(folder / CONFIG_FILE, self.to_json())

    @classmethod
    def load(cls, folder: Path) -> RunSpec:
        """The spec of the run in ``folder``; a one-line ValueError (cause; fix) when the folder
        holds no run, or a damaged or foreign ``config.json``."""
        path = Path(folder) / CONFIG_FILE
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ValueError(
                f"{folder} is not a distsgd run folder (no {CONFIG_FILE}); "
                "give the folder of a distsgd run or demo"
            ) from None
        try:
            version = dict(json.loads(text)).get("version", RUN_SPEC_VERSION)
        except (ValueError, TypeError):
            version = RUN_SPEC_VERSION  # damaged: said below
        if version != RUN_SPEC_VERSION:
            raise ValueError(
                f"{path}: settings of format version {version!r}, this distsgd reads "
                f"{RUN_SPEC_VERSION}; use the distsgd version that wrote the run"
            )
        try:
            return cls.from_json(text)
        except (ValueError, TypeError) as exc:
            message = " ".join(str(exc).split())
            raise ValueError(
                f"{path}: damaged ({message}); it cannot be resumed, scaled or joined"
            ) from None
