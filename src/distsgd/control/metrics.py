"""``metrics.jsonl``: one JSON object per line, appended by every task of a run.

Every record also goes to the task's TensorBoard run (:mod:`distsgd.control.board`) where
tensorboard is installed: one funnel, so both always hold the same records.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distsgd.control.board import BoardWriter, open_board
from distsgd.control.folder import METRICS_FILE, RunFiles
from distsgd.util import open_private

log = logging.getLogger(__name__)


class MetricsWriter:
    """Appends lines with ``time`` and ``task``; each line is one ``write`` on an O_APPEND file,
    so lines from concurrent tasks never interleave. A writer with no path drops everything.

    Each line is then written to ``tensorboard/<task>/`` beside the file (see
    :mod:`distsgd.control.board`); a failure there is logged once and ends the TensorBoard
    events of this writer, never its lines. ``clock`` gives the time of a line (tests).

    A line the disk has no room for (ENOSPC, EDQUOT) is dropped with one warning per outage
    and counted (:attr:`dropped`), never raised: a full disk must not end the run (a line cut
    short is ended before the next one, so every later line parses)."""

    def __init__(
        self,
        path: Path | None,
        task: str,
        *,
        clock: Callable[[], float] = time.time,
        remote: RunFiles | None = None,
    ) -> None:
        """``remote``: a task whose run folder is the launcher's over the network sends its
        lines there (``path`` unused; the launcher writes their TensorBoard events)."""
        self.task = task
        self._clock = clock
        self._remote = remote
        if remote is not None:
            path = None
        self._fd = None if path is None else open_private(path, os.O_WRONLY | os.O_APPEND)
        self.board: BoardWriter | None = None if path is None else open_board(path.parent, task)
        """The TensorBoard writer of this task (None: no events are written)."""
        self.dropped = 0
        """Lines dropped because the disk was full."""
        self._torn = self._dropping = False

    def log(self, **fields: Any) -> None:
        if self._fd is None and self._remote is None:
            return
        now = self._clock()
        record = {"time": round(now, 3), "task": self.task, **fields}
        line = (json.dumps(record) + "\n").encode()
        if self._remote is not None:
            self._remote.append(METRICS_FILE, line)  # buffered: sent by a thread of its own
            return
        self._append(line)
        board = self.board
        if board is not None:
            try:
                board.write(record, now)
            except Exception as exc:  # a view of the metrics: it never stops the run
                log.warning(
                    "%s: no more TensorBoard events (%s: %s)", self.task, type(exc).__name__, exc
                )
                self.board = None
                board.close()

    def _append(self, line: bytes) -> None:
        """One ``write`` of ``line``; a full disk drops it (see the class's docstring)."""
        assert self._fd is not None
        data = (b"\n" if self._torn else b"") + line
        try:
            written = os.write(self._fd, data)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            written = 0
        if written == len(data):
            if self._dropping:
                log.warning("%s: metrics lines written again (%d dropped)", self.task, self.dropped)
            self._torn = self._dropping = False
            return
        if not self._dropping:
            log.warning("%s: metrics lines dropped: the disk is full", self.task)
        self._dropping = True
        self.dropped += 1
        self._torn = self._torn or written > 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.board is not None:
            self.board.close()
