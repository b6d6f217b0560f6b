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
    """Wraps a model; sleeps in forward (runs long enough to interrupt) and, at one training
    step, makes a finite loss with a NaN gradient (0 * d sqrt(z)/dz at z = 0)."""

    def __init__(self, inner: nn.Module, delay: float, poison_step: int = -1) -> None:
        super().__init__()
        self.inner = inner
        self.delay = delay
        self.poison_step = poison_step
        self.z = nn.Parameter(torch.zeros(1))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        if self.training:
            if self.delay:
                time.sleep(self.delay)
            self.calls += 1
            if self.calls == self.poison_step:
                out = out + 0.0 * torch.sqrt(self.z)
        return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--poison-step", type=int, default=-1, help="NaN gradient at this step")
    args = parser.parse_args()
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    model = Slow(inner, args.slow, args.poison_step)
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
