"""A plain PyTorch training loop on the demo digits, made a distsgd worker by the lines marked
``# distsgd``: the README's and docs/own-loop.md's example (tests/test_own_loop.py runs it
under every scheme).

Arguments: ``own-data`` reads this worker's part of the data with a DataLoader of its own
instead of ``worker.batches()``; ``adam`` hands the scheme an Adam optimizer of its own;
``batch-norm`` trains the CNN with BatchNorm (``DigitsCNN(batch_norm=True)``).
"""

import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import distsgd
from distsgd.demo.digits import DigitsCNN, load_digits

config = distsgd.TrainConfig(batch_size=32, epochs=30, lr=0.3, lr_schedule="cosine", warmup=0.1)
distsgd.seed_everything(config.seed)
train, test = load_digits()
model = DigitsCNN(batch_norm="batch-norm" in sys.argv)

if "own-data" in sys.argv:
    me = distsgd.task()  # this worker's rank of num_workers: it reads every num_workers-th sample
    mine = TensorDataset(train[0][me.rank :: me.num_workers], train[1][me.rank :: me.num_workers])
    loader = DataLoader(mine, batch_size=32, shuffle=True, drop_last=True)
    steps = 30 * (len(train[1]) // me.num_workers // 32)  # every worker the same number
    config = config.replace(steps=steps)
    optimizer = None
    if "adam" in sys.argv:
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    worker = distsgd.Worker(  # distsgd
        model, test_data=test, loss_fn=F.cross_entropy, config=config, optimizer=optimizer
    )
    while not worker.done:  # distsgd: --steps local steps
        for inputs, target in loader:
            if worker.done:  # distsgd
                break
            with worker.step() as step:  # distsgd: e.g. pulls fresh parameters
                loss = F.cross_entropy(worker.model(inputs), target)
                loss.backward()
                step.loss = loss  # distsgd: metrics and divergence detection
else:
    worker = distsgd.Worker(  # distsgd
        model, train_data=train, test_data=test, loss_fn=F.cross_entropy, config=config
    )
    for inputs, target in worker.batches():  # distsgd: this worker's shard
        with worker.step() as step:  # distsgd: e.g. pulls fresh parameters
            loss = F.cross_entropy(worker.model(inputs), target)
            loss.backward()  # no optimizer.step(): the scheme updates the parameters
            step.loss = loss  # distsgd: metrics and divergence detection

result = worker.finish()  # distsgd: the last push, waiting for the others, evaluation
if distsgd.task().is_chief:
    print(f"test accuracy: {result.test_accuracy:.4f}")
