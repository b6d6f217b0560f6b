"""The server half of a scheme: an update rule applied to a shard when a worker pushes.

Rules are numpy code and know nothing of PyTorch or gRPC. A scheme module defines its rule as a
subclass of :class:`UpdateRule`; the parameter-server process is handed a factory that maps a
scheme name to its rule (dependency injection keeps this layer below the schemes).
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

from distsgd.transport.errors import PushReject

if TYPE_CHECKING:
    from distsgd.ps.shard import Shard

MAX_LR_SCALE = 1e3
"""Largest ``PushHeader.lr_scale`` a server accepts (a schedule factor is at most 1 in practice)."""

MAX_RATE = 1e4
"""Largest learning rate a server rule accepts (``lr``, ``server_lr``)."""

MAX_WORKERS = 1 << 16
"""Most workers a run may register (``RegisterHeader.num_workers``)."""


def check_max_workers(max_workers: int) -> int:
    """``--max-workers`` (0 = the registered number), or a one-line ValueError: the one check of
    the flag, made by the server and, before anything starts, by the run's settings."""
    if not 0 <= max_workers <= MAX_WORKERS:
        raise ValueError(f"--max-workers must be in 0..{MAX_WORKERS}, got {max_workers}")
    return max_workers


MAX_OPTIONS_BYTES = 64 << 10
"""Largest ``RegisterHeader.options_json`` (64 KiB of UTF-8)."""

MAX_OPTIONS_DEPTH = 4
"""Deepest nesting of arrays and objects in ``options_json`` (a flat object is depth 1)."""

WORLD_SIZE_OPTION = "world_size"
"""The option every rule accepts: "fixed" (count the registered workers, the default) or
"dynamic" (count the live members of the shard's membership)."""


def world_size_of(options: Mapping[str, Any]) -> str:
    """The ``world_size`` option ("fixed" when absent); ValueError (one line) if malformed."""
    value = options.get(WORLD_SIZE_OPTION, "fixed")
    if value not in ("fixed", "dynamic"):
        raise ValueError(f"option 'world_size' must be 'fixed' or 'dynamic', got {_short(value)}")
    return str(value)


@dataclass(frozen=True, kw_only=True)
class PushMeta:
    """Who pushed, and on which version of the parameters the payload was computed."""

    worker: int
    incarnation: int
    base_version: int
    lr_scale: float = 1.0
    """The worker's learning-rate schedule factor; server-side optimizers scale their rate."""
    sequence: int = 0
    """The push's id among its worker's pushes (0: none; see :mod:`distsgd.ps.sequence`)."""


@dataclass(frozen=True)
class PushOutcome:
    """Whether the shard applied a push, and if not, why: ``reject`` typed, ``reason`` in words.

    Build a refusal with :meth:`refused`, which starts the words with the reject's label.
    """

    accepted: bool
    reason: str = ""
    reject: PushReject = PushReject.NONE
    duplicate: bool = False
    """(accepted) its sequence was applied already: nothing was applied now."""

    def __post_init__(self) -> None:
        assert self.accepted == (self.reject is PushReject.NONE), "refusals carry a reject"

    @classmethod
    def refused(cls, reject: PushReject, detail: str) -> PushOutcome:
        """A push not applied because of ``reject``; ``reason`` is ``"<label>: <detail>"``."""
        return cls(False, f"{reject.label}: {detail}", reject)


ACCEPTED = PushOutcome(True)
DUPLICATE = PushOutcome(True, "duplicate: this push's sequence was applied already", duplicate=True)
"""A push applied before (a resend): answered accepted, applied no second time."""


# ------------------------------------------------------------------------------ rule options


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} overflows a double")
    return value


def _json_depth(text: str, limit: int) -> int:
    """How deep arrays and objects nest in JSON ``text`` (strings skipped); stops past ``limit``."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                break
        elif ch in "]}":
            depth -= 1
    return deepest


def parse_options_json(text: str) -> dict[str, Any]:
    """A rule's options from ``RegisterHeader.options_json``: a JSON object ("" = {}).

    ValueError (one line) for more than :data:`MAX_OPTIONS_BYTES`, nesting deeper than
    :data:`MAX_OPTIONS_DEPTH`, NaN or Infinity, a number that overflows a double, invalid JSON,
    or anything but an object.
    """
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_OPTIONS_BYTES:
        raise ValueError(
            f"options_json has {size} bytes, over the limit of {MAX_OPTIONS_BYTES}; "
            "send only the rule's options"
        )
    if not text.strip():
        return {}
    if _json_depth(text, MAX_OPTIONS_DEPTH) > MAX_OPTIONS_DEPTH:
        raise ValueError(
            f"options_json nests deeper than {MAX_OPTIONS_DEPTH} levels; send a flat JSON object"
        )
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"options_json is not JSON ({exc.msg} at character {exc.pos}); send a JSON object"
        ) from None
    except (ValueError, RecursionError) as exc:  # our hooks, or an int too long to convert
        raise ValueError(f"options_json: {exc}; send a JSON object of finite numbers") from None
    if not isinstance(value, dict):
        raise ValueError(
            f"options_json must be a JSON object, got {type(value).__name__}; send {{...}}"
        )
    return value


def bounded(
    default: Any = dataclasses.MISSING,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    doc: str = "",
) -> Any:
    """A :class:`ServerOptions` field whose value must lie in ``[low, high]`` (``(low, high]``
    with ``low_open``); no ``default`` means the option is required."""
    return dataclasses.field(
        default=default, metadata={"low": low, "high": high, "low_open": low_open, "doc": doc}
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_option(name: str, value: Any, kind: Any, meta: Mapping[str, Any]) -> Any:
    """``value`` as option ``name`` of type ``kind``, or ValueError naming the option."""
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"option {name!r} must be true or false, got {_short(value)}")
        return value
    if kind is str:
        if not isinstance(value, str) or len(value) > 256:
            raise ValueError(
                f"option {name!r} must be a string of at most 256 characters, got {_short(value)}"
            )
        return value
    low, high, low_open = meta.get("low"), meta.get("high"), meta.get("low_open", False)
    interval = (
        f"{'(' if low_open else '['}{'-inf' if low is None else f'{low:g}'}, "
        f"{'inf' if high is None else f'{high:g}'}]"
    )
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(
                f"option {name!r} must be an integer in {interval}, got {_short(value)}"
            )
        number: float = value
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"option {name!r} must be a number in {interval}, got {_short(value)}")
        try:
            number = value = float(value)
        except OverflowError:
            number = value = math.inf
        if not math.isfinite(number):
            raise ValueError(f"option {name!r} must be a finite number in {interval}, got {value}")
    else:
        raise TypeError(f"option {name!r}: ServerOptions fields are bool, int, float or str")
    too_low = low is not None and (number <= low if low_open else number < low)
    if too_low or (high is not None and number > high):
        raise ValueError(f"option {name!r} must be in {interval}, got {_short(value)}")
    return value


OptionsT = TypeVar("OptionsT", bound="ServerOptions")


@dataclass(frozen=True, kw_only=True)
class ServerOptions(ABC):  # noqa: B024 (a base of options records: nothing to override)
    """The typed options of a server rule, read from the JSON object a worker half's
    ``server_options`` returned: an abstract base, each rule's options a dataclass subclass of
    it. Subclasses declare fields of type bool, int, float or str
    (ranges with :func:`bounded`); :meth:`from_json` checks each value's type, finiteness and
    range, and refuses unknown names, with a ValueError naming the option.
    """

    ignored: ClassVar[frozenset[str]] = frozenset()
    """Names a worker half may send that this rule does not use (accepted and dropped)."""

    @classmethod
    def from_json(cls: type[OptionsT], mapping: Mapping[str, Any]) -> OptionsT:
        """The options from a JSON object (already parsed); ValueError naming a bad option."""
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(
            str(k)
            for k in mapping
            if k not in fields and k not in cls.ignored and k != WORLD_SIZE_OPTION
        )
        if unknown:
            takes = ", ".join(fields) or "none"
            raise ValueError(
                f"unknown option {_short(unknown[0])}; this rule's options are: {takes}"
            )
        values: dict[str, Any] = {}
        for name, f in fields.items():
            if name in mapping:
                values[name] = _check_option(name, mapping[name], hints[name], f.metadata)
            elif f.default is dataclasses.MISSING:
                raise ValueError(
                    f"option {name!r} is missing; the scheme's worker half sends it "
                    "(WorkerScheme.server_options)"
                )
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class SgdServerOptions(ServerOptions):
    """Options of a rule that steps with :class:`ServerSGD` at the run's rate."""

    lr: float = bounded(low=0.0, low_open=True, high=MAX_RATE, doc="the server's learning rate")
    momentum: float = bounded(0.0, low=0.0, high=1.0, doc="heavy-ball momentum")

    def sgd(self) -> ServerSGD:
        """A :class:`ServerSGD` with these options."""
        return ServerSGD(lr=self.lr, momentum=self.momentum)


class UpdateRule(ABC):
    """How a shard applies pushed payloads.

    ``locked`` rules run under the shard's lock (consistent reads and writes); a rule with
    ``locked = False`` (Hogwild) updates the arrays in place with no lock across workers.
    A rule bumps the shard version (``shard.bump()``) each time the parameters change.
    """

    locked: ClassVar[bool] = True
    movable: ClassVar[bool] = False
    """Whether the rule's state is per piece (its :class:`ServerSGD` buffers and nothing else),
    so a piece can move to another shard with its state (``--rebalance``, see
    :mod:`distsgd.ps.moves`). Rules with an open synchronous step leave it False."""

    def __init__(self, options: Mapping[str, Any], num_workers: int) -> None:
        """``options``: the parsed JSON object the worker half's ``server_options`` returned; a
        rule reads them with its :class:`ServerOptions` subclass (``XOptions.from_json``), which
        raises ValueError naming a bad option. Every rule is built as ``Rule(options, n)``.
        Every rule accepts the ``world_size`` option (:func:`world_size_of`); see
        :meth:`workers`."""
        self.num_workers = num_workers
        self.dynamic = world_size_of(options) == "dynamic"
        """Whether the rule counts the live members (``world_size`` "dynamic")."""

    def workers(self, shard: Shard) -> int:
        """How many workers the rule counts now: the registered number (``world_size`` fixed),
        or the shard's live members (dynamic; at least 1)."""
        if not self.dynamic:
            return self.num_workers
        return max(1, len(shard.membership.members))

    @abstractmethod
    def apply(self, shard: Shard, payload: dict[str, np.ndarray], meta: PushMeta) -> PushOutcome:
        """Apply one push of piece arrays to ``shard.values``, in place.

        The payload's arrays may be views of the server's receive buffer (the copy of a
        shared-memory push, a tensor socket's bytes) that the next push overwrites: copy
        whatever the rule keeps after it returns."""

    def on_leave(self, shard: Shard, worker: int) -> None:  # noqa: B027 - optional hook
        """A worker finished or left; synchronous rules adjust how many pushes close a step."""

    def on_membership(self, shard: Shard, members: list[int]) -> None:  # noqa: B027
        """The shard's members changed (a join, leave or eviction; ``members`` ascending), under
        the shard's lock. Rules that count workers under ``world_size`` dynamic react here."""

    def tick(self, shard: Shard, now: float) -> None:  # noqa: B027 - optional hook
        """Called about twice a second under the shard's lock (timeouts, e.g. a dead worker),
        and by a pull waiting for a version once :meth:`deadline_at` has passed."""

    def waiting_for(self, shard: Shard) -> dict[str, Any]:
        """(``distsgd doctor``) what the rule holds back until workers push, e.g. a
        synchronous step open for those missing; {} for a rule that never waits."""
        return {}

    def deadline_at(self) -> float | None:
        """The ``time.monotonic()`` at which the rule wants :meth:`tick` sooner than the
        ticker's half second (a synchronous round's learned deadline); None: no such time."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """The rule's state for a checkpoint: numpy arrays and JSON values, by name.

        The default saves every :class:`ServerSGD` attribute's momentum buffers; a rule with
        more state (an open synchronous step) extends it. Keys must not contain "/"-prefixed
        names of other entries.
        """
        return {
            f"{name}.buffers/{key}": buf
            for name, sgd in self._sgds().items()
            for key, buf in sgd.buffers.items()
        }

    def piece_state(self, keys: Collection[str]) -> dict[str, np.ndarray]:
        """Copies of these pieces' state, named ``<attribute>/<key>`` (a movable rule's
        :class:`ServerSGD` buffers)."""
        return {
            f"{name}/{key}": buf.copy()
            for name, sgd in self._sgds().items()
            for key, buf in sgd.buffers.items()
            if key in keys
        }

    def take_piece_state(self, state: Mapping[str, np.ndarray], values: Mapping[str, Any]) -> None:
        """Adopt :meth:`piece_state` of another shard; ValueError, changing nothing, if a name
        is not this rule's or a buffer does not match its piece in ``values``."""
        sgds = self._sgds()
        for name, buf in state.items():
            attribute, _, key = name.partition("/")
            have = values.get(key)
            if attribute not in sgds or have is None or buf.shape != have.shape:
                raise ValueError(f"rule state {name!r} does not belong to a piece that moved")
        for name, buf in state.items():
            attribute, _, key = name.partition("/")
            sgds[attribute].buffers[key] = np.array(buf, dtype=values[key].dtype, copy=True)

    def drop_piece_state(self, keys: Collection[str]) -> None:
        """Forget these pieces' state (they left the shard)."""
        for sgd in self._sgds().values():
            for key in keys:
                sgd.buffers.pop(key, None)

    def _sgds(self) -> dict[str, ServerSGD]:
        return {name: v for name, v in vars(self).items() if isinstance(v, ServerSGD)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        for name, sgd in self._sgds().items():
            prefix = f"{name}.buffers/"
            sgd.buffers = {
                k[len(prefix) :]: np.array(v, copy=True)
                for k, v in state.items()
                if k.startswith(prefix)
            }


BLOCK = 1 << 18
"""Elements per block of :func:`axpy` (1 MiB of float32: stays in cache; measured fastest of
2^14..2^20 on a 100 MB update)."""

_scratch = threading.local()


FINITE_BLOCK = 1 << 20
"""Elements per block of :func:`all_finite` (a 1 MiB flag buffer, in cache)."""


def all_finite(array: np.ndarray) -> bool:
    """Whether every value is finite, in one pass and without allocating: ``isfinite`` block by
    block into a small per-thread flag buffer (a non-contiguous array: its min and max, which
    are NaN if any value is, and infinite if any value is)."""
    if array.size == 0:
        return True
    if not array.flags.c_contiguous:
        return math.isfinite(float(array.min())) and math.isfinite(float(array.max()))
    flat = array.reshape(-1)
    flags = getattr(_scratch, "flags", None)
    if flags is None:
        flags = _scratch.flags = np.empty(FINITE_BLOCK, dtype=bool)
    for start in range(0, flat.size, FINITE_BLOCK):
        block = flat[start : start + FINITE_BLOCK]
        if not np.isfinite(block, out=flags[: block.size]).all():
            return False
    return True


def axpy(values: np.ndarray, alpha: float, x: np.ndarray) -> None:
    """``values += alpha * x`` in place, block by block through a small per-thread scratch
    buffer: no temporary the size of the piece (a 100 MB update allocates nothing)."""
    if values.size <= BLOCK or not values.flags.c_contiguous:
        values += alpha * x  # small, or a reshape would copy: numpy's own way
        return
    flat, src = values.reshape(-1), x.reshape(-1)
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.dtype != flat.dtype:
        buf = _scratch.buf = np.empty(BLOCK, dtype=flat.dtype)
    for start in range(0, flat.size, BLOCK):
        stop = min(start + BLOCK, flat.size)
        tmp = buf[: stop - start]
        np.multiply(src[start:stop], alpha, out=tmp, casting="unsafe")
        flat[start:stop] += tmp


RuleFactory = Callable[[str, Mapping[str, Any], int], UpdateRule]
"""(scheme name, options, number of workers) -> the scheme's rule; ValueError (one line, naming
the option) for an unknown scheme or a bad option."""


class ServerSGD:
    """SGD with optional heavy-ball momentum on numpy arrays (PyTorch's ``torch.optim.SGD`` form):

    ``b <- mu * b + g`` (``b = g`` at first), ``w <- w - lr * scale * b``.
    """

    def __init__(self, *, lr: float, momentum: float = 0.0) -> None:
        self.lr = lr
        self.momentum = momentum
        self.buffers: dict[str, np.ndarray] = {}

    def step(
        self, values: dict[str, np.ndarray], grads: Mapping[str, np.ndarray], scale: float = 1.0
    ) -> None:
        for key, grad in grads.items():
            direction = grad
            if self.momentum:
                buf = self.buffers.get(key)
                if buf is None:
                    buf = self.buffers[key] = np.array(grad, dtype=values[key].dtype, copy=True)
                else:
                    buf *= self.momentum
                    buf += grad
                direction = buf
            axpy(values[key], -(self.lr * scale), direction)
