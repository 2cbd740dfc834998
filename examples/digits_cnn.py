"""A small convolutional network on scikit-learn's handwritten digits, as any PyTorch script.

The data set ships with scikit-learn (1,797 grey 8x8 images of the digits 0-9; nothing is
downloaded). The script trains with plain torch when started on its own, and as one worker of a
parameter-server job when a launcher started it (``PARAMSERVER_ADDRESS`` is set)::

    python examples/digits_cnn.py                                   # one process
    paramserver run --workers 2 examples/digits_cnn.py              # 2 workers, BSP
    paramserver run --workers 2 --consistency ssp --staleness 2 examples/digits_cnn.py

On the cluster the optimizer is a :class:`ServerOptimizer` (the same SGD with momentum, run by
the servers) and each worker trains its shard of every epoch (:class:`ShardSampler`).
``--batch-size`` is the batch of one step of the whole job: each of ``NUM_WORKERS`` workers
takes its share, so under BSP (mean aggregation) a step is the single-process step on the same
examples. It prints ``final test_accuracy A steps S`` (accuracy on the 517 held-out images, steps
this process trained).
"""

from __future__ import annotations

import argparse
import os

import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from paramserver.integrations.torch import ServerOptimizer, ShardSampler

TRAIN = 1280  # of the 1,797 images; the other 517 are the test set


def digits() -> tuple[TensorDataset, TensorDataset]:
    """Train and test sets: images (N, 1, 8, 8) float32 in [0, 1], labels int64."""
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = order[:TRAIN], order[TRAIN:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights in every process
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),  # 32 x 4 x 4
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 4 * 4, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    return float((model(x).argmax(dim=1) == y).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument(
        "--batch-size", type=int, default=32, help="examples per step, all workers together"
    )
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--momentum", type=float, default=0.9)
    args = parser.parse_args()

    on_cluster = "PARAMSERVER_ADDRESS" in os.environ  # set by paramserver run, ray-launch, Helm
    num_workers = int(os.environ.get("NUM_WORKERS", "1"))
    if args.batch_size % num_workers:
        parser.error(f"--batch-size {args.batch_size} does not split over {num_workers} workers")
    batch = args.batch_size // num_workers

    torch.set_num_threads(1)
    train, test = digits()
    model = make_model()
    if on_cluster:
        opt = ServerOptimizer(model.named_parameters(), "sgd", lr=args.lr, momentum=args.momentum)
        sampler = ShardSampler(train, batch_size=batch, progress=opt)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
        sampler = ShardSampler(train, batch_size=batch)
    loader = DataLoader(train, batch_size=batch, sampler=sampler)

    steps = 0
    for epoch in range(args.epochs):
        model.train()
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            steps += 1
        print(f"epoch {epoch} test_accuracy {accuracy(model, test):.4f}", flush=True)
    if on_cluster:
        opt.synchronize()  # every worker's final model: all workers' updates (SSP, ASP)
    print(f"final test_accuracy {accuracy(model, test):.4f} steps {steps}", flush=True)
    if on_cluster:
        opt.close()


if __name__ == "__main__":
    main()
