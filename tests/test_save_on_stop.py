"""The parts of a run stopped and saved (issue 36, item 13; the whole of it, with processes, in
test_exactly_once_run.py): a worker's Ctrl-C handler, the manifest of the workers' newest
states, and a finished worker that joins the resumed run."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_checkpoint import worker_state

from distsgd.control.checkpoint.manifests import ManifestWriter
from distsgd.control.checkpoint.store import MANIFEST
from distsgd.ps import Shard
from distsgd.runtime.checkpoint import save_worker_state
from distsgd.runtime.setup import stop_on
from distsgd.schemes import make_server_rule


def test_the_first_sigint_asks_to_stop_and_the_second_interrupts() -> None:
    """The launcher's Ctrl-C reaches a worker as SIGINT: it stops after its step and saves; a
    second SIGINT (a user's Ctrl-C again) interrupts as before."""
    stop = threading.Event()
    asked: list[bool] = []
    before = signal.getsignal(signal.SIGINT)
    restore = stop_on(signal.SIGINT, stop, "stopping", lambda: asked.append(True), once=True)
    assert restore is not None
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.wait(5) and asked == [True]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler runs in the main thread by now
    finally:
        restore()
    assert signal.getsignal(signal.SIGINT) == before


def test_a_checkpoint_of_the_newest_states_takes_each_workers_last(tmp_path: Path) -> None:
    """A stopped run's workers stop at different steps (asynchronous): its checkpoint takes
    each one's newest state, not an older one of the chief's step, and completes at once."""
    root = tmp_path / "checkpoints"
    (root / "ckpt-00000026").mkdir(parents=True)
    for rank, steps in ((0, (20, 26)), (1, (20, 24))):
        for step in steps:
            path = root / "workers" / f"worker{rank}-{step:08d}.pt"
            save_worker_state(path, worker_state(step, worker=rank))
    writer = ManifestWriter(root, 2, wait=60)
    writer.complete("ckpt-00000026", 26, [], {"stopped": True}, newest=True)
    writer.join(30, settled=True)
    manifest = json.loads((root / "ckpt-00000026" / MANIFEST).read_text())
    assert manifest["step"] == 26 and manifest["stopped"] is True
    assert [w["step"] for w in manifest["workers"]] == [26, 24]


def test_a_finished_worker_that_joins_again_is_no_longer_finished() -> None:
    """The shards of a stopped run are saved after every worker left; the resumed run's
    workers join and must count as running, or the chief ends the run without waiting for
    them (599 updates of 600: worker1's last push after the final pull)."""
    values = {"w": np.zeros((3, 4), np.float32)}
    shard = Shard(
        index=0,
        scheme="hogwild",
        options_json=json.dumps({"lr": 0.1}),
        num_workers=2,
        values=values,
        rule=make_server_rule("hogwild", {"lr": 0.1}, 2),
    )
    shard.leave(1)
    assert shard.finished == {1}
    shard.join(1, 7)
    assert shard.finished == set()
