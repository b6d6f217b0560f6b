"""The catalogue of schemes: name -> options, worker rules, server half, and where the worker
half lives.

The catalogue imports no PyTorch: the launcher, ``distsgd plan`` and the servers read it. Each
spec names its torch worker half by import path (``distsgd.workers.<name>``), loaded only in a
process that trains (:meth:`SchemeSpec.make_worker`). Adding a scheme is one new module here that
builds a :class:`SchemeSpec`, its worker half under ``workers/``, and one line in
``schemes/__init__.py``; nothing in the runtime changes.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distsgd.control.config import TrainConfig
from distsgd.plan.traffic import Exchange, Traffic
from distsgd.ps.rules import UpdateRule
from distsgd.schemes.base import WorkerRules


@dataclass(frozen=True, kw_only=True)
class SchemeSpec:
    """One scheme of the catalogue."""

    name: str
    summary: str
    options: type
    """A keyword-only dataclass; each field has ``metadata["help"]`` and becomes a CLI flag."""
    rules: type[WorkerRules]
    """The worker rules (torch-free), built as ``rules(options, number of workers)``: it
    refuses options that cannot hold on that many workers, and training settings it cannot
    honour; its class attributes give the learning-rate rule."""
    worker: str | type[WorkerRules]
    """Where the torch worker half lives, ``"module:Class"`` (a subclass of :attr:`rules` and
    of :class:`~distsgd.runtime.scheme.WorkerScheme`), built like :attr:`rules`. The class
    itself serves within one process (a test, a notebook); the catalogue names a path, so
    that reading it loads no torch."""
    server: type[UpdateRule] | None = None
    """The server half, an :class:`UpdateRule` subclass built as ``server(options, num_workers)``
    (options: the parsed JSON object; it raises ValueError naming a bad option); None for
    collective-only schemes."""
    traffic: Traffic | None = None
    """What it sends, for the cost model (``distsgd plan``): ``async`` (pull, compute, push on
    its own), ``sync`` (rounds through the servers) or ``collective`` (all-reduce), every step
    or every ``period_option`` steps. None: ``async`` with a server half, else ``collective``,
    every step."""
    step_size: tuple[str, ...] = ("lr",)
    """The settings (``TrainConfig`` fields or the scheme's options) that set how far an update
    moves the parameters: what a diverged run of this scheme is told to lower."""

    def divergence_fix(self) -> str:
        """What to lower when a run of this scheme diverged, as flags."""
        return "lower " + self._step_flags()

    def stall_fix(self) -> str:
        """What to do when a run of this scheme did not learn (it stalled at chance)."""
        return f"raise {self._step_flags()}, or train longer (--epochs or --steps)"

    def unclear_fix(self) -> str:
        """Both fixes, for a run at chance that may have blown up or not got going."""
        return (
            f"if its training loss jumped early (metrics.jsonl), {self.divergence_fix()}; if it "
            f"was still falling, {self.stall_fix()}"
        )

    def _step_flags(self) -> str:
        return " or ".join(f"--{name.replace('_', '-')}" for name in self.step_size)

    def exchange(self, options: Any) -> Exchange:
        """Its communication with ``options`` (its parsed options dataclass) applied."""
        if self.traffic is not None:
            return self.traffic.resolve(options)
        return Exchange(kind="async" if self.server is not None else "collective")

    @property
    def uses_parameter_servers(self) -> bool:
        return self.server is not None

    @property
    def collective(self) -> bool:
        """Whether its workers train as one process group (all-reduce), with no parameter
        servers: it has no server half."""
        return self.server is None

    def check(self, options: Any, num_workers: int) -> WorkerRules:
        """The worker rules for ``options`` (the parsed dataclass) on ``num_workers`` workers;
        a setting that cannot hold there raises ValueError."""
        return self.rules(options, num_workers)

    def worker_class(self) -> type[Any]:
        """The torch worker half, a :class:`~distsgd.runtime.scheme.WorkerScheme` subclass
        (imports it, and PyTorch; the catalogue is below the runtime, so it is not named)."""
        if not isinstance(self.worker, str):
            return self.worker
        module, _, name = self.worker.partition(":")
        cls: type[Any] = getattr(importlib.import_module(module), name)
        return cls

    def make_worker(self, options: Any, num_workers: int) -> Any:
        """The worker half for ``options`` on ``num_workers`` workers (in a process that
        trains)."""
        return self.worker_class()(options, num_workers)

    def parse_options(self, values: Mapping[str, Any]) -> Any:
        """The options dataclass from a mapping; unknown names -> ValueError naming them."""
        known = {f.name for f in dataclasses.fields(self.options)}
        unknown = sorted(set(values) - known)
        if unknown:
            allowed = ", ".join(sorted(known)) or "none"
            raise ValueError(
                f"scheme {self.name!r} has no option {unknown[0]!r}; its options are: {allowed}"
            )
        return self.options(**values)


_SCHEMES: dict[str, SchemeSpec] = {}
_TRAIN_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}


def register(spec: SchemeSpec) -> SchemeSpec:
    """Add a scheme to the catalogue (a programming error if the spec is inconsistent)."""
    assert spec.name not in _SCHEMES, f"scheme {spec.name} registered twice"
    assert spec.rules.uses_parameter_servers == spec.uses_parameter_servers, (
        f"scheme {spec.name}: the worker rules' uses_parameter_servers disagrees with having a "
        "server half"
    )
    known = {f.name for f in dataclasses.fields(spec.options)}
    assert set(spec.step_size) <= known | _TRAIN_FIELDS, f"{spec.name}: unknown step_size names"
    clash = known & _TRAIN_FIELDS
    assert not clash, f"scheme {spec.name}: options {sorted(clash)} clash with TrainConfig fields"
    _SCHEMES[spec.name] = spec
    return spec


def names() -> list[str]:
    return list(_SCHEMES)


def get(name: str) -> SchemeSpec:
    try:
        return _SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown scheme {name!r}; choose one of: {', '.join(_SCHEMES)}") from None


def make_server_rule(name: str, options: Mapping[str, Any], num_workers: int) -> UpdateRule:
    """The factory a parameter-server process is given (see :data:`distsgd.ps.RuleFactory`)."""
    spec = get(name)
    if spec.server is None:
        raise ValueError(f"scheme {name!r} does not use parameter servers")
    return spec.server(options, num_workers)
