"""Train a small CNN on handwritten digits with distsgd.

The 1,797 8x8 images of the UCI "Optical Recognition of Handwritten Digits" set ship inside the
package (``digits.npz``, see ``tools/export_digits.py``); a fixed 80/20 split gives 1,437 for
training and 360 for test. ``distsgd demo`` runs this script; so can ``distsgd run``::

    distsgd run --workers 2 --ps 1 --scheme hogwild src/distsgd/demo/digits.py

``--batch-norm`` (an argument of the script: ``distsgd run ... digits.py --batch-norm``) trains
the same CNN with a BatchNorm after each hidden layer (:class:`DigitsCNN` ``batch_norm=True``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import distsgd

DATA = Path(__file__).with_name("digits.npz")


def load_digits(
    split: float = 0.8, seed: int = 0
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """((train images, labels), (test images, labels)); images (N, 1, 8, 8) scaled to [0, 1]."""
    with np.load(DATA, allow_pickle=False) as data:
        images = torch.from_numpy(data["images"].astype(np.float32) / 16.0).unsqueeze(1)
        labels = torch.from_numpy(data["labels"].astype(np.int64))
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(split * len(labels))
    train, test = order[:cut], order[cut:]
    return (images[train], labels[train]), (images[test], labels[test])


class DigitsCNN(nn.Module):
    """conv 3x3 (16) -> conv 3x3 (32) -> max-pool -> fc 64 -> fc 10; about 38k parameters.

    ``batch_norm``: a BatchNorm after each of the three hidden layers, before its ReLU
    (``bn1``, ``bn2``: ``BatchNorm2d``; ``bn3``: ``BatchNorm1d``); 224 parameters more, and
    the running statistics (buffers) that evaluation normalizes with.
    """

    def __init__(self, *, batch_norm: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)
        self.bn1: nn.Module = nn.BatchNorm2d(16) if batch_norm else nn.Identity()
        self.bn2: nn.Module = nn.BatchNorm2d(32) if batch_norm else nn.Identity()
        self.bn3: nn.Module = nn.BatchNorm1d(64) if batch_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = F.relu(self.bn3(self.fc1(x.flatten(1))))
        return self.fc2(x)


def main() -> None:
    config = distsgd.TrainConfig(
        batch_size=32, epochs=30, lr=0.3, momentum=0.0, lr_schedule="cosine", warmup=0.1
    )
    distsgd.seed_everything(config.seed)
    train, test = load_digits()
    result = distsgd.train(
        model=DigitsCNN(batch_norm="--batch-norm" in sys.argv[1:]),
        loss_fn=F.cross_entropy,
        train_data=train,
        test_data=test,
        config=config,
    )
    if result.test_accuracy is not None:
        print(f"test accuracy: {result.test_accuracy:.4f}")


if __name__ == "__main__":
    main()
