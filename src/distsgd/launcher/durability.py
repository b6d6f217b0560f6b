"""What the launcher says about the parameter servers' durability: a write-ahead log that went
down (its disk full) and came back, and updates a restarted server lost.

The launcher reads each server's ``Info`` about once a second; its ``wal`` (``WalStatus``) says
whether the log is down. :class:`DurabilityWatch` turns the changes into console lines as they
happen, ``durability_lost`` / ``durability_regained`` events in ``metrics.jsonl``, and
``result.json``'s ``durability``; a log down longer than :data:`GIVE_UP_SECONDS` stops the run
in one line that names the folder and the command that resumes it. While a log is down its
server applies no push (each waits, or is refused and sent again), so stopping loses nothing
acknowledged.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distsgd.launcher.errors import RunFailed
from distsgd.transport.proto import distsgd_pb2 as pb

DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
"""The errors of a write that found no room: the disk is full, or the user's quota."""

GIVE_UP_SECONDS = 120.0
"""A log down this long stops the run (as a task that makes no progress for 120 s does)."""


@dataclass
class _Server:
    incarnation: int = 0
    outages: int = 0
    """Outages of this incarnation already reported."""
    down: bool = False
    seconds: float = 0.0
    """Seconds down of this incarnation, as last read."""


class DurabilityWatch:
    """The servers' write-ahead logs as their ``Info`` says (see the module's docstring)."""

    def __init__(
        self,
        *,
        note: Callable[[str], None],
        event: Callable[..., None],
        run_dir: Path,
        give_up: float = GIVE_UP_SECONDS,
    ) -> None:
        self._note = note
        self._event = event
        self._run_dir = run_dir
        self._give_up = give_up
        self._servers: dict[int, _Server] = {}
        self._totals: dict[int, dict[str, Any]] = {}

    def see(self, index: int, reply: pb.InfoResponse, step: int) -> None:
        """ps ``index`` answered ``reply`` at global step ``step``."""
        if not reply.HasField("wal"):
            return
        wal = reply.wal
        server = self._servers.get(index)
        if server is None or server.incarnation != reply.server_incarnation:
            was_down = server is not None and server.down  # a restart while down: back?
            server = _Server(incarnation=reply.server_incarnation, down=was_down)
            self._servers[index] = server
        total = self._total(index)
        new = wal.outages - server.outages  # outages begun since the last read
        if server.down and (new > 0 or not wal.down):
            self._regained(index, wal, step)
        if new > 0:
            self._lost(index, wal, step)
            if not wal.down:  # down and back between two reads
                self._regained(index, wal, step)
        total["outages"] += max(0, new)
        total["seconds"] += max(0.0, wal.down_seconds - server.seconds)
        total["refused_pushes"] = max(total["refused_pushes"], wal.refused_pushes)
        total["unlogged"] = max(total["unlogged"], wal.unlogged)
        server.outages, server.down = wal.outages, wal.down
        server.seconds = wal.down_seconds
        if wal.down and wal.down_seconds >= self._give_up:
            raise RunFailed(
                f"ps{index} could not write its write-ahead log in {wal.folder} for "
                f"{wal.down_seconds:.0f}s ({wal.error}); no update it acknowledged is lost: "
                f"{_fix(wal)}, then resume with: distsgd run --resume {self._run_dir}",
                reason=f"ps{index}: write-ahead log unwritable ({wal.error})",
            )

    def _lost(self, index: int, wal: pb.WalStatus, step: int) -> None:
        self._note(
            f"[distsgd] ps{index}: durability lost: its write-ahead log in {wal.folder} cannot "
            f"be written ({wal.error}); its pushes wait, unapplied, until it can ({_fix(wal)})"
        )
        self._event(
            step=step,
            event="durability_lost",
            target=f"ps{index}",
            error=wal.error,
            folder=wal.folder,
        )

    def _regained(self, index: int, wal: pb.WalStatus, step: int) -> None:
        self._note(
            f"[distsgd] ps{index}: durability regained: its write-ahead log is written again "
            f"(generation {wal.generation}, after {wal.down_seconds:.1f}s down in all)"
        )
        self._event(
            step=step,
            event="durability_regained",
            target=f"ps{index}",
            generation=wal.generation,
            down_seconds=round(wal.down_seconds, 3),
        )

    def lost_updates(self, index: int, lost: int) -> None:
        """A restarted ps ``index`` came back ``lost`` updates behind the dead one."""
        if lost <= 0:
            return
        total = self._total(index)
        total["lost"] += lost
        self._note(
            f"[distsgd] ps{index} came back {lost} updates behind the version last read from "
            "it: those updates are lost (see the fault record in metrics.jsonl)"
        )

    def _total(self, index: int) -> dict[str, Any]:
        empty = {"outages": 0, "seconds": 0.0, "refused_pushes": 0, "unlogged": 0, "lost": 0}
        return self._totals.setdefault(index, empty)

    def summary(self) -> dict[str, Any] | None:
        """``result.json``'s ``durability``: per server that had an outage or lost updates,
        its outages, seconds down, pushes refused (sent again), changes applied unlogged, and
        updates lost at a restart; None when there was nothing to say."""
        out = {
            f"ps{index}": {
                "outages": t["outages"],
                "down_seconds": round(t["seconds"], 3),
                "refused_pushes": t["refused_pushes"],
                "unlogged": t["unlogged"],
                "lost_updates": t["lost"],
            }
            for index, t in sorted(self._totals.items())
            if t["outages"] or t["lost"]
        }
        return out or None


def disk_full(exc: OSError) -> bool:
    """Whether ``exc`` is a write that found no room (:data:`DISK_FULL`)."""
    return exc.errno in DISK_FULL


def disk_full_line(run_dir: Path, exc: OSError, *, resumable: bool) -> str:
    """One line for a run that stopped because a write of the launcher found no room."""
    where = f" writing {exc.filename}" if exc.filename else ""
    resume = f", then resume with: distsgd run --resume {run_dir}" if resumable else ""
    return (
        f"the disk that holds {run_dir} is full ({exc.strerror}{where}): free space on it{resume}"
    )


def _fix(wal: pb.WalStatus) -> str:
    """What brings a down log back: its replica answering again, or room on its disk."""
    if wal.replica:
        return "its replica on another host must answer again; the launcher restarts it"
    return "free space on that disk"
