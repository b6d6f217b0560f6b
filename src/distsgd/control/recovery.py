"""What to do when a task of a run dies: one pure decision, :func:`plan_restart`.

Its inputs are plain data: the failure (:class:`TaskFailure`), the run's shape
(:class:`RunTopology`), what the checkpoint store holds (a :class:`StoreView`) and the task's
restart budget (:class:`RestartBudget`). Its answer is one of :class:`Restart` (this task, from
its newest state), :class:`RestartAll` (every task, from the newest complete checkpoint),
:class:`Drop` (an elastic run goes on without the worker), :class:`Finished` (its training was
over: nothing to restart) or :class:`Stop` (the run fails).

Three places execute a plan: ``distsgd run``'s launcher (:mod:`distsgd.launcher.restart`), the
JobSet emulator (:mod:`distsgd_emulate.k8s_local`, pods restarted in place) and a restarted pod
choosing its own newest state (``distsgd worker --resume-latest`` and ``distsgd server
--restore-latest``).

The rules, in order:

0. Once the chief has recorded the run's result (``result.json``), training is over: a task
   that ends then is not restarted (a restart would train again and overwrite the record), and
   neither is a worker whose script failed after its own training finished (its error is the
   script's, not training's): :class:`Finished`; the run ends when the other workers do.
1. A worker that stopped on divergence, or on a setup error (a mistake in the script or its
   options), stops the run: a restart would do the same again.
2. A task that ran :attr:`RestartBudget.healthy_seconds` since its last start has a fresh
   budget (a new fault, not the same one again).
3. Out of restarts: an elastic parameter-server run drops a worker other than the chief while
   at least ``--min-workers`` remain; otherwise the run stops.
4. Otherwise, after a backoff of 0, 0.5, 1, 2, ... (at most 10) seconds:

   * tasks restarted in place (Kubernetes pods) each continue from their own newest file;
   * a ps continues from its write-ahead log or its newest shard file (the server takes the
     newer); with neither, the whole cluster restarts from the last complete checkpoint;
   * a worker of a collective run restarts every worker (a process group has a fixed size);
   * a worker of a parameter-server run continues from its newest state (when the run
     checkpoints), at the step its metrics last reported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from distsgd.cluster import Role, TaskId
from distsgd.control.checkpoint.store import Checkpoint, ShardRef, WorkerStateRef
from distsgd.control.divergence import DIVERGED_EXIT_CODE
from distsgd.control.errors import AFTER_TRAINING_EXIT_CODE, SETUP_EXIT_CODE

FailureKind = Literal["crash", "killed", "setup_error", "diverged", "after_training"]
"""How a task ended: an exit code of its own, a signal, or one of the three codes a worker uses
to say a restart would not help."""

MAX_BACKOFF = 10.0
"""Seconds, at most, before a restart."""


@dataclass(frozen=True, kw_only=True)
class TaskFailure:
    """A task that exited when it should not have."""

    task: TaskId
    """Which task."""
    exit_code: int | None
    """Its exit code (negative: the signal that ended it; None: unknown, as for a pod that
    Kubernetes restarted)."""
    kind: FailureKind = "crash"
    """What the exit code means (:func:`failure_kind`)."""
    reached: int = 0
    """The local step its last metrics line reported (a restarted worker continues there)."""
    furthest: int = 0
    """The highest local step any worker reported (what a whole restart loses down to the
    checkpoint)."""


CAUSE_ORDER: tuple[FailureKind, ...] = (
    "diverged",
    "setup_error",
    "killed",
    "crash",
    "after_training",
)
"""Kinds of ending, the most telling first: when tasks end together, the first kind in this
order names the cause (a worker that diverged or was killed breaks its peers' all-reduce,
and they then exit with an error of their own)."""

PEER_SETTLE = 2.0
"""Seconds a launcher waits, after a worker of a collective run crashed, for a peer to show a
more telling end (the all-reduce fails on every worker when one dies, and the dead one's exit
code may be reported after its peers')."""


def first_cause(ended: Mapping[str, int | None]) -> str:
    """Of the tasks in ``ended`` (name -> exit code) that ended together, the one whose end
    most likely caused the others': the first kind of :data:`CAUSE_ORDER`, then the first
    task in role-and-index order."""
    if not ended:
        raise ValueError("no task ended")

    def rank(name: str) -> tuple[int, str, int]:
        task = TaskId.parse(name)
        return CAUSE_ORDER.index(failure_kind(ended[name])), task.job.value, task.index

    return min(ended, key=rank)


def may_follow_a_peer(failure: FailureKind, run: RunTopology) -> bool:
    """Whether a worker's ``failure`` may be the echo of a peer's: a crash in a collective run,
    where one worker's death fails every worker's all-reduce (wait :data:`PEER_SETTLE` for the
    cause before planning)."""
    return run.collective and failure == "crash"


def failure_kind(exit_code: int | None) -> FailureKind:
    """What ``exit_code`` says about how a task of ``distsgd run`` ended."""
    if exit_code == DIVERGED_EXIT_CODE:
        return "diverged"
    if exit_code == SETUP_EXIT_CODE:
        return "setup_error"
    if exit_code == AFTER_TRAINING_EXIT_CODE:
        return "after_training"
    if exit_code is not None and exit_code < 0:
        return "killed"
    return "crash"


@dataclass(frozen=True, kw_only=True)
class RunTopology:
    """The shape of the run a task belongs to."""

    collective: bool
    """Workers all-reduce among themselves (no parameter servers)."""
    workers: int
    """Workers taking part now."""
    min_workers: int
    """The fewest workers the run may go on with (``--min-workers``)."""
    elastic: bool = False
    """The run may change size (``--min-workers`` or ``--max-workers`` was given)."""
    checkpointing: bool = True
    """Workers save their state (``--checkpoint-every``): a worker has one to resume from."""
    in_place: bool = False
    """Each task is restarted where it ran and finds its own newest file (Kubernetes pods);
    nothing restarts the whole cluster or drops a worker."""
    result_recorded: bool = False
    """The chief has written the run's ``result.json``: its training is over."""


class StoreView(Protocol):
    """What the planner asks of the checkpoint store (each asked only when a rule needs it)."""

    def latest(self) -> Checkpoint | None:
        """The newest complete checkpoint."""

    def newest_worker(self, index: int) -> WorkerStateRef | None:
        """Worker ``index``'s newest usable state."""

    def newest_shard(self, index: int) -> ShardRef | None:
        """Shard ``index``'s newest intact file."""

    def has_wal(self, index: int) -> bool:
        """Whether ps ``index`` left a write-ahead log it can come back from."""


@dataclass(frozen=True, kw_only=True)
class RestartBudget:
    """How many times a task may still be restarted."""

    used: int
    """Restarts in a row so far."""
    max_restarts: int
    """Restarts allowed in a row (``--max-restarts``)."""
    ran_seconds: float = 0.0
    """Seconds the task ran since its last start."""
    healthy_seconds: float = float("inf")
    """A task that ran this long had no fault in a row: its count starts again."""

    @property
    def in_a_row(self) -> int:
        """Restarts in a row, counting this failure's context (0 after a healthy run)."""
        return 0 if self.ran_seconds >= self.healthy_seconds else self.used


@dataclass(frozen=True, kw_only=True)
class Restart:
    """Start the task again, alone."""

    task: TaskId
    """Which task."""
    resume: WorkerStateRef | ShardRef | None
    """Its state to continue from (None: a worker from the start; a ps from its log alone; a
    pod restarted in place finds its own)."""
    continue_at: int = 0
    """(A worker) the local step to continue at when that is past its state's."""
    attempt: int = 1
    """This restart's number in a row."""
    backoff: float = 0.0
    """Seconds to wait first."""


@dataclass(frozen=True, kw_only=True)
class RestartAll:
    """Stop every task and start the whole cluster from a checkpoint."""

    checkpoint: Checkpoint | None
    """The newest complete checkpoint (None: from the start)."""
    lost_steps: int
    """Local steps of the furthest worker that are done again."""
    why: str
    """Why one task's restart is not enough, in words."""
    attempt: int = 1
    """This restart's number in a row."""
    backoff: float = 0.0
    """Seconds to wait first."""


@dataclass(frozen=True, kw_only=True)
class Drop:
    """Go on without the worker (an elastic parameter-server run)."""

    task: TaskId
    """The worker left out."""
    workers: int
    """Workers taking part after it."""


@dataclass(frozen=True, kw_only=True)
class Finished:
    """The task's training was over: not restarted, and the run ends when the other workers
    do (failing then with the script's error when ``after_training``)."""

    task: TaskId
    """The task that ended."""
    after_training: bool
    """Its script failed after its training finished (else: it ended after the run's result
    was recorded)."""


@dataclass(frozen=True, kw_only=True)
class Stop:
    """The run fails."""

    reason: Literal["diverged", "setup_error", "out_of_restarts"]
    """Why."""
    used: int = 0
    """(out_of_restarts) the restarts used in a row."""
    resumable: bool = False
    """(out_of_restarts) a complete checkpoint exists: ``distsgd run --resume`` can go on."""


RestartPlan = Restart | RestartAll | Drop | Finished | Stop


def backoff(used: int) -> float:
    """Seconds before restart number ``used + 1``: none for the first, then 0.5, 1, 2, ..."""
    return 0.0 if used == 0 else min(0.5 * 2 ** (used - 1), MAX_BACKOFF)


def restart_all(
    store: StoreView, why: str, *, furthest: int, attempt: int = 1, wait: float = 0.0
) -> RestartAll:
    """A whole restart from the newest complete checkpoint, losing the steps ``furthest`` (the
    furthest worker's local step) is past it."""
    checkpoint = store.latest()
    at = 0 if checkpoint is None else checkpoint.step
    return RestartAll(
        checkpoint=checkpoint,
        lost_steps=max(0, furthest - at),
        why=why,
        attempt=attempt,
        backoff=wait,
    )


def _can_drop(task: TaskId, run: RunTopology) -> bool:
    return (
        run.elastic
        and not run.collective
        and not run.in_place
        and task.job == Role.WORKER
        and task.index != 0
        and run.workers - 1 >= run.min_workers
    )


def plan_restart(
    failure: TaskFailure, run: RunTopology, store: StoreView, budget: RestartBudget
) -> RestartPlan:
    """What to do about ``failure`` (the rules are in this module's docstring)."""
    task = failure.task
    after_training = task.job == Role.WORKER and failure.kind == "after_training"
    if after_training or run.result_recorded:
        return Finished(task=task, after_training=after_training)
    if task.job == Role.WORKER and failure.kind in ("diverged", "setup_error"):
        return Stop(reason="diverged" if failure.kind == "diverged" else "setup_error")
    used = budget.in_a_row
    if used >= budget.max_restarts:
        if _can_drop(task, run):
            return Drop(task=task, workers=run.workers - 1)
        resumable = not run.in_place and store.latest() is not None
        return Stop(reason="out_of_restarts", used=used, resumable=resumable)
    attempt, wait = used + 1, backoff(used)
    if run.in_place:
        own = _own_newest(task, run, store)
        return Restart(task=task, resume=own, attempt=attempt, backoff=wait)
    if task.job == Role.PS:
        shard = store.newest_shard(task.index)
        if shard is None and not store.has_wal(task.index):
            why = "no checkpoint to restore the shard from"
            return restart_all(store, why, furthest=failure.furthest, attempt=attempt, wait=wait)
        return Restart(task=task, resume=shard, attempt=attempt, backoff=wait)
    if run.collective:
        why = "collective schemes restart every worker"
        return restart_all(store, why, furthest=failure.furthest, attempt=attempt, wait=wait)
    state = _own_newest(task, run, store)
    return Restart(
        task=task, resume=state, continue_at=failure.reached, attempt=attempt, backoff=wait
    )


def _own_newest(
    task: TaskId, run: RunTopology, store: StoreView
) -> WorkerStateRef | ShardRef | None:
    if task.job == Role.PS:
        return store.newest_shard(task.index)
    return store.newest_worker(task.index) if run.checkpointing else None


def resume_point(task: TaskId, store: StoreView, *, checkpointing: bool = True) -> Restart:
    """Where a task that was restarted in place continues (a pod choosing its newest file):
    the plan for a restart in place with budget left."""
    plan = plan_restart(
        TaskFailure(task=task, exit_code=None),
        RunTopology(
            collective=False, workers=1, min_workers=1, checkpointing=checkpointing, in_place=True
        ),
        store,
        RestartBudget(used=0, max_restarts=1),
    )
    assert isinstance(plan, Restart)
    return plan


class NothingStored:
    """A :class:`StoreView` with nothing in it: for a caller whose tasks each find their own
    files when they start again (the JobSet emulator's pods)."""

    def latest(self) -> Checkpoint | None:
        return None

    def newest_worker(self, index: int) -> WorkerStateRef | None:
        return None

    def newest_shard(self, index: int) -> ShardRef | None:
        return None

    def has_wal(self, index: int) -> bool:
        return False
