"""The benchmark suite's workload, shared by the distsgd script and the PyTorch references.

An MLP 784-H-H-10 (H = 512: 669,706 float32 parameters, 2.7 MB), cross-entropy, batch 64, SGD
at lr 0.01, on random inputs generated in-process with a fixed seed (nothing is downloaded).
The labels are a fixed random linear function of the inputs, so the loss falls and no run is
judged diverged. Sizes are in MB of 10**6 bytes.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
from torch import nn

INPUTS, CLASSES = 784, 10
HIDDEN = 512
BATCH_SIZE = 64
LR = 0.01
SAMPLES = 8192
"""Random examples in the training set (every worker builds the same set; each trains on its
shard, as distsgd shards it)."""


def param_count(hidden: int) -> int:
    """Parameters of the MLP 784-hidden-hidden-10."""
    return INPUTS * hidden + hidden + hidden * hidden + hidden + hidden * CLASSES + CLASSES


def hidden_for_mb(megabytes: float) -> int:
    """The hidden width whose float32 MLP is closest to ``megabytes`` (10**6 bytes)."""
    target = megabytes * 1e6 / 4
    b = INPUTS + 2 + CLASSES  # param_count(h) = h*h + b*h + CLASSES
    return max(1, round((-b + math.sqrt(b * b + 4 * (target - CLASSES))) / 2))


def build_model(hidden: int = HIDDEN, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(INPUTS, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, CLASSES),
    )


def make_data(samples: int = SAMPLES, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels): standard normal inputs, labels from a fixed random linear teacher."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, INPUTS, generator=gen)
    teacher = torch.randn(INPUTS, CLASSES, generator=gen)
    return x, (x @ teacher).argmax(dim=1)


def limit_threads() -> None:
    """One thread per process, as ``distsgd run --threads 1`` gives each task."""
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):  # already set
        torch.set_num_interop_threads(1)


def train_loop(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    *,
    batch_size: int = BATCH_SIZE,
    lr: float = LR,
    seed: int = 0,
) -> dict[str, float]:
    """Plain PyTorch SGD for ``steps`` steps; the loop alone is timed, as distsgd times its loop.

    Batches are drawn as distsgd draws them from a tensor pair: a shuffled permutation each
    epoch, rows indexed by it; the loss is read back every step, as distsgd's loop does.
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    per_epoch = len(x) // batch_size
    order = torch.randperm(len(x), generator=gen)
    model.train()
    wall = time.time()
    started = time.monotonic()
    for step in range(steps):
        i = step % per_epoch
        if i == 0 and step:
            order = torch.randperm(len(x), generator=gen)
        idx = order[i * batch_size : (i + 1) * batch_size]
        optimizer.zero_grad(set_to_none=False)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        float(loss.detach())
        optimizer.step()
    seconds = time.monotonic() - started
    return {"steps": steps, "seconds": seconds, "start": wall, "end": wall + seconds}
