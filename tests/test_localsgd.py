"""Local SGD: averaging every step equals all-reduce SGD; longer periods still learn."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, run_distsgd

from distsgd import schemes

pytestmark = pytest.mark.slow


def _final(tmp_path: Path, name: str, args: list[str]) -> dict[str, torch.Tensor]:
    run_dir = tmp_path / name
    common = ["run", "--workers", "2", "--quiet", "--run-dir", str(run_dir), "--momentum", "0"]
    done = run_distsgd([*common, *args, str(SCRIPTS / "blobs.py"), "--steps", "20"])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return torch.load(run_dir / "final_model.pt")


def test_period_one_equals_allreduce_sgd(tmp_path: Path) -> None:
    """avg_i(w - lr * g_i) = w - lr * avg_i(g_i): plain SGD averaged every step is all-reduce."""
    ref = _final(tmp_path, "allreduce", ["--scheme", "allreduce"])
    local = _final(tmp_path, "local1", ["--scheme", "localsgd", "--period", "1"])
    longer = _final(tmp_path, "local5", ["--scheme", "localsgd", "--period", "5"])
    # Post-local SGD whose switch comes after the run: synchronous all along.
    post = _final(
        tmp_path, "post", ["--scheme", "localsgd", "--period", "5", "--switch-step", "100"]
    )
    for key in ref:
        torch.testing.assert_close(local[key], ref[key], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(post[key], ref[key], rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(longer[k], ref[k], atol=1e-4) for k in ref)


def test_options_validated() -> None:
    spec = schemes.get("localsgd")
    with pytest.raises(ValueError, match="period"):
        spec.options(period=0)
    with pytest.raises(ValueError, match="switch_step"):
        spec.options(switch_step=-1)
