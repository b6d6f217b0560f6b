"""The chief's :class:`ManifestWriter`: completes checkpoints once every worker has saved."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distsgd.control.checkpoint.store import (
    FORMAT,
    KEEP,
    MANIFEST,
    checkpoint_bytes,
    checkpoint_dirs,
    keep_count,
    worker_files,
    worker_state_step,
)
from distsgd.util import file_digest, write_atomic

log = logging.getLogger(__name__)

Shards = list[dict[str, Any]] | Callable[[str], list[dict[str, Any]]]
"""A checkpoint's shard files (file, sha256, bytes, version each), or what saves them under a
checkpoint's name and returns them."""


class ManifestWriter:
    """(Chief) completes checkpoints in the background, oldest first, on one thread.

    A checkpoint of step k is complete when every worker has saved a state of step k or later
    (asynchronous workers drift apart; a restarted one lags): those files are linked in, then
    the shards are saved (when ``shards`` is a callable: after every worker's state, so the
    shards hold every push those states counted, and maybe later ones, which a resumed worker
    skips: it continues where the servers say its pushes stopped), and the manifest is written
    last. A checkpoint still waiting after ``wait`` seconds is given up.
    Only complete checkpoints count for :func:`keep_count`; pending ones never push a complete
    one out.
    A checkpoint of the ``newest`` states (a run stopped and saved) takes each worker's newest
    state, whatever its step: every worker saved its last one before the chief asked for it.
    """

    def __init__(self, root: Path, num_workers: int, wait: float = 60.0) -> None:
        self.root = root
        self.num_workers = num_workers
        self.wait = wait
        self._pending: list[tuple[str, int, Shards, dict[str, Any], float, bool]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._settled = False
        self._thread = threading.Thread(target=self._run, name="manifests", daemon=True)
        self._thread.start()

    def complete(
        self,
        name: str,
        step: int,
        shards: Shards,
        extra: dict[str, Any],
        *,
        newest: bool = False,
    ) -> None:
        """Complete checkpoint ``name`` of ``step`` once every worker's state is there;
        ``shards``: the shard files saved already, or what saves them (called then);
        ``newest``: of each worker's newest state, whatever its step."""
        give_up = time.monotonic() + self.wait
        with self._lock:
            self._pending.append((name, step, shards, extra, give_up, newest))
        self._wake.set()

    def join(self, timeout: float, *, settled: bool = False) -> None:
        """Finish what can be finished within ``timeout`` seconds, then stop. ``settled``:
        every worker has finished and saved what it ever will, so one last pass completes what
        can be completed and gives the rest up at once (a checkpoint waiting for a worker that
        left the run early, or was dropped, would otherwise hold the run's end ``timeout``)."""
        deadline = time.monotonic() + timeout
        while not settled and time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    break
            time.sleep(0.05)
        self._settled = settled
        self._closing = True
        self._wake.set()
        self._thread.join(max(0.0, deadline - time.monotonic()) + 1.0)

    def _run(self) -> None:
        while True:
            last = self._closing  # read before the pass: the pass after close is the last
            self._pass(give_up_all=last and self._settled)
            if last:
                return
            self._wake.wait(0.1)
            self._wake.clear()

    def _pass(self, *, give_up_all: bool) -> None:
        """Try every pending checkpoint once; drop those done or past their wait."""
        with self._lock:
            pending = list(self._pending)
        for item in pending:
            name, step, shards, extra, give_up, newest = item
            done = self._try(name, -1 if newest else step, shards, {"step": step, **extra})
            if done or give_up_all or time.monotonic() > give_up:
                if not done:
                    log.warning(
                        "checkpoint %s: not every worker reached step %d; given up", name, step
                    )
                with self._lock:
                    self._pending.remove(item)
                self._prune()

    def _try(self, name: str, step: int, shards: Shards, extra: dict[str, Any]) -> bool:
        """Complete ``name`` if every worker saved a state of ``step`` or later (-1: any);
        ``extra`` holds the manifest's ``step``."""
        newest: list[Path] = []
        for rank in range(self.num_workers):
            files = worker_files(self.root, rank)
            if not files or worker_state_step(files[-1]) < step:
                return False
            # The state of exactly this step when it is still there: workers of a collective
            # scheme move in lockstep and must resume at the same step.
            exact = [f for f in files if worker_state_step(f) == step]
            newest.append(exact[0] if exact else files[-1])
        folder = self.root / name
        workers = []
        for rank, source in enumerate(newest):
            target = folder / f"worker{rank}.pt"
            target.unlink(missing_ok=True)
            try:
                os.link(source, target)
            except FileNotFoundError:  # the worker pruned it meanwhile: try again
                return False
            workers.append(
                {
                    "file": target.name,
                    "sha256": file_digest(target)[0],
                    "bytes": target.stat().st_size,
                    "step": worker_state_step(source),
                }
            )
        if callable(shards):
            try:
                shards = shards(name)  # after the states: the cut is consistent
            except Exception as exc:  # a server down right now: the next pass tries again
                log.warning("checkpoint %s: shards not saved yet: %s", name, exc)
                return False
        manifest = {
            "format": FORMAT,
            "name": name,
            "time": time.time(),
            "shards": [{**s, "file": Path(s["file"]).name} for s in shards],
            "workers": workers,
            **extra,
        }
        write_atomic(folder / MANIFEST, json.dumps(manifest, indent=2) + "\n")
        log.info("checkpoint %s complete (%d shards, %d workers)", name, len(shards), len(workers))
        return True

    def _prune(self) -> None:
        """Keep the newest complete checkpoints (:func:`keep_count` of the newest one's size)
        and whatever is newer than them."""
        with self._lock:
            waiting = {name for name, *_ in self._pending}
        folders = checkpoint_dirs(self.root)
        complete = [f for f in folders if (f / MANIFEST).exists()]
        keep = keep_count(checkpoint_bytes(complete[-1])) if complete else KEEP
        if len(complete) <= keep:
            return
        oldest_kept = complete[-keep]
        for folder in folders:
            if folder < oldest_kept and folder.name not in waiting:
                shutil.rmtree(folder, ignore_errors=True)
