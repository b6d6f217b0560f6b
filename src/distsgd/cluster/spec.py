"""Cluster description: which tasks exist and where they listen.

A cluster has two jobs, mirroring TensorFlow 1's ``ClusterSpec``:

* ``ps`` -- parameter servers (may be empty), and
* ``worker`` -- at least one training worker; worker 0 is the chief.

Every task has an address ``"host:port"`` (IPv6 hosts in brackets, ``"[::1]:2222"``). Port 0
means "pick a free port when the server starts"; several tasks may share a port-0 address,
any other address must be unique.

A cluster can be read from a dict, a ``.toml`` / ``.json`` file, the TF1-style
``--ps_hosts`` / ``--worker_hosts`` flags (comma-separated), or TensorFlow's ``TF_CONFIG``
environment variable.

TensorFlow's ``chief`` job is accepted for compatibility: its single address becomes worker 0
and the ``worker`` list follows it, so TF's worker *i* becomes our worker *i + 1*. In a
``TF_CONFIG`` task, ``{"type": "chief", "index": 0}`` maps to worker 0 and
``{"type": "worker", "index": i}`` maps to worker *i + 1* when a chief is present.

Every error is a :class:`ClusterSpecError` whose message is one line naming the offending field
and saying how to fix it.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "JOBS",
    "ClusterSpec",
    "ClusterSpecError",
    "Role",
    "TaskId",
    "parse_tf_config",
]


class Role(enum.StrEnum):
    """A task's job in the cluster. Its value is the job's name, so a role reads, prints and
    goes into JSON as ``"ps"`` or ``"worker"`` (and equals that text)."""

    PS = "ps"
    """A parameter server: holds a shard of the parameters and applies the scheme's rule."""
    WORKER = "worker"
    """A training worker (worker 0 is the chief)."""


JOBS = (Role.PS, Role.WORKER)
"""The jobs of a distsgd cluster, in task order."""

_CHIEF = "chief"
_ALLOWED_JOBS_TEXT = "allowed jobs are ps, worker (and TF_CONFIG's chief)"
_TF_CONFIG_EXTRA_KEYS = ("task", "environment", "rpc_layer")
_DICT_WORKER_HINT = 'list at least one address, e.g. worker = ["127.0.0.1:2223"]'
_FLAG_WORKER_HINT = "pass at least one address, e.g. --worker-hosts 127.0.0.1:2223"
_TASK_RE = re.compile(r"^\s*(?:/job:)?([A-Za-z_]+)(?::|/task:|/replica:0/task:)?(\d+)\s*$")


class ClusterSpecError(ValueError):
    """A bad cluster description; the message is one line naming the field and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).splitlines()))


def _type_name(value: object) -> str:
    return type(value).__name__


# --------------------------------------------------------------------------- tasks


@dataclass(frozen=True, kw_only=True)
class TaskId:
    """One task of a cluster: its role (:class:`Role`; given as ``"ps"`` or ``"worker"`` it
    becomes one) and an index."""

    job: Role
    index: int

    def __post_init__(self) -> None:
        if self.job not in JOBS:
            raise ClusterSpecError(f"task.job: unknown job {self.job!r}; use one of ps, worker")
        object.__setattr__(self, "job", Role(self.job))
        if isinstance(self.index, bool) or not isinstance(self.index, int):
            raise ClusterSpecError(
                f"task.index: expected an integer, got {_type_name(self.index)} "
                f"{self.index!r}; use 0 or more"
            )
        if self.index < 0:
            raise ClusterSpecError(f"task.index: {self.index} is negative; use 0 or more")

    @property
    def name(self) -> str:
        """Compact name such as ``"ps0"`` or ``"worker1"``."""
        return f"{self.job}{self.index}"

    @property
    def is_chief(self) -> bool:
        """True for worker 0, which saves checkpoints and reports results."""
        return self.job == Role.WORKER and self.index == 0

    @classmethod
    def parse(cls, text: str) -> TaskId:
        """Parse ``"worker:1"``, ``"worker1"``, ``"ps:0"`` or ``"/job:worker/task:1"``."""
        match = _TASK_RE.match(text) if isinstance(text, str) else None
        if match is None or match.group(1) not in JOBS:
            raise ClusterSpecError(
                f"task {text!r}: expected job:index with job ps or worker, e.g. worker:0 or ps:1"
            )
        return cls(job=Role(match.group(1)), index=int(match.group(2)))


def _range_error(job: str, index: int, count: int, *, prefix: str, fix: str) -> ClusterSpecError:
    hint = f"this cluster has no {job} tasks" if count == 0 else f"use {fix}0..{count - 1}"
    return ClusterSpecError(
        f"{prefix}index {index} out of range for job {str(job)!r} ({count} tasks); {hint}"
    )


# --------------------------------------------------------------------------- addresses


def _address_key(address: str, field: str) -> tuple[str, int]:
    """Validate ``host:port`` and return a normalised ``(host, port)`` key."""
    if not isinstance(address, str):
        raise ClusterSpecError(
            f'{field}: expected a "host:port" string, got {_type_name(address)} {address!r}'
        )
    host, sep, port_text = address.rpartition(":")
    if not sep:
        raise ClusterSpecError(
            f"{field}: missing port in {address!r}; use host:port, e.g. 127.0.0.1:2222"
        )
    if not (port_text.isascii() and port_text.isdigit()) or int(port_text) > 65535:
        raise ClusterSpecError(
            f"{field}: bad port {port_text!r} in {address!r}; use host:port with a port 0-65535"
        )
    port = int(port_text)
    if not host:
        raise ClusterSpecError(
            f"{field}: empty host in {address!r}; use host:port, e.g. 127.0.0.1:{port}"
        )
    if any(ch.isspace() for ch in host) or "/" in host:
        raise ClusterSpecError(
            f"{field}: bad host {host!r} in {address!r}; use a hostname or IP address"
        )
    if host.startswith("[") or host.endswith("]"):
        inner = host[1:-1] if host.startswith("[") and host.endswith("]") else ""
        try:
            ip = ipaddress.IPv6Address(inner)
        except ValueError:
            raise ClusterSpecError(
                f"{field}: bad IPv6 host {host!r} in {address!r}; use e.g. [::1]:{port}"
            ) from None
        return f"[{ip.compressed}]", port
    if ":" in host or "[" in host or "]" in host:
        raise ClusterSpecError(
            f"{field}: IPv6 host in {address!r} must be in brackets; use e.g. [{host}]:{port}"
        )
    return host.lower(), port


def _check_jobs(jobs: Sequence[tuple[str, str, tuple[str, ...]]], *, no_worker: str) -> None:
    """Validate every address and their uniqueness; ``no_worker`` is the message if none.
    ``jobs``: (prefix for the error message, e.g. "cluster.worker"; short name used in "also
    used by ps[0]"; addresses) of each job."""
    seen: dict[tuple[str, int], str] = {}
    for field, job, addresses in jobs:
        for index, address in enumerate(addresses):
            key = _address_key(address, f"{field}[{index}]")
            if key[1] == 0:
                continue
            if key in seen:
                raise ClusterSpecError(
                    f"{field}[{index}]: address {address} is also used by {seen[key]}; "
                    "give each task its own port"
                )
            seen[key] = f"{job}[{index}]"
    if not any(addresses for _, job, addresses in jobs if job in ("worker", _CHIEF)):
        raise ClusterSpecError(no_worker)


def _as_tuple(value: object, field: str) -> tuple[str, ...]:
    """A job's address list as a tuple; anything but a list/tuple of strings is an error."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ClusterSpecError(
            f'{field}: expected a list of "host:port" strings, got {_type_name(value)}; '
            f'e.g. {field.rsplit(".", 1)[-1]} = ["127.0.0.1:2222"]'
        )
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise ClusterSpecError(
                f'{field}[{i}]: expected a "host:port" string, got {_type_name(item)} {item!r}'
            )
    return tuple(value)


# --------------------------------------------------------------------------- cluster spec


@dataclass(frozen=True)
class _Parsed:
    """A cluster read from a mapping, remembering TF's chief mapping for task lookup."""

    spec: ClusterSpec
    has_chief: bool
    tf_workers: int  # length of the original "worker" list


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """Addresses of the ``ps`` and ``worker`` tasks; validated on construction.

    Lists are converted to tuples, so a spec is immutable and hashable.
    """

    ps: tuple[str, ...] = ()
    worker: tuple[str, ...]

    def __post_init__(self) -> None:
        ps = _as_tuple(self.ps, "cluster.ps")
        worker = _as_tuple(self.worker, "cluster.worker")
        object.__setattr__(self, "ps", ps)
        object.__setattr__(self, "worker", worker)
        _check_jobs(
            [("cluster.ps", "ps", ps), ("cluster.worker", "worker", worker)],
            no_worker=f"cluster.worker: no worker task; {_DICT_WORKER_HINT}",
        )

    # ------------------------------------------------------------------ queries

    @property
    def num_ps(self) -> int:
        """Number of parameter-server tasks (may be 0)."""
        return len(self.ps)

    @property
    def num_workers(self) -> int:
        """Number of worker tasks (at least 1)."""
        return len(self.worker)

    def _job_addresses(self, job: str) -> tuple[str, ...]:
        return self.ps if job == Role.PS else self.worker

    def tasks(self) -> list[TaskId]:
        """All tasks: parameter servers first, then workers."""
        return [
            TaskId(job=job, index=i) for job in JOBS for i in range(len(self._job_addresses(job)))
        ]

    def task(self, job: str, index: int) -> TaskId:
        """The task ``job:index``, checked against this cluster."""
        if job not in JOBS:
            raise ClusterSpecError(f"unknown job {str(job)!r}; allowed jobs are ps, worker")
        if isinstance(index, bool) or not isinstance(index, int):
            raise ClusterSpecError(
                f"task index {index!r} for job {str(job)!r} is not an integer; use --task 0..N-1"
            )
        count = len(self._job_addresses(job))
        if not 0 <= index < count:
            raise _range_error(job, index, count, prefix="task ", fix="--task ")
        return TaskId(job=Role(job), index=index)

    def address(self, task: TaskId) -> str:
        """The ``host:port`` of ``task``."""
        return self._job_addresses(self.task(task.job, task.index).job)[task.index]

    def with_address(self, task: TaskId, address: str) -> ClusterSpec:
        """A copy with the address of ``task`` replaced (e.g. once a port-0 server is bound)."""
        self.task(task.job, task.index)
        addresses = list(self._job_addresses(task.job))
        addresses[task.index] = address
        return dataclasses.replace(self, **{task.job: tuple(addresses)})

    # ------------------------------------------------------------------ serialisation

    def to_dict(self) -> dict[str, list[str]]:
        """``{"ps": [...], "worker": [...]}``; :meth:`from_dict` reads it back."""
        return {"ps": list(self.ps), "worker": list(self.worker)}

    def to_tf_config(self, task: TaskId) -> str:
        """JSON in ``TF_CONFIG`` format for ``task``; :func:`parse_tf_config` reads it back."""
        self.task(task.job, task.index)
        return json.dumps(
            {"cluster": self.to_dict(), "task": {"type": task.job, "index": task.index}}
        )

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_dict(cls, data: Mapping[str, object], *, source: str = "cluster") -> ClusterSpec:
        """Read ``{"ps": [...], "worker": [...]}`` or ``{"cluster": {...}, "task": ...}``.

        A TensorFlow ``chief`` job (exactly one address) becomes worker 0 and the ``worker``
        list follows it. ``source`` names the mapping in error messages.
        """
        return _parse_mapping(data, source=source).spec

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ClusterSpec:
        """Read a ``.toml`` or ``.json`` file in any format :meth:`from_dict` accepts.

        TOML may use a ``[cluster]`` table or put ``ps`` / ``worker`` at top level. A
        ``"task"`` entry (TF_CONFIG style) is ignored.
        """
        name = os.fspath(path)
        suffix = os.path.splitext(name)[1].lower()
        if suffix not in (".toml", ".json"):
            shown = repr(suffix) if suffix else "(no suffix)"
            raise ClusterSpecError(
                f"{name}: unknown cluster file type {shown}; use a .toml or .json file"
            )
        try:
            with open(name, encoding="utf-8", newline="") as fh:
                text = fh.read()
        except FileNotFoundError:
            raise ClusterSpecError(
                f"{name}: cluster file not found; check the path passed to --cluster"
            ) from None
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise ClusterSpecError(
                f"{name}: cannot read cluster file ({reason}); check the path and permissions"
            ) from None
        except UnicodeDecodeError:
            raise ClusterSpecError(
                f"{name}: cluster file is not UTF-8 text; save it as UTF-8"
            ) from None
        data = _load_toml(text, name) if suffix == ".toml" else _load_json(text, name)
        if not isinstance(data, Mapping):
            raise ClusterSpecError(
                f"{name}: expected an object with ps and worker lists, got {_type_name(data)}; "
                'e.g. {"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223"]}'
            )
        try:
            return cls.from_dict(data)
        except ClusterSpecError as exc:
            raise ClusterSpecError(f"{name}: {exc}") from None

    @classmethod
    def from_flags(cls, *, ps_hosts: str | None, worker_hosts: str | None) -> ClusterSpec:
        """Read TF1-style comma-separated ``--ps-hosts`` / ``--worker-hosts`` values."""
        ps = _split_hosts(ps_hosts)
        worker = _split_hosts(worker_hosts)
        _check_jobs(
            [("--ps-hosts", "ps", ps), ("--worker-hosts", "worker", worker)],
            no_worker=f"--worker-hosts: no worker task; {_FLAG_WORKER_HINT}",
        )
        return cls(ps=ps, worker=worker)

    @classmethod
    def local(cls, *, num_workers: int, num_ps: int, host: str = "127.0.0.1") -> ClusterSpec:
        """A single-host cluster whose ports are all 0 (picked when each server starts)."""
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ClusterSpecError(
                f"num_workers: got {num_workers!r}; a cluster needs at least 1 worker"
            )
        if isinstance(num_ps, bool) or not isinstance(num_ps, int) or num_ps < 0:
            raise ClusterSpecError(f"num_ps: got {num_ps!r}; use 0 or more parameter servers")
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        address = f"{host}:0"
        return cls(ps=(address,) * num_ps, worker=(address,) * num_workers)


# --------------------------------------------------------------------------- parsing helpers


def _split_hosts(value: str | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return tuple(item.strip() for item in value.split(",") if item.strip())


def _load_toml(text: str, name: str) -> object:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise ClusterSpecError(
            f"{name}: reading TOML needs Python 3.11+; use a .json cluster file instead"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ClusterSpecError(f"{name}: invalid TOML ({exc}); fix the syntax") from None


def _load_json(text: str, name: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ClusterSpecError(f"{name}: invalid JSON ({exc}); fix the syntax") from None


def _parse_mapping(data: object, *, source: str) -> _Parsed:
    """Read the job lists of a (possibly ``cluster``-wrapped) mapping."""
    if not isinstance(data, Mapping):
        raise ClusterSpecError(
            f"{source}: expected a mapping of job name to address list, got {_type_name(data)}"
        )
    if "cluster" in data:
        for key in data:
            if key != "cluster" and key not in _TF_CONFIG_EXTRA_KEYS:
                raise ClusterSpecError(
                    f"{source}: unexpected key {key!r} next to 'cluster'; "
                    "put the ps and worker lists inside cluster"
                )
        data = data["cluster"]
        if not isinstance(data, Mapping):
            raise ClusterSpecError(
                f"{source}: expected 'cluster' to map job names to address lists, "
                f"got {_type_name(data)}"
            )
    for key in data:
        if key not in (*JOBS, _CHIEF):
            raise ClusterSpecError(f"{source}: unknown job {key!r}; {_ALLOWED_JOBS_TEXT}")
    ps = _as_tuple(data.get("ps", ()), f"{source}.ps")
    worker = _as_tuple(data.get("worker", ()), f"{source}.worker")
    chief: tuple[str, ...] = ()
    if _CHIEF in data:
        chief = _as_tuple(data[_CHIEF], f"{source}.chief")
        if len(chief) != 1:
            raise ClusterSpecError(
                f"{source}.chief: expected exactly one address, got {len(chief)}; "
                "put the other tasks under worker"
            )
    _check_jobs(
        [
            (f"{source}.ps", "ps", ps),
            (f"{source}.chief", _CHIEF, chief),
            (f"{source}.worker", "worker", worker),
        ],
        no_worker=f"{source}.worker: no worker task; {_DICT_WORKER_HINT}",
    )
    spec = ClusterSpec(ps=ps, worker=chief + worker)
    return _Parsed(spec=spec, has_chief=bool(chief), tf_workers=len(worker))


def _parse_tf_task(task: object, parsed: _Parsed) -> TaskId:
    """Map a TF_CONFIG ``task`` entry onto a distsgd task (chief -> worker 0)."""
    if not isinstance(task, Mapping):
        raise ClusterSpecError(
            f'TF_CONFIG.task: expected an object like {{"type": "worker", "index": 0}}, '
            f"got {_type_name(task)}"
        )
    job = task.get("type")
    index = task.get("index", 0)
    allowed = "ps, worker or chief" if parsed.has_chief else "ps or worker"
    if job not in (*JOBS, _CHIEF):
        raise ClusterSpecError(f"TF_CONFIG.task.type: unknown type {job!r}; use {allowed}")
    if isinstance(index, bool) or not isinstance(index, int):
        raise ClusterSpecError(
            f"TF_CONFIG.task.index: expected an integer, got {_type_name(index)} {index!r}"
        )
    spec = parsed.spec
    if job == _CHIEF:
        count, offset = (1 if parsed.has_chief else 0), 0
    elif job == Role.WORKER:
        count, offset = (parsed.tf_workers, 1) if parsed.has_chief else (spec.num_workers, 0)
    else:
        count, offset = spec.num_ps, 0
    if not 0 <= index < count:
        raise _range_error(job, index, count, prefix="TF_CONFIG.task.index: ", fix="")
    return TaskId(job=Role.PS if job == Role.PS else Role.WORKER, index=index + offset)


def parse_tf_config(text: str) -> tuple[ClusterSpec, TaskId | None]:
    """Parse a ``TF_CONFIG`` JSON string into the cluster and this process's task.

    The task is ``None`` when TF_CONFIG has no ``"task"``. With a TensorFlow ``chief`` job,
    ``{"type": "chief", "index": 0}`` is worker 0 and ``{"type": "worker", "index": i}`` is
    worker ``i + 1``.
    """
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, TypeError) as exc:
        raise ClusterSpecError(
            f"TF_CONFIG: invalid JSON ({exc}); set it to "
            '{"cluster": {"worker": [...]}, "task": {"type": "worker", "index": 0}}'
        ) from None
    if not isinstance(data, Mapping) or "cluster" not in data:
        raise ClusterSpecError(
            'TF_CONFIG: expected a JSON object with a "cluster" entry; set it to '
            '{"cluster": {"worker": [...]}, "task": {"type": "worker", "index": 0}}'
        )
    for key in data:
        if key != "cluster" and key not in _TF_CONFIG_EXTRA_KEYS:
            raise ClusterSpecError(
                f"TF_CONFIG: unexpected key {key!r}; allowed keys are cluster, task, "
                "environment, rpc_layer"
            )
    parsed = _parse_mapping(data["cluster"], source="TF_CONFIG.cluster")
    task = data.get("task")
    if task is None or task == {}:
        return parsed.spec, None
    return parsed.spec, _parse_tf_task(task, parsed)
