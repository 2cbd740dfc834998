"""A small character-level language model on the Python Language Reference, as any PyTorch
script.

The text is the standard library's own: ``pydoc_data.topics``, the reference sections that
``help("assert")`` shows (about 465,000 characters of English and Python; nothing is
downloaded). It is cut into windows of ``--seq-len`` + 1 characters, of which a fixed random
choice of ``--train-seqs`` (131,072 characters by default) is the training set and
``--val-seqs`` others the validation set. The model is an embedding, a one-layer GRU and a
linear read-out (a char-RNN), trained with Adam to predict each next character.

It trains with plain torch when started on its own, and as one worker of a parameter-server job
when a launcher started it (``PARAMSERVER_ADDRESS`` is set)::

    python examples/char_lm.py                                      # one process
    paramserver run --workers 2 examples/char_lm.py                 # 2 workers, BSP
    paramserver run --workers 2 --consistency ssp --staleness 2 examples/char_lm.py

On the cluster the optimizer is a :class:`ServerOptimizer` (Adam on the servers) and each worker
trains its shard of every epoch (:class:`ShardSampler`); ``--batch-size`` is the batch of one
step of the whole job, split over ``NUM_WORKERS``, so under BSP (mean aggregation) a step is
the single-process step on the same sequences. It prints ``final val_bits_per_char B steps S``
(cross-entropy on the validation windows in bits per character; steps this process trained)
and a greedy sample of generated text.
"""

from __future__ import annotations

import argparse
import math
import os
from pydoc_data.topics import topics

import torch
from torch.utils.data import DataLoader, TensorDataset

from paramserver.integrations.torch import ServerOptimizer, ShardSampler


def reference_text() -> str:
    """Every topic of ``help()``, in topic order."""
    return "\n".join(topics[name] for name in sorted(topics))


def datasets(
    train_seqs: int, val_seqs: int, seq_len: int
) -> tuple[list[str], TensorDataset, TensorDataset]:
    """The vocabulary, and training and validation sets of (input, next character) pairs of
    shape (N, seq_len), int64: the text cut into sequences of ``seq_len`` + 1 characters, of
    which a fixed random choice of ``train_seqs`` trains and ``val_seqs`` others validate."""
    text = reference_text()
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.int64)
    n = (len(ids) - 1) // seq_len
    starts = torch.randperm(n, generator=torch.Generator().manual_seed(0)) * seq_len
    windows = ids[starts[: train_seqs + val_seqs, None] + torch.arange(seq_len + 1)]
    pairs = TensorDataset(windows[:, :-1], windows[:, 1:])
    train, val = pairs[:train_seqs], pairs[train_seqs:]
    return vocab, TensorDataset(*train), TensorDataset(*val)


class CharRNN(torch.nn.Module):
    def __init__(self, vocab_size: int, embed: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, embed)
        self.rnn = torch.nn.GRU(embed, hidden, batch_first=True)
        self.out = torch.nn.Linear(hidden, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(x))
        return self.out(hidden)  # (batch, seq, vocab) logits


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


@torch.no_grad()
def bits_per_char(model: torch.nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    return float(loss_fn(model(x), y)) / math.log(2)


@torch.no_grad()
def sample(model: CharRNN, vocab: list[str], prompt: str, length: int) -> str:
    """Greedy continuation of ``prompt``."""
    ids = torch.tensor([[vocab.index(c) for c in prompt]])
    hidden, state = model.rnn(model.embed(ids))
    out = list(prompt)
    for _ in range(length):
        nxt = model.out(hidden[:, -1]).argmax(dim=-1, keepdim=True)
        out.append(vocab[int(nxt)])
        hidden, state = model.rnn(model.embed(nxt), state)
    return "".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument(
        "--batch-size", type=int, default=32, help="sequences per step, all workers"
    )
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--train-seqs", type=int, default=2048)
    parser.add_argument("--val-seqs", type=int, default=256)
    parser.add_argument("--lr", type=float, default=5e-3)
    args = parser.parse_args()

    on_cluster = "PARAMSERVER_ADDRESS" in os.environ  # set by paramserver run, ray-launch, Helm
    num_workers = int(os.environ.get("NUM_WORKERS", "1"))
    if args.batch_size % num_workers:
        parser.error(f"--batch-size {args.batch_size} does not split over {num_workers} workers")
    batch = args.batch_size // num_workers

    torch.set_num_threads(1)
    vocab, train, val = datasets(args.train_seqs, args.val_seqs, args.seq_len)
    torch.manual_seed(0)  # the same initial weights in every process
    model = CharRNN(len(vocab))
    if on_cluster:
        opt = ServerOptimizer(model.named_parameters(), "adam", lr=args.lr)
        sampler = ShardSampler(train, batch_size=batch, progress=opt)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        sampler = ShardSampler(train, batch_size=batch)
    loader = DataLoader(train, batch_size=batch, sampler=sampler)

    steps = 0
    for epoch in range(args.epochs):
        model.train()
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            steps += 1
        print(f"epoch {epoch} val_bits_per_char {bits_per_char(model, val):.4f}", flush=True)
    if on_cluster:
        opt.synchronize()  # every worker's final model: all workers' updates (SSP, ASP)
    print(f"final val_bits_per_char {bits_per_char(model, val):.4f} steps {steps}", flush=True)
    print(f"sample {sample(model, vocab, 'The ', 60)!r}", flush=True)
    if on_cluster:
        opt.close()


if __name__ == "__main__":
    main()
