"""DiLoCo and Streaming DiLoCo: two real workers over gloo against a plain two-replica loop."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import SCRIPTS, run_distsgd
from torch import nn
from torch.utils.data import TensorDataset

from distsgd.ps.compression import ErrorFeedback, decode, encoding_for
from distsgd.runtime.data import ShardedBatches
from distsgd.schemes.diloco import fragment_of

pytestmark = pytest.mark.slow

STEPS, H, INNER_LR, WD, OUTER_LR, MOMENTUM = 10, 4, 5e-3, 0.1, 0.7, 0.9


def _blobs():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("blobs", SCRIPTS / "blobs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _through_wire(feedback: ErrorFeedback, key: str, tensors: list[torch.Tensor]) -> None:
    """Replace ``tensors`` (in place) by what their encoding with error feedback decodes to."""
    flat = torch.cat([t.reshape(-1) for t in tensors]).numpy()
    message = feedback.encode(key, flat)
    raw = b"".join(p.tobytes() for p in message.parts)
    back = torch.from_numpy(
        decode(
            raw,
            encoding=message.encoding,
            scale=message.scale,
            nnz=message.nnz,
            shape=flat.shape,
            dtype=flat.dtype,
        )
    )
    offset = 0
    for t in tensors:
        t.copy_(back[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _reference(
    fragments: int, outer_lr: float, momentum: float, *, overlap: bool = False, wire: str = ""
) -> dict[str, torch.Tensor]:
    """The paper's algorithm, written out for two replicas in one process; ``overlap``: each
    fragment's mean applied at its next synchronization (one outer step late); ``wire``: each
    replica's pseudo-gradient encoded with error feedback and decoded, as ``--wire-dtype``."""
    blobs = _blobs()
    torch.manual_seed(0)  # as blobs.py builds its model
    model = blobs.Slow(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)), 0.0)
    data = TensorDataset(*blobs.make_data(640, 1))
    world = 2
    replicas = [copy.deepcopy(model) for _ in range(world)]
    inner = [torch.optim.AdamW(m.parameters(), lr=INNER_LR, weight_decay=WD) for m in replicas]
    theta = [p.detach().clone() for p in model.parameters()]
    outer = torch.optim.SGD(theta, lr=outer_lr, momentum=momentum, nesterov=momentum > 0)
    part_of = fragment_of(len(theta), fragments)
    offsets = [p * H // fragments for p in range(fragments)]
    batches = [
        iter(ShardedBatches(data, rank=r, world=world, batch_size=16, seed=0)) for r in (0, 1)
    ]

    feedback = [ErrorFeedback(encoding_for(wire)) for _ in range(world)] if wire else []
    travelling: dict[int, list[torch.Tensor]] = {}

    def mean_delta(chosen: list[int], params: list[list[torch.Tensor]], part: int) -> list:
        deltas = [[theta[i] - ps[i] for i in chosen] for ps in params]
        for f, d in zip(feedback, deltas, strict=False):  # (wire) each one as all decode it
            _through_wire(f, f"fragment{part}", d)
        return [sum(parts) / world for parts in zip(*deltas, strict=True)]

    def apply(chosen: list[int], delta: list[torch.Tensor]) -> None:
        for i, d in zip(chosen, delta, strict=True):
            theta[i].grad = d
        outer.step()
        outer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def outer_step(part: int, last: bool = False) -> None:
        chosen = [i for i, p in enumerate(part_of) if p == part]
        params = [list(m.parameters()) for m in replicas]
        delta = mean_delta(chosen, params, part)
        if part in travelling:
            apply(chosen, travelling.pop(part))
        if overlap and not last:
            travelling[part] = delta
        else:
            apply(chosen, delta)
        for i in chosen:
            for ps in params:
                ps[i].copy_(theta[i])

    for t in range(STEPS):
        for r, m in enumerate(replicas):
            x, y = next(batches[r])
            m.zero_grad(set_to_none=False)
            F.cross_entropy(m(x), y).backward()
            inner[r].step()
        for part, offset in enumerate(offsets):
            if t + 1 >= offset and (t + 1 - offset) % H == 0:
                outer_step(part)
    for part in range(fragments):
        outer_step(part, last=True)
    return {k: v.detach() for k, v in replicas[0].state_dict().items()}


def _run(tmp_path: Path, name: str, *options: str) -> dict[str, torch.Tensor]:
    run_dir = tmp_path / name
    args = ["run", "--workers", "2", "--scheme", "diloco", "--quiet", "--run-dir", str(run_dir)]
    args += ["--inner-steps", str(H), "--inner-lr", str(INNER_LR), *options]
    done = run_distsgd([*args, str(SCRIPTS / "blobs.py"), "--steps", str(STEPS)])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return torch.load(run_dir / "final_model.pt")


@pytest.mark.parametrize(
    ("fragments", "outer_lr", "momentum"), [(1, OUTER_LR, MOMENTUM), (2, OUTER_LR, MOMENTUM)]
)
def test_diloco_equals_the_reference(
    tmp_path: Path, fragments: int, outer_lr: float, momentum: float
) -> None:
    got = _run(
        tmp_path,
        f"p{fragments}",
        "--fragments",
        str(fragments),
        "--outer-lr",
        str(outer_lr),
        "--outer-momentum",
        str(momentum),
    )
    expected = _reference(fragments, outer_lr, momentum)
    assert set(got) == set(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5)
    # ...and the schedule matters: DiLoCo's result is not the streaming one.
    other = _reference(2 if fragments == 1 else 1, outer_lr, momentum)
    assert any(not torch.allclose(got[k], other[k], atol=1e-4) for k in other)


def test_fragments_are_runs_of_consecutive_tensors() -> None:
    assert fragment_of(5, 1) == [0] * 5
    assert fragment_of(5, 2) == [0, 0, 0, 1, 1]
    assert fragment_of(4, 4) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("fragments", "flags", "wire"),
    [
        (2, ["--overlap"], ""),
        (1, ["--wire-dtype", "int4"], "int4"),
        (2, ["--overlap", "--wire-dtype", "int8"], "int8"),
    ],
)
def test_overlapped_and_compressed_diloco_equal_the_reference(
    tmp_path: Path, fragments: int, flags: list[str], wire: str
) -> None:
    """Overlap applies each mean one outer step late; compression sends encoded changes with
    error feedback. Both against the written-out algorithm, and both differ from plain DiLoCo."""
    overlap = "--overlap" in flags
    got = _run(tmp_path, "run", "--fragments", str(fragments), *flags)
    expected = _reference(fragments, OUTER_LR, MOMENTUM, overlap=overlap, wire=wire)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5)
    plain = _reference(fragments, OUTER_LR, MOMENTUM)
    assert any(not torch.allclose(got[k], plain[k], atol=1e-4) for k in plain)
