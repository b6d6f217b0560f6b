"""Nothing in a file distsgd reads can run code: worker states load with ``weights_only``,
shard files without pickle, and a crafted file is refused in one line, naming it.

The crafted files are real: :func:`test_the_crafted_file_runs_code_when_loaded_unsafely` shows
the payload does run under ``torch.load(weights_only=False)`` (what distsgd did before).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SCRIPTS, run_distsgd

from distsgd import schemes
from distsgd.cli.main import main as cli_main
from distsgd.control.checkpoint.errors import CheckpointError, UnsafeFileError
from distsgd.control.checkpoint.safety import unsafe_globals
from distsgd.control.checkpoint.store import (
    MANIFEST,
    latest_checkpoint,
    newest_shard_file,
    newest_worker_state,
    worker_state_step,
)
from distsgd.control.config import TrainConfig
from distsgd.ps.shard import Shard
from distsgd.ps.shard_file import CorruptCheckpoint, read_shard_header
from distsgd.runtime.checkpoint import (
    UnsavableStateError,
    load_worker_state,
    save_worker_state,
)
from distsgd.runtime.context import WorkerContext
from distsgd.runtime.scheme import WorkerScheme
from distsgd.transport.client import PushResult
from distsgd.transport.security import write_secret_file


class _RunsCode:
    """Pickles as a call of ``os.system``: loading it unsafely runs the shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (self.command,))


def _state(step: int = 10, **changes: Any) -> dict[str, Any]:
    return {
        "worker": 0,
        "local_step": step,
        "global_step": step,
        "position": (0, step),
        "model": torch.nn.Linear(3, 2).state_dict(),
        "scheme": {"pending": 1},
        "scheme_name": "hogwild",
        "steps": 100,
        **changes,
    }


def _crafted(marker: Path) -> bytes:
    """A worker state, complete in every key, whose scheme state runs ``touch MARKER``."""
    buf = io.BytesIO()
    command = f"touch {shlex.quote(str(marker))}"
    torch.save({"format": 2, **_state(scheme={"x": _RunsCode(command)})}, buf)
    return buf.getvalue()


def _distsgd(args: list[str]) -> subprocess.CompletedProcess[str]:
    """``distsgd ARGS`` by the CLI's main in this process, its output captured (a command line
    of its own for each cost a CPU-second; a crafted file's code would run here all the
    same, and leave its marker)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_main(args)
        except SystemExit as exc:  # argparse's exit, as the command's
            code = exc.code if isinstance(exc.code, int) else 2
    return subprocess.CompletedProcess(["distsgd", *args], code, out.getvalue(), err.getvalue())


def _error_line(done: Any) -> str:
    """The one line of a failed command's stderr (asserts it is one, with no traceback)."""
    assert done.returncode != 0, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return str(lines[0])


def test_the_crafted_file_runs_code_when_loaded_unsafely(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    torch.load(io.BytesIO(_crafted(marker)), weights_only=False)
    assert marker.exists()


# -- reading a crafted worker state -------------------------------------------------------------
def test_load_refuses_a_crafted_state_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    path = tmp_path / "worker0-00000010.pt"
    path.write_bytes(_crafted(marker))
    with pytest.raises(UnsafeFileError) as caught:
        load_worker_state(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: not a distsgd worker state (it holds Python objects")
    assert "system" in message and "\n" not in message
    assert newest_worker_state(tmp_path.parent, 0) is None
    assert not marker.exists()


def test_a_crafted_state_in_workers_is_skipped_for_the_previous_one(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    workers = tmp_path / "checkpoints" / "workers"
    save_worker_state(workers / "worker0-00000005.pt", _state(5))
    (workers / "worker0-00000010.pt").write_bytes(_crafted(marker))
    newest = newest_worker_state(tmp_path / "checkpoints", 0)
    assert newest == workers / "worker0-00000005.pt"
    assert not marker.exists()


def test_inspect_of_a_crafted_file_is_one_line(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    path = tmp_path / "evil.pt"
    path.write_bytes(_crafted(marker))
    line = _error_line(_distsgd(["doctor", str(path)]))
    assert line.startswith(f"distsgd: error: {path}: not a distsgd worker state (it holds Python")
    assert "distsgd never loads those" in line
    assert not marker.exists()


def _shard_bytes() -> tuple[int, bytes]:
    rule = schemes.make_server_rule("hogwild", {"lr": 0.1}, 1)
    values = {"w#0": np.arange(6, dtype=np.float32)}
    shard = Shard(
        index=0,
        scheme="hogwild",
        options_json=json.dumps({"lr": 0.1}),
        num_workers=1,
        values=values,
        rule=rule,
    )
    return shard.to_bytes()


def _checkpoint(root: Path, step: int, worker: bytes) -> Path:
    """``root/ckpt-<step>/``: a shard, ``worker`` as worker 0's state, a manifest that matches."""
    folder = root / f"ckpt-{step:08d}"
    folder.mkdir(parents=True)
    version, shard = _shard_bytes()
    (folder / "ps0.npz").write_bytes(shard)
    (folder / "worker0.pt").write_bytes(worker)
    (root / "workers").mkdir(exist_ok=True)
    (root / "workers" / f"worker0-{step:08d}.pt").write_bytes(worker)

    def entry(name: str, data: bytes, **more: int) -> dict[str, Any]:
        digest = hashlib.sha256(data).hexdigest()
        return {"file": name, "sha256": digest, "bytes": len(data), **more}

    manifest = {
        "format": 1,
        "name": folder.name,
        "step": step,
        "shards": [entry("ps0.npz", shard, version=version)],
        "workers": [entry("worker0.pt", worker, step=step)],
        "scheme": "hogwild",
    }
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return folder


def _good_state_bytes(step: int) -> bytes:
    buf = io.BytesIO()
    torch.save({"format": 2, **_state(step)}, buf)
    return buf.getvalue()


def _run_folder(tmp_path: Path, marker: Path) -> Path:
    """A run folder as ``distsgd run`` leaves it, whose newest checkpoint's worker file is
    crafted (the manifest's SHA-256 matches it: whoever writes one can write the other)."""
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    _checkpoint(root, 5, _good_state_bytes(5))
    _checkpoint(root, 10, _crafted(marker))
    config = {
        "script": str(SCRIPTS / "blobs.py"),
        "script_args": ["--steps", "20"],
        "scheme": "hogwild",
        "scheme_options": {},
        "overrides": {},
        "workers": 1,
        "ps": 1,
        "threads_per_worker": 1,
        "run_id": "0123456789abcdef",
        "checkpoint_every": 5,
        "checkpoint_seconds": 0.0,
    }
    (run_dir / "config.json").write_text(json.dumps(config))
    write_secret_file(run_dir / "secret")
    return run_dir


def test_latest_checkpoint_refuses_a_crafted_worker_file_loudly(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    run_dir = _run_folder(tmp_path, marker)
    crafted = run_dir / "checkpoints" / "ckpt-00000010" / "worker0.pt"
    with pytest.raises(UnsafeFileError, match=f"^{crafted}: not a distsgd worker state"):
        latest_checkpoint(run_dir / "checkpoints")
    assert not marker.exists()


def test_inspect_of_a_run_folder_with_a_crafted_worker_file(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    run_dir = _run_folder(tmp_path, marker)
    crafted = run_dir / "checkpoints" / "ckpt-00000010" / "worker0.pt"
    line = _error_line(_distsgd(["doctor", str(run_dir)]))
    assert f"{crafted}: not a distsgd worker state (it holds Python objects" in line
    assert "to use an older checkpoint" in line
    assert not marker.exists()


def test_resume_from_a_crafted_worker_file_stops_before_starting(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    run_dir = _run_folder(tmp_path, marker)
    crafted = run_dir / "checkpoints" / "ckpt-00000010" / "worker0.pt"
    done = _distsgd(["run", "--resume", str(run_dir), "--quiet"])
    line = _error_line(done)
    assert line.startswith(f"distsgd: error: {crafted}: not a distsgd worker state"), line
    assert not marker.exists()
    assert not (run_dir / "logs" / "worker0.log").exists()  # no task was started


@pytest.mark.slow
def test_a_real_run_folder_with_a_crafted_checkpoint(tmp_path: Path) -> None:
    """``distsgd run``, then its newest checkpoint's worker state replaced (and the manifest
    made to match): neither inspect nor --resume runs it."""
    run_dir = tmp_path / "run"
    args = ["run", "--scheme", "downpour", "--checkpoint-every", "5", "--quiet"]
    args += ["--run-dir", str(run_dir), str(SCRIPTS / "blobs.py"), "--steps", "20"]
    done = run_distsgd(args)  # its exit code may also judge the training: not this test's subject
    assert (run_dir / "result.json").exists(), done.stdout[-3000:] + done.stderr[-3000:]
    inspected = _distsgd(["doctor", str(run_dir)])
    # saved between windows (every 5 steps, window 5): the window's start is the replica's
    assert inspected.returncode == 0 and "scheme state: optimizer, pending" in inspected.stdout
    newest = sorted((run_dir / "checkpoints").glob("ckpt-*"))[-1]
    marker = tmp_path / "MARKER"
    crafted = newest / "worker0.pt"
    data = _crafted(marker)
    crafted.unlink()  # a hard link to workers/worker0-*.pt: replace only this name
    crafted.write_bytes(data)
    manifest = json.loads((newest / MANIFEST).read_text())
    manifest["workers"][0].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    (newest / MANIFEST).write_text(json.dumps(manifest))
    line = _error_line(_distsgd(["doctor", str(run_dir)]))
    assert f"{crafted}: not a distsgd worker state (it holds Python objects" in line
    (run_dir / "result.json").unlink()  # as a run stopped before its end: one to resume
    line = _error_line(_distsgd(["run", "--resume", str(run_dir), "--quiet"]))
    assert f"{crafted}: not a distsgd worker state" in line
    assert not marker.exists()


# -- inspect of files that are not what they should be ------------------------------------------
def test_inspect_of_a_state_without_model_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "worker0.pt"
    state = _state()
    del state["model"]
    torch.save({"format": 2, **state}, path)
    line = _error_line(_distsgd(["doctor", str(path)]))
    assert line == f"distsgd: error: {path}: not a distsgd worker state (no 'model')"


@pytest.mark.parametrize(
    "content",
    [b"junk", b"\x80\x04K\x01.", b"PK\x03\x04 truncated zip"],
    ids=["text", "pickle", "broken-zip"],
)
def test_inspect_of_junk_npz_is_one_line(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "junk.npz"
    path.write_bytes(content)
    line = _error_line(_distsgd(["doctor", str(path)]))
    assert line.startswith(f"distsgd: error: {path}: not a distsgd shard checkpoint (")
    assert line.endswith("; give a psN.npz of a checkpoint") and "allow_pickle" not in line


def test_shard_file_with_object_arrays_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ps0.npz"
    np.savez(path, header=np.array([{"format": 1}], dtype=object))
    with pytest.raises(CorruptCheckpoint, match=r"not plain data.*give a psN\.npz"):
        read_shard_header(path)


def test_read_shard_header_and_the_highest_version_wins(tmp_path: Path) -> None:
    version, data = _shard_bytes()
    assert version == 0
    low = tmp_path / "ckpt-00000090" / "ps0.npz"
    low.parent.mkdir()
    low.write_bytes(data)
    assert read_shard_header(low).version == 0 and read_shard_header(low).index == 0
    # A higher version under a folder name that sorts first (server-only checkpoints).
    shard = Shard.from_bytes(data, schemes.make_server_rule)
    shard.bump(7)
    high = tmp_path / "shards-000000000007" / "ps0.npz"
    high.parent.mkdir()
    high.write_bytes(shard.to_bytes()[1])
    assert newest_shard_file(tmp_path, 0) == high
    damaged = bytearray(high.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF  # inside the values: the header still reads
    high.write_bytes(bytes(damaged))
    assert newest_shard_file(tmp_path, 0) == low
    assert newest_shard_file(tmp_path, 1) is None


def test_worker_state_step_reads_the_name_only(tmp_path: Path) -> None:
    assert worker_state_step(tmp_path / "worker3-00000120.pt") == 120  # need not exist
    with pytest.raises(CheckpointError, match=r"worker<i>-<step>\.pt"):
        worker_state_step(tmp_path / "worker3.pt")


# -- saving: only plain values ------------------------------------------------------------------
class _FakeServers:
    """Just enough of a ParameterClient for a scheme's hooks: pulls give the start values."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays
        self.versions = [0]
        self.bytes_sent = 0
        self.bytes_received = 0
        self.last_waited = 0.0

    def pull(
        self, *, min_version: Any = 0, into: Any = None, names: Any = None
    ) -> tuple[int, dict[str, np.ndarray]]:
        wanted = {k: v for k, v in self.arrays.items() if names is None or k in names}
        if into is not None:
            for k, v in wanted.items():
                np.copyto(into[k], v)
            return 0, {k: into[k] for k in wanted}
        return 0, {k: v.copy() for k, v in wanted.items()}

    def push(
        self, arrays: Any, *, base_version: Any, lr_scale: float, step: int | None = None
    ) -> list[PushResult]:
        return [PushResult(True, 1)]

    def push_buffers(self) -> None:
        return None  # no shared memory: gradients stay where backward puts them

    def release_pulled(self) -> None:
        """No pull area to give back."""


def _trained_scheme(name: str) -> tuple[WorkerScheme, WorkerContext]:
    """Worker 0 of ``name`` after 3 steps of a tiny problem, servers and peers faked."""
    spec = schemes.get(name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    config = TrainConfig(steps=3, lr=0.1, momentum=0.9, batch_size=4)
    arrays = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    ctx = WorkerContext(
        model=model,
        config=config,
        rank=0,
        num_workers=2,
        device=torch.device("cpu"),
        ps=_FakeServers(arrays) if spec.uses_parameter_servers else None,  # type: ignore[arg-type]
    )
    scheme = spec.make_worker(spec.options(), 2)
    scheme.start(ctx)
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    for _ in range(3):
        scheme.before_step(ctx)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        scheme.after_backward(ctx)
        ctx.local_step += 1
    return scheme, ctx


def _assert_same(a: Any, b: Any, where: str = "state") -> None:
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray | np.generic):
        assert a.dtype == b.dtype, where
        np.testing.assert_array_equal(a, b, err_msg=where)
    else:
        assert a == b, where


@pytest.mark.parametrize("name", schemes.names())
def test_every_scheme_state_round_trips_through_a_safe_file(name: str, tmp_path: Path) -> None:
    scheme, ctx = _trained_scheme(name)
    state = scheme.state_dict()
    path = tmp_path / "worker0-00000003.pt"
    save_worker_state(path, _state(3, scheme=state, model=ctx.model.state_dict()))
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []
    torch.load(path, weights_only=True)  # loads as plain data, without distsgd's help
    loaded = load_worker_state(path)
    _assert_same(loaded["scheme"], state)
    restored, restored_ctx = _trained_scheme(name)
    restored_ctx.model.load_state_dict(loaded["model"])
    restored.load_state_dict(loaded["scheme"])
    _assert_same(restored.state_dict(), state)


def test_state_dict_refuses_a_value_a_file_cannot_hold_naming_it() -> None:
    scheme, _ = _trained_scheme("hogwild")
    scheme.seen = {1, 2}  # type: ignore[attr-defined]
    with pytest.raises(UnsavableStateError, match=r"^HogwildWorker\.seen: a builtins\.set "):
        scheme.state_dict()
    scheme.seen = {"a": [1, object()]}  # type: ignore[attr-defined]
    with pytest.raises(UnsavableStateError, match=r"HogwildWorker\.seen\['a'\]\[1\]: a builtins"):
        scheme.state_dict()
    scheme.seen = np.zeros(2, dtype=object)  # type: ignore[attr-defined]
    with pytest.raises(UnsavableStateError, match=r"HogwildWorker\.seen: a numpy array of dtype"):
        scheme.state_dict()


def test_a_schemes_transient_attributes_are_not_state() -> None:
    """A background exchange (an object) is left out of the state and kept on load."""
    scheme, _ = _trained_scheme("downpour")
    running = object()
    scheme.inflight = running  # type: ignore[attr-defined]
    state = scheme.state_dict()
    assert "inflight" not in state and "window_start" in state
    scheme.load_state_dict(state)
    assert scheme.inflight is running  # type: ignore[attr-defined]


def test_save_refuses_a_value_a_file_cannot_hold(tmp_path: Path) -> None:
    path = tmp_path / "worker0-00000010.pt"
    with pytest.raises(UnsavableStateError, match=r"scheme\['x'\]: a pathlib\.\w*Path cannot"):
        save_worker_state(path, _state(scheme={"x": tmp_path}))
    with pytest.raises(UnsavableStateError, match="no 'model'"):
        save_worker_state(path, {k: v for k, v in _state().items() if k != "model"})
    assert not path.exists()


def test_numpy_values_come_back_as_numpy(tmp_path: Path) -> None:
    scheme = {
        "window": {"w": np.arange(4, dtype=np.float32).reshape(2, 2), "b": np.zeros(0, np.int16)},
        "scalar": np.float32(2.5),
        "pair": (1, [2.0, None, "x", True]),
        "tensor": torch.ones(2, dtype=torch.float64),
    }
    path = tmp_path / "worker0-00000010.pt"
    save_worker_state(path, _state(scheme=scheme))
    _assert_same(load_worker_state(path)["scheme"], scheme)


def test_a_format_1_state_without_numpy_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "worker0-00000010.pt"
    torch.save({"format": 1, **_state()}, path)
    assert load_worker_state(path)["local_step"] == 10


def test_a_copied_run_folder_keeps_working(tmp_path: Path) -> None:
    """(The fixture itself) the intact checkpoint of the crafted run folder is usable alone."""
    marker = tmp_path / "MARKER"
    run_dir = _run_folder(tmp_path, marker)
    shutil.rmtree(run_dir / "checkpoints" / "ckpt-00000010")
    checkpoint, problems = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint is not None and checkpoint.step == 5 and not problems


def test_inspect_of_final_parameters_says_what_they_are(tmp_path: Path) -> None:
    path = tmp_path / "final_model.pt"
    torch.save(torch.nn.Linear(3, 2).state_dict(), path)  # as runtime/loop.py writes it
    assert torch.load(path, weights_only=True).keys() == {"weight", "bias"}
    with pytest.raises(CheckpointError, match="a model's state_dict of 2 tensors"):
        load_worker_state(path)


def test_the_torch_free_scan_passes_a_saved_state_and_refuses_a_crafted_one(
    tmp_path: Path,
) -> None:
    saved = tmp_path / "worker0-00000005.pt"
    state = _state(5, scheme={"a": np.zeros(3, dtype=np.float16), "b": torch.zeros(2).bfloat16()})
    save_worker_state(saved, state)
    assert unsafe_globals(saved) == []
    assert json.loads(saved.with_suffix(".json").read_text())["bytes"] == saved.stat().st_size
    crafted = tmp_path / "worker0-00000010.pt"
    crafted.write_bytes(_crafted(tmp_path / "MARKER"))
    assert unsafe_globals(crafted) == ["posix.system"]
    with pytest.raises(CheckpointError, match="not a readable worker state"):
        unsafe_globals(tmp_path / "worker0-00000005.json")


def test_inspect_of_a_run_without_a_complete_checkpoint_says_why_and_what_to_read(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "short"
    (run_dir / "checkpoints" / "workers").mkdir(parents=True)
    line = _error_line(_distsgd(["doctor", str(run_dir)]))
    assert line == (
        f"distsgd: error: {run_dir}: no complete checkpoint (a run shorter than "
        "--checkpoint-every, 30 s by default, has none)"
    )
    state = run_dir / "checkpoints" / "workers" / "worker0-00000066.pt"
    torch.save({"format": 2, **_state()}, state)
    line = _error_line(_distsgd(["doctor", str(run_dir)]))
    assert line.endswith(f"has none); inspect one of its files, e.g. {state}")
