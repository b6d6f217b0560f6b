"""``distsgd elastic join RUN_DIR``: one more worker for a running elastic run, in this process.

Everything the worker needs is in the run folder: ``config.json`` (script, scheme, options, the
run's id and size bounds), ``cluster.json`` (the servers' real addresses, written once they
listen) and ``secret`` (the run secret every request carries). On another machine a copy of
those three files serves, with the servers reachable from there.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distsgd import schemes
from distsgd.cluster import ClusterSpec, Role, TaskId
from distsgd.control.spec import RunSpec
from distsgd.control.task import TaskEnv
from distsgd.launcher.lifeline import alive
from distsgd.launcher.scale import launcher_alive
from distsgd.transport.client import ShardClient
from distsgd.transport.errors import Refusal, RemoteError

CLAIM_TIMEOUT = 30.0
"""Seconds ``distsgd elastic join`` waits for ps0 to answer its claim of an index."""


def _read_run_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from a run folder's file, or a one-line ValueError (no such run folder,
    a damaged file) that says ``what`` the file holds."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{path.parent} has no {path.name} ({what}); give the --run-dir of a running "
            "distsgd run or demo"
        ) from None
    except ValueError as exc:
        raise ValueError(f"{path}: damaged ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: damaged (not a JSON object)")
    return data


def _taken(run_dir: Path) -> set[int]:
    """Worker indexes whose process (as ``tasks.json`` lists them) is alive on this machine."""
    try:
        pids = json.loads((run_dir / "tasks.json").read_text())
    except (OSError, ValueError):
        return set()
    taken = set()
    for name, pid in dict(pids).items():
        try:
            task = TaskId.parse(name)
        except ValueError:
            continue
        if task.job == Role.WORKER and isinstance(pid, int) and alive(pid, others=True):
            taken.add(task.index)
    return taken


class IndexLease:
    """Takes a worker index at ps0 (a Join with ``claim``): granted only for an index never
    used in the run, so two joiners never run as one worker and a departed worker's index is
    not given out again (see "Membership" in the .proto)."""

    def __init__(self, cluster: dict[str, Any], run_id: str, secret: str | None) -> None:
        self.address = ClusterSpec.from_dict(cluster).address(TaskId(job=Role.PS, index=0))
        self.run_id = run_id
        self.secret = secret

    def __call__(self, index: int) -> bool:
        """Whether ps0 gave this process worker ``index``; ValueError (one line) if it could
        not be asked."""
        with ShardClient(
            self.address,
            worker=index,
            incarnation=secrets.randbits(63) | 1,
            run_id=self.run_id,
            timeout=CLAIM_TIMEOUT,
            retry_seconds=CLAIM_TIMEOUT,
            secret=self.secret,
        ) as ps0:
            try:
                ps0.join(claim=True)
            except RemoteError as exc:
                if exc.refusal is Refusal.TAKEN:
                    return False
                raise ValueError(f"could not take a worker index at ps0: {exc}") from None
        return True


def _lease(
    run_dir: Path, take: Callable[[int], bool], asked: int | None, candidates: list[int], high: int
) -> int:
    """The first of ``candidates`` that ``take`` grants; a one-line ValueError if none."""
    for index in candidates:
        if take(index):
            return index
    if asked is not None:
        raise ValueError(
            f"--task {asked}: worker{asked} of {run_dir} is or was in use (another joiner took "
            "it, or it ran and left); leave out --task to be given a free index"
        )
    raise ValueError(
        f"every worker index of {run_dir} (up to --max-workers {high}) is or was in use; "
        "start the run with a larger --max-workers"
    )


def join_env(
    run_dir: Path, task: int | None, *, claim: Callable[[int], bool] | None = None
) -> tuple[TaskEnv, str, list[str], Path]:
    """The task environment, script, script arguments and run secret file of a worker joining
    ``run_dir``; ValueError (one line, cause and fix) when the folder is not a running elastic
    parameter-server run or the index is taken or out of range. The index is taken at the
    servers (``claim``, default :class:`IndexLease`): ``task``, or without one the highest
    index never used."""
    spec = RunSpec.load(run_dir)
    cluster = _read_run_json(
        run_dir / "cluster.json", "the servers' addresses, written once they listen"
    )
    scheme = spec.scheme
    if not schemes.get(scheme).uses_parameter_servers:
        raise ValueError(
            f"{run_dir} runs {scheme}, a collective scheme: its process group has a fixed size; "
            "change its size with distsgd elastic scale (a restart from its last checkpoint)"
        )
    if not spec.dynamic_world_size:
        raise ValueError(
            f"{run_dir} was started with a fixed world size; only a run started with "
            "--world-size dynamic takes workers that join"
        )
    high = spec.highest_workers
    if task is None:
        free = [i for i in range(high - 1, 0, -1) if i not in _taken(run_dir)]
        if not free:
            raise ValueError(
                f"every worker index of {run_dir} (up to --max-workers {high}) is running; "
                "start the run with a larger --max-workers"
            )
    elif not 0 < task < high:
        raise ValueError(
            f"--task {task}: a joining worker needs an index in 1..{high - 1} (worker0 is the "
            f"chief; the run allows --max-workers {high})"
        )
    elif task in _taken(run_dir):
        raise ValueError(f"worker{task} of {run_dir} is running; choose another --task")
    if not launcher_alive(run_dir):
        raise ValueError(f"no launcher is running {run_dir} (it finished, or was stopped)")
    secret = run_dir / "secret"
    if not secret.is_file():
        raise ValueError(f"{run_dir} has no secret file; it cannot be joined")
    take = claim or IndexLease(cluster, spec.run_id, secret.read_text().strip() or None)
    task = _lease(run_dir, take, task, free if task is None else [task], high)
    env = TaskEnv(
        cluster=cluster,
        task_index=task,
        scheme=scheme,
        scheme_options=dict(spec.scheme_options),
        overrides=dict(spec.overrides),
        run_dir=str(run_dir.resolve()),
        run_id=spec.run_id,
        registered_workers=spec.workers,
    )
    return env, spec.script, list(spec.script_args), secret.resolve()
