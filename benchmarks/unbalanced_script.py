"""The re-balancing benchmark's user script: one large parameter and many small ones.

    distsgd run --scheme hogwild --workers 2 --ps 2 --param-placement round-robin \
        --rebalance auto --steps 400 --threads 1 --quiet benchmarks/unbalanced_script.py

The model is a trunk ``Linear(256, 1024)`` (1.05 MB, the large piece) beside 32 small experts
``Linear(256, 32, bias=False)`` (32.8 KB each, 1.05 MB in all) whose outputs, side by side,
add to the trunk's, then a head ``Linear(1024, 10)``. Round-robin placement (TensorFlow 1's
``replica_device_setter``) deals the parameters to 2 servers in turn: the trunk and half the
experts on ps0 (about 1.6 MB), the other half on ps1 (about 0.55 MB), a 3:1 load. Byte-balanced
placement (the default) would cut the trunk instead; the benchmark uses round-robin to have an
unbalanced placement on purpose. Random inputs with a fixed linear teacher, as the suite's MLP.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload

import distsgd

INPUTS, WIDTH, EXPERTS = 256, 1024, 32


class Unbalanced(nn.Module):
    """A trunk and 32 experts side by side, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(INPUTS, WIDTH)
        self.experts = nn.ModuleList(
            nn.Linear(INPUTS, WIDTH // EXPERTS, bias=False) for _ in range(EXPERTS)
        )
        self.head = nn.Linear(WIDTH, workload.CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = torch.cat([expert(x) for expert in self.experts], dim=1)
        return self.head(F.relu(self.trunk(x) + side))


torch.manual_seed(0)
model = Unbalanced()
gen = torch.Generator().manual_seed(0)
x = torch.randn(workload.SAMPLES, INPUTS, generator=gen)
y = (x @ torch.randn(INPUTS, workload.CLASSES, generator=gen)).argmax(dim=1)
distsgd.train(
    model=model,
    loss_fn=F.cross_entropy,
    train_data=(x, y),
    config=distsgd.TrainConfig(batch_size=workload.BATCH_SIZE, lr=workload.LR, steps=100),
)
