"""A user's CNN without BatchNorm on the demo digits, in a loop of the user's own with gradient
clipping, tuned to train alone (``python cnn_nobn.py``) and run unchanged under every scheme
(``distsgd run --workers 4 --scheme S cnn_nobn.py``): the settings mean the same on N workers
because each scheme's ``--lr-rule`` default turns the rate that trains one process into its
own (docs/schemes/defaults.md; tests/test_defaults.py runs it).
"""

import torch
import torch.nn.functional as F
from torch import nn

import distsgd
from distsgd.demo.digits import load_digits


class Net(nn.Module):
    """conv 3x3 (16) -> conv 3x3 (32) -> max-pool -> dense 64 -> dense 10; no BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.dense = nn.Linear(32 * 4 * 4, 64)
        self.out = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return self.out(F.relu(self.dense(x.flatten(1))))


config = distsgd.TrainConfig(batch_size=32, epochs=30, lr=0.1, lr_schedule="cosine", warmup=0.1)
distsgd.seed_everything(config.seed)
train, test = load_digits()
model = Net()

worker = distsgd.Worker(  # distsgd
    model, train_data=train, test_data=test, loss_fn=F.cross_entropy, config=config
)
for inputs, target in worker.batches():  # distsgd: this worker's shard
    with worker.step() as step:  # distsgd
        loss = F.cross_entropy(worker.model(inputs), target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(worker.model.parameters(), max_norm=5.0)
        step.loss = loss  # distsgd

result = worker.finish()  # distsgd
if distsgd.task().is_chief:
    print(f"test accuracy: {result.test_accuracy:.4f}")
