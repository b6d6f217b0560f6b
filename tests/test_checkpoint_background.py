"""Worker states written in the background (runtime.checkpoint, runtime.state_writer): the loop
takes a snapshot and trains on while a forked writer writes it; a checkpoint due meanwhile
waits; a writer killed mid-write leaves the last good state; what is read back is the state as
it was at the snapshot. And each distinct state once: a replica the servers hold is left out."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from distsgd.control.checkpoint.errors import CheckpointError
from distsgd.control.checkpoint.store import newest_worker_state, worker_files
from distsgd.runtime import state_writer
from distsgd.runtime.checkpoint import (
    Checkpointer,
    load_replica,
    load_worker_state,
    replica_state,
)

pytestmark = pytest.mark.skipif(not state_writer.CAN_FORK, reason="needs os.fork")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def _state(model: nn.Module, step: int, **extra: Any) -> dict[str, Any]:
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return {
        "worker": 0,
        "local_step": step,
        "global_step": step,
        "steps": 100,
        "position": (0, step),
        "model": model.state_dict(),
        "scheme": {"opt": {"__optimizer__": optimizer.state_dict()}, "start": np.ones(5)},
        "scheme_name": "downpour",
        **extra,
    }


def _saver(tmp_path: Path, **kw: Any) -> Checkpointer:
    return Checkpointer(
        run_dir=tmp_path, rank=0, num_workers=1, every_steps=1, every_seconds=0, wait=1.0, **kw
    )


def _slow(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Each write (in the forked writer) takes ``seconds`` longer."""
    real = state_writer.write_state_file

    def slow(path: Path, state: Any) -> None:
        time.sleep(seconds)
        real(path, state)

    monkeypatch.setattr(state_writer, "write_state_file", slow)


def test_the_loop_goes_on_while_a_slow_writer_writes_the_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _slow(monkeypatch, 1.5)
    model, saver = _model(), _saver(tmp_path)
    state = _state(model, 1)
    before = {k: v.clone() for k, v in state["model"].items()}
    started = time.monotonic()
    saver.maybe_save_worker(1, 0, lambda: state)
    assert time.monotonic() - started < 1.0 and saver.seconds < 1.0  # the loop did not wait
    assert saver.due_step == 1 and not worker_files(saver.root, 0)  # not on disk yet
    with torch.no_grad():  # training goes on: the replica changes under the writer
        for p in model.parameters():
            p.add_(1.0)
    saver.close()
    assert saver.count == 1 and saver.waited == 0
    [path] = worker_files(saver.root, 0)
    loaded = load_worker_state(path)
    for key, value in before.items():  # the snapshot's values, not the changed ones
        assert torch.equal(loaded["model"][key], value), key
    assert path.with_suffix(".json").exists()  # its sidecar, recorded after the write


def test_resuming_from_a_background_written_state_gives_the_same_state(tmp_path: Path) -> None:
    model, saver = _model(), _saver(tmp_path)
    state = _state(model, 3)
    saver.maybe_save_worker(3, 0, lambda: state)
    saver.close()
    loaded = load_worker_state(newest_worker_state(saver.root, 0))  # type: ignore[arg-type]
    assert loaded["position"] == (0, 3) and loaded["local_step"] == 3
    resumed = _model()
    load_replica(resumed, loaded, {})
    for key, value in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key
    saved_opt = state["scheme"]["opt"]["__optimizer__"]["state"]
    read_opt = loaded["scheme"]["opt"]["__optimizer__"]["state"]
    for index, moments in saved_opt.items():
        for name, value in moments.items():
            assert torch.equal(read_opt[index][name], value), (index, name)
    assert np.array_equal(loaded["scheme"]["start"], np.ones(5))


def test_a_checkpoint_due_while_the_previous_is_written_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _slow(monkeypatch, 1.0)
    model, saver = _model(), _saver(tmp_path)
    saver.maybe_save_worker(1, 0, lambda: _state(model, 1))
    fast = saver.seconds
    saver.maybe_save_worker(2, 0, lambda: _state(model, 2))
    assert saver.waited == 1 and saver.seconds - fast > 0.5  # the wait is the loop's cost
    assert "checkpoint at step 2 waits for the previous one (worker0-00000001.pt" in caplog.text
    saver.close()
    assert [f.name for f in worker_files(saver.root, 0)] == [
        "worker0-00000001.pt",
        "worker0-00000002.pt",
    ]
    assert saver.count == 2


def test_a_writer_killed_mid_write_leaves_the_last_good_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, saver = _model(), _saver(tmp_path)
    saver.maybe_save_worker(1, 0, lambda: _state(model, 1))
    saver.close()
    good = newest_worker_state(saver.root, 0)
    assert good is not None and good.name == "worker0-00000001.pt"

    def stuck(path: Path, state: Any) -> None:
        def half(f: Any) -> None:
            f.write(b"PK\x03\x04 half a zip")
            f.flush()
            time.sleep(60)

        state_writer.write_stream_atomic(path, half)

    monkeypatch.setattr(state_writer, "write_state_file", stuck)
    saver.maybe_save_worker(2, 0, lambda: _state(model, 2))
    writing = saver._writing
    assert writing is not None
    deadline = time.monotonic() + 20
    while not list((saver.root / "workers").glob(".worker0-00000002.pt.*.tmp")):
        assert time.monotonic() < deadline, "the writer never started its file"
        time.sleep(0.02)
    os.kill(writing.pid, signal.SIGKILL)  # a crash mid-write
    assert writing.join(10)
    assert newest_worker_state(saver.root, 0) == good  # the last good state, intact
    assert load_worker_state(good)["local_step"] == 1
    with pytest.raises(CheckpointError, match="writing this worker's state failed"):
        saver.maybe_save_worker(3, 0, lambda: _state(model, 3))  # the failure is not silent
    _saver(tmp_path)  # a restarted worker clears what the killed writer left
    assert not list((saver.root / "workers").glob(".*.tmp"))


def test_a_writer_that_hangs_is_killed_after_its_patience_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A forked writer that never ends (as one waiting on a lock another thread of the worker
    held at the fork would): the next due checkpoint waits for it only as long as its
    patience, kills it, skips its checkpoint and is written itself."""
    model, saver = _model(), _saver(tmp_path)
    monkeypatch.setattr(state_writer, "PATIENCE_SECONDS", 1.0)
    real = state_writer.write_state_file
    monkeypatch.setattr(state_writer, "write_state_file", lambda path, state: time.sleep(600))
    saver.maybe_save_worker(1, 0, lambda: _state(model, 1))
    hung = saver._writing
    assert hung is not None and hung.patience < 1.5
    monkeypatch.setattr(state_writer, "write_state_file", real)
    began = time.monotonic()
    saver.maybe_save_worker(2, 0, lambda: _state(model, 2))  # waits for step 1's writer
    assert 0.5 < time.monotonic() - began < 10
    assert hung.outcome is state_writer.WriteOutcome.HUNG and hung.exit_code == -signal.SIGKILL
    assert "the writer of worker0-00000001.pt made no end" in caplog.text
    saver.close()
    assert [f.name for f in worker_files(saver.root, 0)] == ["worker0-00000002.pt"]
    assert saver.skipped == 1 and saver.count == 1


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # a tied weight: two names, one tensor
        self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)


def test_a_replica_the_servers_hold_is_left_out_and_pulled_back(tmp_path: Path) -> None:
    from distsgd.runtime.modules import exchanged_parameters

    model = Tied()
    exchanged = exchanged_parameters(model)
    kept = replica_state(model, exchanged)
    assert sorted(kept) == [
        "frozen",
        "norm.num_batches_tracked",
        "norm.running_mean",
        "norm.running_var",
    ]
    state = {"local_step": 4, "model": kept, "replica_from_servers": True}
    other = Tied()
    with torch.no_grad():
        other.frozen.zero_()
    load_replica(other, state, exchanged_parameters(other))
    assert torch.equal(other.frozen, model.frozen)  # what the servers do not hold comes back
    with pytest.raises(CheckpointError, match="does not fit this model"):
        load_replica(nn.Linear(2, 2), state, {})
    with pytest.raises(RuntimeError):  # a whole replica is loaded strictly, as before
        load_replica(other, {"model": kept}, {})


class _Ctx:
    """What AsyncDiLoCo's worker asks of its context to start."""

    def __init__(self, model: nn.Module) -> None:
        self.params = dict(model.named_parameters())

    def make_optimizer(self, kind: str, **kw: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.params.values(), **kw)

    def pull(self, **kw: Any) -> None:
        pass

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: p.detach().numpy().copy() for k, p in self.params.items()}

    def views(self) -> dict[str, np.ndarray]:
        return {k: p.detach().numpy() for k, p in self.params.items()}

    def push_buffers(self) -> dict[str, np.ndarray] | None:
        return None  # no shared memory: the round's start is a copy of the worker's own


class _CtxWithPushAreas(_Ctx):
    """... with shared-memory push areas, where the round's start is kept."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.areas = {k: np.zeros(p.shape, np.float32) for k, p in self.params.items()}

    def push_buffers(self) -> dict[str, np.ndarray] | None:
        return self.areas


def test_asyncdiloco_saves_the_rounds_start_only_when_it_differs_from_the_replica() -> None:
    from distsgd.schemes.asyncdiloco import AsyncDilocoOptions
    from distsgd.workers.asyncdiloco import AsyncDilocoWorker

    assert not AsyncDilocoWorker.replica_from_servers  # its replica is its inner progress
    model = nn.Linear(3, 2)
    worker = AsyncDilocoWorker(AsyncDilocoOptions(inner_steps=4), num_workers=2)
    worker.start(_Ctx(model))  # type: ignore[arg-type]
    assert worker.state_dict()["round_start"] == {}  # just exchanged: the replica's own
    assert "replica" not in worker.state_dict()  # the live parameters are not state
    worker.pending = [2]  # two inner steps into the round: the start is distinct state
    start = model.weight.detach().numpy().copy()
    with torch.no_grad():
        model.weight.add_(1.0)
    state = worker.state_dict()
    assert sorted(state["round_start"]) == ["bias", "weight"]
    assert np.array_equal(state["round_start"]["weight"], start)

    resumed_model = nn.Linear(3, 2)
    resumed = AsyncDilocoWorker(AsyncDilocoOptions(inner_steps=4), num_workers=2)
    resumed.start(_Ctx(resumed_model))  # type: ignore[arg-type]
    resumed.load_state_dict(dict(state))
    assert np.array_equal(resumed.round_start["weight"], state["round_start"]["weight"])
    worker.pending = [0]
    resumed.load_state_dict(worker.state_dict())  # the start left out: the replica's
    assert np.array_equal(resumed.round_start["weight"], resumed_model.weight.detach().numpy())
    assert resumed.pending == [0]

    in_areas = _CtxWithPushAreas(nn.Linear(3, 2))
    kept = AsyncDilocoWorker(AsyncDilocoOptions(inner_steps=4), num_workers=2)
    kept.start(in_areas)  # type: ignore[arg-type]
    for key, area in in_areas.areas.items():  # the start lives in the push areas, no copy
        assert kept.round_start[key] is area
        assert np.array_equal(area, in_areas.params[key].detach().numpy())
    kept.load_state_dict(dict(state))  # a resumed start lands there too
    assert np.array_equal(in_areas.areas["weight"], state["round_start"]["weight"])


def test_scheme_states_leave_out_what_the_servers_hold() -> None:
    from distsgd.workers.dynsgd import DynsgdWorker
    from distsgd.workers.hogwild import HogwildWorker
    from distsgd.workers.sync import SyncWorker

    for scheme in (HogwildWorker, DynsgdWorker, SyncWorker):  # each pulls before every step
        assert scheme.replica_from_servers, scheme.__name__


@pytest.mark.parametrize("large", [False, True], ids=["copied", "live"])
def test_a_server_writes_its_checkpoint_without_stalling_pushes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, large: bool
) -> None:
    """The shard's state is copied under its lock, then written outside it: pushes go on
    while a slow disk writes, and the file holds the state as it was at the copy. A large
    shard (``LIVE_SNAPSHOT_BYTES``) is written from its live values instead, no copy made:
    the pushes wait for the write, and the file holds the same state."""
    import json
    import threading

    from distsgd.ps import start_server, stop_server, wal
    from distsgd.ps.shard import Shard
    from distsgd.ps.shard_file import read_shard_header
    from distsgd.schemes import make_server_rule
    from distsgd.transport import ShardClient

    real = Shard.pack_into
    writing = threading.Event()

    def slow(f: Any, arrays: Any, header: Any) -> None:
        writing.set()
        time.sleep(1.5)
        real(f, arrays, header)

    monkeypatch.setattr(Shard, "pack_into", staticmethod(slow))
    if large:
        monkeypatch.setattr(wal, "LIVE_SNAPSHOT_BYTES", 0)
    srv, address, service = start_server(
        address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule, checkpoint_dir=tmp_path
    )
    client = ShardClient(address, worker=0, run_id="r", timeout=10)
    try:
        client.register(
            shard_index=0,
            scheme="hogwild",
            options_json=json.dumps({"lr": 0.5, "momentum": 0.0}),
            num_workers=1,
            tensors={"w#0": np.ones(4, dtype=np.float32)},
        )
        version, _ = client.pull()
        replies: list[Any] = []
        saver = threading.Thread(target=lambda: replies.append(client.checkpoint("c1")))
        saver.start()
        assert writing.wait(10)
        started = time.monotonic()
        for _ in range(3):
            grad = {"w#0": np.ones(4, dtype=np.float32)}
            assert client.push(base_version=version, tensors=grad).accepted
        pushed = time.monotonic() - started
        saver.join(10)
        if large:  # held until the write was done (its 1.5 s, however fast the machine)
            assert pushed >= 1.0, f"pushes went on during a live write ({pushed:.2f} s)"
        else:
            assert pushed < 1.0, f"pushes waited {pushed:.2f} s for the checkpoint's write"
        assert replies[0].version == version  # the copy's state, not the later pushes'
        assert read_shard_header(Path(replies[0].file)).version == version
        assert client.pull()[0] == version + 3
    finally:
        client.close()
        stop_server(srv, service, grace=0.1)


def test_downpour_saves_the_windows_start_only_inside_a_window() -> None:
    from distsgd.schemes.downpour import DownpourOptions
    from distsgd.workers.downpour import DownpourWorker

    model = nn.Linear(3, 2)
    worker = DownpourWorker(DownpourOptions(window=4), num_workers=2)
    worker.start(_Ctx(model))  # type: ignore[arg-type]
    assert "window_start" not in worker.state_dict()  # between windows: the replica's own
    worker.pending = 2
    with torch.no_grad():
        model.weight.add_(1.0)
    state = worker.state_dict()
    assert np.allclose(state["window_start"]["weight"], model.weight.detach().numpy() - 1)
    resumed_model = nn.Linear(3, 2)
    resumed = DownpourWorker(DownpourOptions(window=4), num_workers=2)
    resumed.start(_Ctx(resumed_model))  # type: ignore[arg-type]
    resumed.load_state_dict(state)
    assert np.array_equal(resumed.window_start["weight"], state["window_start"]["weight"])
    worker.pending = 0
    resumed.load_state_dict(worker.state_dict())
    assert np.array_equal(resumed.window_start["weight"], resumed_model.weight.detach().numpy())
    assert resumed.pending == 0


def test_a_killed_worker_takes_its_state_writer_along(tmp_path: Path) -> None:
    """The forked writer dies with the worker (PR_SET_PDEATHSIG): a worker SIGKILLed while
    its state is being written leaves no process behind (its older file stays the newest)."""
    import signal
    import subprocess
    import sys

    import psutil

    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from distsgd.runtime import state_writer\n"
        "state_writer.write_state_file = lambda path, state: time.sleep(60)  # a slow disk\n"
        "w = state_writer.BackgroundWrite(Path(sys.argv[1]), {}, lambda w: None)\n"
        "print(w.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "state.pt")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert worker.stdout is not None
        writer = psutil.Process(int(worker.stdout.readline()))
        assert writer.is_running()
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if writer.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        else:
            writer.kill()  # only what this test started
            pytest.fail("the state writer outlived its worker")
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
