"""``--device auto|cpu|cuda[:N]``: where each worker trains. Parameter servers stay on CPU; with
GPUs the local launcher gives each worker its own through ``CUDA_VISIBLE_DEVICES``. On a machine
without a GPU the GPU runs skip; the CPU paths and the GPU hand-out are tested everywhere."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import loadclock
import pytest
import torch
from conftest import SCRIPTS, final_accuracy, run_distsgd

from distsgd.launcher.tasks import worker_gpus
from distsgd.runtime import TrainConfig
from distsgd.runtime.setup import resolve_device

HAS_GPU = torch.cuda.is_available()


@pytest.mark.parametrize("device", ["", "auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_values_accepted(device: str) -> None:
    assert TrainConfig(device=device).device == device


@pytest.mark.parametrize("device", ["gpu", "CUDA", "cuda:", "cuda:x", "mps ", "cpu:0"])
def test_device_values_refused_with_the_choices(device: str) -> None:
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        TrainConfig(device=device)


def test_resolve_device() -> None:
    here = torch.device("cpu")
    assert resolve_device("", here) == here
    assert resolve_device("cpu", here) == torch.device("cpu")
    assert resolve_device("auto", here).type == ("cuda" if HAS_GPU else "cpu")
    with pytest.raises(ValueError, match=r"worker3 sees .* use --device auto"):
        resolve_device(f"cuda:{torch.cuda.device_count()}", here, rank=3)


def test_workers_get_the_gpus_in_turn_and_servers_none() -> None:
    assert worker_gpus("auto", {"CUDA_VISIBLE_DEVICES": "3,5"}) == ["3", "5"]
    assert worker_gpus("cuda", {"CUDA_VISIBLE_DEVICES": " 0 ,1,2 "}) == ["0", "1", "2"]
    assert worker_gpus("auto", {"CUDA_VISIBLE_DEVICES": ""}) == []  # auto: CPU then
    for device in ("", "cpu", "cuda:1"):  # none handed out: the script's, the CPU, one GPU
        assert worker_gpus(device, {"CUDA_VISIBLE_DEVICES": "3,5"}) == []
    with pytest.raises(ValueError, match="--device cuda: this machine shows no GPU"):
        worker_gpus("cuda", {"CUDA_VISIBLE_DEVICES": ""})


RECORD = """
import json, os, sys
from pathlib import Path
task = json.loads(os.environ["DISTSGD_TASK"])
Path(task["run_dir"], f"env{task['task_index']}.json").write_text(
    json.dumps({"cuda": os.environ.get("CUDA_VISIBLE_DEVICES")})
)
sys.argv = [sys.argv[0], "--steps", "20"]
exec(Path(%r).read_text())
"""


@pytest.mark.slow
def test_the_launcher_hands_each_worker_its_own_gpu(tmp_path: Path) -> None:
    """Four workers over the two GPUs the launcher is shown (none exists here: they then
    train on CPU, as auto says), each given one in turn; the server none."""
    script = tmp_path / "record.py"
    script.write_text(RECORD % str(SCRIPTS / "blobs.py"))
    run_dir = tmp_path / "run"
    args = ["run", "--workers", "4", "--scheme", "hogwild", "--device", "auto", "--quiet"]
    done = loadclock.run(
        [sys.executable, "-m", "distsgd", *args, "--run-dir", str(run_dir), str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "6,7"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    seen = [json.loads((run_dir / f"env{i}.json").read_text())["cuda"] for i in range(4)]
    assert seen == ["6", "7", "6", "7"]


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_is_one_line(tmp_path: Path) -> None:
    done = run_distsgd(["demo", "--device", "cuda", "--run-dir", str(tmp_path / "run")])
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "distsgd: error: --device cuda: this machine shows no GPU to distsgd; use --device auto "
        "(GPUs where there are some) or cpu"
    ]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine")
@pytest.mark.parametrize("scheme", ["hogwild", "allreduce"])
def test_the_demo_on_gpus(tmp_path: Path, scheme: str) -> None:
    args = ["demo", "--device", "cuda", "--workers", "2", "--scheme", scheme, "--quiet"]
    done = run_distsgd([*args, "--run-dir", str(tmp_path / "run")])
    assert final_accuracy(done) >= 0.95
