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


class _Reference:
    """The paper's algorithm, written out for two replicas in one process; ``tau``: each
    fragment's mean lands tau inner steps after its exchange began, each replica then keeping
    ``merge`` of its own fragment; ``wire``: each replica's pseudo-gradient encoded with error
    feedback and decoded, as ``--wire-dtype``."""

    def __init__(self, fragments: int, outer_lr: float, momentum: float, wire: str) -> None:
        blobs = _blobs()
        torch.manual_seed(0)  # as blobs.py builds its model
        model = blobs.Slow(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)), 0.0)
        data = TensorDataset(*blobs.make_data(640, 1))
        self.world = 2
        self.replicas = [copy.deepcopy(model) for _ in range(self.world)]
        self.inner = [
            torch.optim.AdamW(m.parameters(), lr=INNER_LR, weight_decay=WD) for m in self.replicas
        ]
        self.theta = [p.detach().clone() for p in model.parameters()]
        self.outer = torch.optim.SGD(
            self.theta, lr=outer_lr, momentum=momentum, nesterov=momentum > 0
        )
        self.part_of = fragment_of(len(self.theta), fragments)
        self.batches = [
            iter(ShardedBatches(data, rank=r, world=self.world, batch_size=16, seed=0))
            for r in range(self.world)
        ]
        self.feedback = [ErrorFeedback(encoding_for(wire)) for _ in self.replicas] if wire else []
        self.travelling: dict[int, tuple[int, list[torch.Tensor]]] = {}  # part -> (step, mean)

    def chosen(self, part: int) -> list[int]:
        return [i for i, p in enumerate(self.part_of) if p == part]

    def params(self) -> list[list[torch.Tensor]]:
        return [list(m.parameters()) for m in self.replicas]

    def inner_step(self) -> None:
        for r, m in enumerate(self.replicas):
            x, y = next(self.batches[r])
            m.zero_grad(set_to_none=False)
            F.cross_entropy(m(x), y).backward()
            self.inner[r].step()

    @torch.no_grad()
    def start(self, part: int, lands_at: int) -> None:
        """The mean of the replicas' pseudo-gradients (as the wire carries them)."""
        deltas = [[self.theta[i] - ps[i] for i in self.chosen(part)] for ps in self.params()]
        for f, d in zip(self.feedback, deltas, strict=False):  # (wire) as every worker decodes
            _through_wire(f, f"fragment{part}", d)
        mean = [sum(parts) / self.world for parts in zip(*deltas, strict=True)]
        self.travelling[part] = (lands_at, mean)

    @torch.no_grad()
    def land(self, part: int, keep: float) -> None:
        """The outer Nesterov step on the fragment's mean; replicas keep ``keep`` of theirs."""
        chosen = self.chosen(part)
        for i, d in zip(chosen, self.travelling.pop(part)[1], strict=True):
            self.theta[i].grad = d
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        for ps in self.params():
            for i in chosen:
                ps[i].copy_(keep * ps[i] + (1 - keep) * self.theta[i])


def _reference(
    fragments: int,
    outer_lr: float,
    momentum: float,
    *,
    tau: int = 0,
    merge: float = 0.5,
    wire: str = "",
) -> dict[str, torch.Tensor]:
    """:class:`_Reference` run for STEPS inner steps, then the final synchronization."""
    ref = _Reference(fragments, outer_lr, momentum, wire)
    offsets = [p * H // fragments for p in range(fragments)]
    for done in range(1, STEPS + 1):
        ref.inner_step()
        for part, (at, _) in list(ref.travelling.items()):
            if at == done:
                ref.land(part, merge)
        for part, offset in enumerate(offsets):
            if done >= offset and (done - offset) % H == 0:
                ref.start(part, done + tau)
                if tau == 0:
                    ref.land(part, 0.0)
    for part in list(ref.travelling):
        ref.land(part, merge)
    for part in range(fragments):
        ref.start(part, STEPS)
        ref.land(part, 0.0)
    return {k: v.detach() for k, v in ref.replicas[0].state_dict().items()}


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
    ("fragments", "tau", "merge", "wire"),
    [(2, 2, 0.5, ""), (1, H, 0.25, ""), (2, 1, 0.0, ""), (1, 0, 0.5, "int4"), (2, 1, 0.25, "int8")],
)
def test_overlapped_and_compressed_diloco_equal_the_reference(
    tmp_path: Path, fragments: int, tau: int, merge: float, wire: str
) -> None:
    """Overlap lands each mean tau inner steps late and merges; compression sends encoded
    changes with error feedback. Both against the written-out algorithm, and both differ from
    plain DiLoCo."""
    flags = ["--fragments", str(fragments), "--overlap-steps", str(tau), "--merge", str(merge)]
    got = _run(tmp_path, "run", *flags, *(["--wire-dtype", wire] if wire else []))
    expected = _reference(fragments, OUTER_LR, MOMENTUM, tau=tau, merge=merge, wire=wire)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5)
    plain = _reference(fragments, OUTER_LR, MOMENTUM)
    assert any(not torch.allclose(got[k], plain[k], atol=1e-4) for k in plain)
