"""The bundled GPT-2-style model (distsgd.demo.gpt): its config, its size, its forward pass, and
the memory benchmark's readings of /proc and of the servers' logs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from distsgd.demo.gpt import GPT, SIZES, GPTConfig, config_for_megabytes, lm_loss

sys.path.insert(0, str(ROOT / "benchmarks"))
import memory


@pytest.mark.parametrize("name", sorted(SIZES))
def test_the_parameter_count_is_the_models(name: str) -> None:
    config = SIZES[name]
    if config.parameters > 10_000_000:  # 78M: counted without building it
        assert config.parameters == 78_361_344
        return
    assert sum(p.numel() for p in GPT(config).parameters()) == config.parameters


@pytest.mark.parametrize("megabytes", [3, 30, 300, 1200])
def test_a_size_in_megabytes_comes_within_15_percent(megabytes: float) -> None:
    config = config_for_megabytes(megabytes)
    assert abs(config.parameters * 4 / 1e6 - megabytes) <= 0.15 * megabytes
    assert config.width % config.heads == 0


def test_the_model_is_causal_and_its_loss_starts_near_uniform() -> None:
    torch.manual_seed(0)
    model = GPT(SIZES["tiny"])
    ids = torch.randint(0, 256, (2, 16))
    logits = model(ids)
    assert logits.shape == (2, 16, 256)
    changed = ids.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    assert torch.allclose(model(changed)[:, :10], logits[:, :10], atol=1e-5)  # no look ahead
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])
    loss = lm_loss(logits, torch.randint(0, 256, (2, 16)))
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5


def test_bad_shapes_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match="not a multiple of heads"):
        GPTConfig(width=100, heads=3)
    with pytest.raises(ValueError, match="at least 1"):
        GPTConfig(layers=0)
    with pytest.raises(ValueError, match="longer than the model's context"):
        GPT(GPTConfig(context=8))(torch.zeros(1, 9, dtype=torch.long))


def test_the_memory_benchmark_reads_peaks_and_shards(tmp_path: Path) -> None:
    own = memory.peak_kb(os.getpid())
    assert own is not None and own > 10_000  # this interpreter, torch loaded: over 10 MB
    assert memory.peak_kb(2**22 + 12345) is None  # no such process
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "ps0.log").write_text(
        "INFO distsgd.ps.service: shard 0 registered: scheme hogwild, 8 pieces, 153128 bytes, 2 "
        "workers\n"
    )
    assert memory.shard_bytes(tmp_path) == {"ps0": 153128}
    row = {
        "model_bytes": 30e6,
        "scheme": "hogwild",
        "alone_mb": 500.0,
        "peaks_mb": {"launcher": 60.0, "worker0": 530.0, "ps0": 150.0},
        "shard_bytes": {"ps0": 15_000_000},
        "server_over_shard": {"ps0": 10.0},
        "worker_over_alone_in_models": {"worker0": 1.0},
    }
    assert memory.table([row]).splitlines()[-1] == (
        "| 30 MB | hogwild | 500 | 60 | 530 (+1.00) | 150 (10.00x of 15 MB) |"
    )
