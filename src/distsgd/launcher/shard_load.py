"""Each server's load over time: the launcher's Info polls (about once a second) turned into a
``shard_load`` metrics event per server every :data:`LOAD_EVERY` seconds, with the rates of the
interval: pushes and pulls per second, their MB/s, and ``busy``, the share of the interval its
pushes kept it working (check, write-ahead log, update; above 1 where an unlocked rule's pushes
overlap), and ``pull_busy``, the share its pulls kept it working before their bytes went out
(the straggler detector's sign of a slow server rather than a slow link: a push's busy time
includes its wait for the write-ahead log's replica, over the network). TensorBoard shows them
as ``load/psN/<field>`` on the launcher's run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from distsgd.transport.proto import distsgd_pb2 as pb

LOAD_EVERY = 5.0
"""Seconds between two ``shard_load`` events of one server."""
RATES = ("pushes_per_s", "pulls_per_s", "push_mb_per_s", "pull_mb_per_s", "busy", "pull_busy")
"""The numbers of a ``shard_load`` event besides ``ps`` and ``seconds``."""


class ShardLoadLog:
    """Turns successive ``InfoResponse.load`` counters into ``shard_load`` events."""

    def __init__(self, log: Callable[..., None], every: float = LOAD_EVERY) -> None:
        self._log = log
        self.every = every
        self._last: dict[int, tuple[float, pb.ShardLoad]] = {}

    def see(self, index: int, reply: pb.InfoResponse, now: float, step: int) -> None:
        """ps ``index`` answered ``reply`` at ``now`` (monotonic seconds)."""
        if not reply.HasField("load"):
            return  # a server that predates the field
        load = pb.ShardLoad()
        load.CopyFrom(reply.load)
        last = self._last.get(index)
        if last is None or load.pushes < last[1].pushes or load.pulls < last[1].pulls:
            self._last[index] = (now, load)  # the first reading, or a restarted server's
            return
        seconds = now - last[0]
        if seconds < self.every:
            return
        self._last[index] = (now, load)
        self._log(step=step, event="shard_load", ps=index, **rates(last[1], load, seconds))


def rates(before: pb.ShardLoad, after: pb.ShardLoad, seconds: float) -> dict[str, Any]:
    """The interval's rates between two readings ``seconds`` apart."""
    return {
        "seconds": round(seconds, 3),
        "pushes_per_s": round((after.pushes - before.pushes) / seconds, 3),
        "pulls_per_s": round((after.pulls - before.pulls) / seconds, 3),
        "push_mb_per_s": round((after.push_bytes - before.push_bytes) / seconds / 1e6, 3),
        "pull_mb_per_s": round((after.pull_bytes - before.pull_bytes) / seconds / 1e6, 3),
        "busy": round((after.busy_seconds - before.busy_seconds) / seconds, 4),
        "pull_busy": round((after.pull_busy_seconds - before.pull_busy_seconds) / seconds, 4),
    }
