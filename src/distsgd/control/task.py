"""Who this process is in the cluster, handed over by the launcher in ``DISTSGD_TASK``.

A user script run by ``distsgd run`` or ``distsgd worker`` finds a JSON :class:`TaskEnv` in the
``DISTSGD_TASK`` environment variable. A script run plainly (``python train.py``) finds none and
trains alone in one process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distsgd.cluster import ClusterSpec, Role, TaskId
from distsgd.control.faults import Fault
from distsgd.control.folder import RunFiles
from distsgd.transport.security import TlsConfig

ENV_VAR = "DISTSGD_TASK"


@dataclass(frozen=True, kw_only=True)
class TaskInfo:
    """Who this process is in the run, as a user script asks (``distsgd.task()``)."""

    rank: int
    """This worker's index: 0 is the chief (it evaluates and writes the result)."""
    num_workers: int
    """The workers the run was started with (an elastic run's live number moves; see
    docs/elastic.md). 1 when the script runs alone."""
    scheme: str
    """The training scheme's name (``allreduce`` when the script runs alone)."""
    run_dir: Path | None
    """The run folder (metrics, results, checkpoints), or None when the script runs alone."""
    standalone: bool
    """True when the script runs alone (``python script.py``), not as a task of a run."""

    @property
    def is_chief(self) -> bool:
        """Whether this is worker 0: the one that evaluates, and should print or save once."""
        return self.rank == 0


@dataclass(frozen=True, kw_only=True)
class TaskEnv:
    """Everything a worker process needs besides the user's model and data."""

    cluster: dict[str, list[str]] = field(metadata={"help": "the cluster spec as a dict"})
    task_index: int = field(metadata={"help": "this worker's index (0 = chief)"})
    scheme: str = field(metadata={"help": "scheme name"})
    scheme_options: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "scheme options"}
    )
    overrides: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "TrainConfig overrides"}
    )
    run_dir: str = field(default="", metadata={"help": "run folder for metrics and results"})
    standalone_run: bool = field(
        default=False,
        metadata={"help": "a script run alone (python script.py): it shows its own progress"},
    )
    run_id: str = field(default="", metadata={"help": "identifies the run to the servers"})
    rendezvous: str = field(
        default="",
        metadata={"help": "host:port of the torch.distributed store ('' = chief's address)"},
    )
    rpc_timeout: float = field(default=30.0, metadata={"help": "deadline of one RPC, seconds"})
    startup_timeout: float = field(
        default=300.0,
        metadata={
            "help": "how long start-up may wait for other tasks (server addresses, the "
            "chief's registration, the process group), seconds"
        },
    )
    wait_timeout: float = field(
        default=120.0,
        metadata={
            "help": "once training runs, how long to wait for a peer that makes no progress "
            "(retries of a failed call, the last workers to finish), seconds"
        },
    )
    checkpoint_every: int = field(
        default=0, metadata={"help": "checkpoint every N local steps (0 = off)"}
    )
    checkpoint_seconds: float = field(
        default=0.0, metadata={"help": "checkpoint every N seconds (0 = off)"}
    )
    resume: str = field(
        default="", metadata={"help": "worker state file to continue from ('' = fresh)"}
    )
    continue_at: int = field(
        default=0,
        metadata={
            "help": "(a restarted worker of a parameter-server scheme) continue at this local "
            "step, past its saved state: the steps in between reached the servers already"
        },
    )
    faults: tuple[Fault, ...] = field(
        default=(), metadata={"help": "faults this task injects into itself (delays, partitions)"}
    )
    tls: TlsConfig | None = field(
        default=None, metadata={"help": "mutual TLS with the servers (None = plaintext)"}
    )
    ps_address_files: list[str] = field(
        default_factory=list,
        metadata={
            "help": "per ps task, the file its server writes the address it bound to; a ps "
            "address with port 0 is read from it (workers start while the servers do)"
        },
    )

    control: str = field(
        default="",
        metadata={
            "help": "host:port of the launcher's run control: the run folder's files (metrics, "
            "result, the servers' addresses) go there over the network instead of on this "
            "disk ('' = on this disk, in run_dir)"
        },
    )

    ps_link_delays: list[list[float]] = field(
        default_factory=list,
        metadata={
            "help": "per ps task, [round trip, jitter] in seconds that each call to it waits: "
            "the emulated links' delay (--hosts with --link RATE,DELAY[,JITTER]), added in "
            "user space; [] = none"
        },
    )

    registered_workers: int = field(
        default=0,
        metadata={
            "help": "how many workers the chief registers the run with (0 = every worker of "
            "the cluster); an elastic run's cluster lists --max-workers workers, of which "
            "this many start"
        },
    )

    rollbacks_left: int = field(
        default=0,
        metadata={
            "help": "rollbacks the launcher may still take (control/rollback.py): while any "
            "are left a loss spike ends this worker so that the run is rolled back; 0 = a "
            "spike is judged at the end, as alone"
        },
    )

    reshard: bool = field(
        default=False,
        metadata={
            "help": "resume from a state another worker saved at another world size (a "
            "collective run restarted at a new size): its model, optimizer and scheme state, "
            "at the same fraction of the run, the data resharded"
        },
    )

    def __post_init__(self) -> None:
        spec = self.spec
        spec.task(Role.WORKER, self.task_index)
        if not 0 <= self.registered_workers <= spec.num_workers:
            raise ValueError(
                f"registered_workers must be in 0..{spec.num_workers} (the cluster's workers), "
                f"got {self.registered_workers}"
            )
        for name in ("continue_at", "rollbacks_left"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)}")
        for pair in self.ps_link_delays:
            if not (
                isinstance(pair, (list, tuple))
                and len(pair) == 2
                and all(isinstance(x, (int, float)) and 0 <= x <= 60 for x in pair)
            ):
                raise ValueError(f"ps_link_delays: each must be [round trip, jitter], got {pair!r}")
        if min(self.rpc_timeout, self.startup_timeout, self.wait_timeout) <= 0:
            raise ValueError("rpc_timeout, startup_timeout and wait_timeout must be positive")

    @property
    def spec(self) -> ClusterSpec:
        return ClusterSpec.from_dict(self.cluster)

    @property
    def num_workers(self) -> int:
        """The workers the run is registered with (the fixed world size)."""
        return self.registered_workers or self.spec.num_workers

    def info(self, *, standalone: bool = False) -> TaskInfo:
        """What :func:`distsgd.task` tells a script about this task."""
        return TaskInfo(
            rank=self.task_index,
            num_workers=self.num_workers,
            scheme=self.scheme,
            run_dir=Path(self.run_dir) if self.run_dir else None,
            standalone=standalone,
        )

    @property
    def task(self) -> TaskId:
        return TaskId(job=Role.WORKER, index=self.task_index)

    def with_ps_addresses(
        self, timeout: float, poll: float = 0.02, files: RunFiles | None = None
    ) -> TaskEnv:
        """A copy whose ps addresses with port 0 are those the servers reported, waiting up
        to ``timeout`` seconds for them: through the run control (``files``, when this task
        has one), else in ``ps_address_files``; TimeoutError names the server."""
        ps = list(self.cluster.get("ps", []))
        remote = files is not None and bool(self.control)
        pending = [
            i
            for i, a in enumerate(ps)
            if a.endswith(":0") and (remote or i < len(self.ps_address_files))
        ]
        if not pending:
            return self
        deadline = time.monotonic() + timeout
        for i in pending:
            where = "the run control" if remote else self.ps_address_files[i]
            while not (text := self._reported(i, files if remote else None)):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"ps{i} did not report its address in {where} within {timeout:.0f}s; "
                        "see its log"
                    )
                time.sleep(max(poll, 0.1) if remote else poll)
            ps[i] = text
        return dataclasses.replace(self, cluster={**self.cluster, "ps": ps})

    def _reported(self, index: int, files: RunFiles | None) -> str:
        """ps ``index``'s reported address ("" = none yet)."""
        if files is not None:
            data = files.get(f"ps{index}.address")
            return "" if data is None else data.decode(errors="replace").strip()
        path = Path(self.ps_address_files[index])
        return path.read_text().strip() if path.is_file() else ""

    def to_json(self) -> str:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["faults"] = [dataclasses.asdict(fault) for fault in self.faults]
        tls = self.tls
        data["tls"] = None if tls is None else [str(tls.cert), str(tls.key), str(tls.ca)]
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> TaskEnv:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"{ENV_VAR} must hold a JSON object")
        faults = data.get("faults") or []
        tls = data.get("tls")
        if not (isinstance(faults, list) and all(isinstance(f, dict) for f in faults)):
            raise ValueError(f"{ENV_VAR}: faults must be a list of objects, got {faults!r}")
        if tls and not (isinstance(tls, list) and len(tls) == 3):
            raise ValueError(f"{ENV_VAR}: tls must be [cert, key, ca] or null, got {tls!r}")
        data["faults"] = tuple(Fault(**f) for f in faults)
        data["tls"] = TlsConfig(cert=tls[0], key=tls[1], ca=tls[2]) if tls else None
        return cls(**data)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> TaskEnv | None:
        text = (os.environ if environ is None else environ).get(ENV_VAR)
        return None if not text else cls.from_json(text)

    @classmethod
    def standalone(cls, scheme: str = "allreduce") -> TaskEnv:
        """One worker, no parameter server: a plain single-process run."""
        return cls(
            cluster={"ps": [], "worker": ["127.0.0.1:0"]},
            task_index=0,
            scheme=scheme,
            standalone_run=True,
        )
