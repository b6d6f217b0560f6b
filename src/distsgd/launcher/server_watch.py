"""What a local run's launcher reads from, and tells, its parameter servers
(:class:`ServerWatch`): each one's version about once a second (what a dead one had applied at
least), its load, its write-ahead log's health, ``--rebalance auto``'s moves, and the workers
that finished, told to a restored shard; a collaborator of
:class:`~distsgd.launcher.run.LocalRun`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distsgd.cluster import Role, TaskId
from distsgd.launcher.durability import DurabilityWatch
from distsgd.launcher.emulated import Hosts
from distsgd.launcher.run_state import RunState
from distsgd.launcher.servers import read_info, tell_finished
from distsgd.launcher.shard_load import ShardLoadLog
from distsgd.ps.sequence import steps_applied
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.util.optional import installed

if TYPE_CHECKING:
    from distsgd_rebalance import Rebalancer


class ServerWatch:
    """The parameter servers of one local run, as the launcher reads them."""

    def __init__(self, state: RunState, hosts: Hosts, address_of: Callable[[int], str]) -> None:
        self.state = state
        self.hosts = hosts
        self.address_of = address_of
        """ps I's address as the launcher knows it now."""
        self.seen_versions: dict[int, int] = {}
        """Each server's version as the launcher last read it (Info, about once a second and
        just before an injected kill): what a dead one had applied at least."""
        self._next_poll = 0.0
        self.shard_loads = ShardLoadLog(state.events.log)
        """Each server's load over time, from the Info polls (``shard_load`` events)."""
        self.durability = DurabilityWatch(
            note=state.console.note, event=state.events.log, run_dir=state.run_dir
        )
        """Each server's write-ahead log as the Info polls find it (launcher/durability.py)."""
        self.rebalancer = self._rebalancer()
        """``--rebalance auto``: moves pieces between servers (:mod:`distsgd_rebalance`)."""

    def _rebalancer(self) -> Rebalancer | None:
        """``--rebalance auto``'s mover (None: off), from the package outside the core."""
        state = self.state
        if state.config.rebalance != "auto":
            return None
        with installed("distsgd_rebalance", "--rebalance auto"):
            from distsgd_rebalance import Rebalancer

        return Rebalancer(
            num_ps=state.config.num_ps,
            address_of=self.address_of,
            event=state.events.log,
            note=state.console.note,
            **self._auth,
        )

    @property
    def _auth(self) -> dict[str, Any]:
        """The run id, secret and TLS of every call to a server."""
        state = self.state
        return {"run_id": state.run_id, "secret": state.secret, "tls": state.config.hosting.tls}

    def poll(self) -> None:
        """About once a second: each live server's version (see :attr:`seen_versions`)."""
        if self.state.config.collective or time.monotonic() < self._next_poll:
            return
        self._next_poll = time.monotonic() + 1.0
        for index in range(self.state.config.num_ps):
            if self.hosts.cut_off(TaskId(job=Role.PS, index=index)):
                continue  # its host is cut off (partition:): it would keep us waiting 2 s
            self.read_version(index)
        if self.rebalancer is not None:
            self.rebalancer.poll(time.monotonic(), self.state.progress.step)

    def read_version(self, index: int) -> pb.InfoResponse | None:
        """ps ``index``'s Info (None if it does not answer at once), its version remembered."""
        state = self.state
        task = state.supervisor.tasks.get(f"ps{index}")
        if task is None or task.poll() is not None:
            return None
        reply = read_info(self.address_of(index), **self._auth)
        if reply is not None and reply.registered:
            self.seen_versions[index] = max(self.seen_versions.get(index, 0), reply.version)
            self.shard_loads.see(index, reply, time.monotonic(), state.progress.step)
            self.durability.see(index, reply, state.progress.step)
            if self.rebalancer is not None:
                self.rebalancer.see(index, reply)
        return reply

    def tell_finished(self, index: int, finished: list[int]) -> None:
        """A restored shard remembers the workers that had left when its file was saved; tell
        it about those that have finished since (their processes are gone and cannot): the
        ones done now, and each one that exits later (it may have left the dead process just
        before the kill, or the restored one while the launcher was restarting it)."""
        for worker, exc in tell_finished(self.address_of(index), finished, **self._auth):
            self.state.console.note(
                f"[distsgd] could not tell ps{index} that worker{worker} left: {exc}"
            )

    def steps_applied(self, worker: int) -> int:
        """The steps of ``worker`` whose pushes every server applied (what the worker reads
        as it starts again, :meth:`ParameterClient.steps_applied`); 0 for a collective run
        or where a server does not answer (the metrics line's step stands then)."""
        state = self.state
        if state.config.collective or state.config.num_ps == 0:
            return 0
        applied = []
        for index in range(state.config.num_ps):
            reply = read_info(self.address_of(index), worker=worker, **self._auth)
            if reply is None or not reply.registered:
                return 0
            applied.append(steps_applied(reply.applied_sequence))
        return min(applied)

    def rebalance_summary(self) -> dict[str, Any] | None:
        """(``--rebalance auto``) the moves made and each piece's updates over the run
        (:meth:`distsgd_rebalance.Rebalancer.result`); None where it is off."""
        if self.rebalancer is None:
            return None
        return self.rebalancer.result(self.read_version)
