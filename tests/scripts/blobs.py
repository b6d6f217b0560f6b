"""A tiny synthetic task for integration tests: 4 Gaussian blobs in 8-D, a 2-layer MLP.

Usage: python blobs.py [--steps N] [--slow SECONDS_PER_STEP]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import distsgd


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 8, generator=torch.Generator().manual_seed(123)) * 3
    y = torch.randint(0, 4, (n,), generator=g)
    x = centers[y] + torch.randn(n, 8, generator=g)
    return x, y


class Slow(nn.Module):
    """Wraps a model and sleeps in forward, to make runs long enough to interrupt."""

    def __init__(self, inner: nn.Module, delay: float) -> None:
        super().__init__()
        self.inner = inner
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.delay:
            time.sleep(self.delay)
        return self.inner(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--slow", type=float, default=0.0)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Slow(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)), args.slow)
    config = distsgd.TrainConfig(batch_size=16, steps=args.steps, lr=0.05, log_every=1)
    distsgd.train(
        model=model,
        loss_fn=F.cross_entropy,
        train_data=make_data(640, 1),
        test_data=make_data(200, 2),
        config=config,
    )


if __name__ == "__main__":
    main()
