"""The training loop's two torch pieces: :class:`ServerOptimizer` and :class:`ShardSampler`.

Re-exported by :mod:`paramserver.integrations.torch` (``docs/torch.md``): a single-process
script changes its optimizer line and its data sampler, and the update runs on the parameter
servers.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from typing import TypedDict, Unpack

import numpy as np
import torch
from torch.optim.optimizer import StateDict
from torch.utils.hooks import RemovableHandle

from paramserver.core.optimizers import UpdateRule
from paramserver.errors import InvalidArgument, WaitTimeout
from paramserver.integrations.torch_params import (
    MissingGrad,
    named_gradients,
    numpy_to_tensor,
    tensor_to_numpy,
)
from paramserver.worker_client.client import PushAck
from paramserver.worker_client.sync import SyncWorkerClient

__all__ = ["ServerOptimizer", "ShardSampler"]


class RuleArgs(TypedDict, total=False):
    """The arguments of a rule kind given by name (``ServerOptimizer(params, "sgd", lr=0.1)``):
    :class:`~paramserver.core.optimizers.UpdateRule`'s."""

    lr: float | None
    momentum: float | None
    nesterov: bool
    weight_decay: float | None
    beta1: float | None
    beta2: float | None
    eps: float | None


def _named_tensors(
    params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]], prefix: str
) -> list[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` pairs: names from ``named_parameters()``, else ``"param.<i>"`` by
    position (the same model gives every worker the same order)."""
    items = list(params)
    out: list[tuple[str, torch.Tensor]] = []
    for i, item in enumerate(items):
        if isinstance(item, tuple):
            name, tensor = item
        else:
            name, tensor = f"param.{i}", item
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgument(
                f"ServerOptimizer takes model.parameters() or model.named_parameters(); item "
                f"{i} is {type(item).__name__}"
            )
        out.append((prefix + name, tensor))
    if not out:
        raise InvalidArgument("ServerOptimizer got no parameters")
    keys = [k for k, _ in out]
    if len(set(keys)) != len(keys):
        raise InvalidArgument(f"ServerOptimizer: a parameter name repeats among {keys}")
    return out


class ServerOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose update runs on the parameter servers.

    The parameters are declared on the servers at construction (first writer wins: every
    worker starts from the same values, copied into the model). :meth:`step` then does what
    one iteration of a worker does: push the gradients, end the clock, pull the values the
    consistency model allows (BSP: every worker's gradient of this step applied once; SSP(s):
    at most ``s`` clocks behind the slowest worker; ASP: whatever the servers hold) and copy
    them into the parameters in place. So a single-process script changes in its optimizer
    line only (and its data sampler, :class:`ShardSampler`)::

        opt = ServerOptimizer(model.named_parameters(), "sgd", lr=0.1)
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

    The update rule (``sgd`` with momentum, ``adam``, ``adamw``, ``adagrad``, ...) and its
    state (momentum buffers, Adam moments, step counts) live on the servers, beside each key:
    they are checkpointed there and survive a worker's restart. Changing ``lr`` in
    ``param_groups`` (a torch LR scheduler) changes nothing on the servers.

    Args:
        params: ``model.named_parameters()`` (keys are the names) or ``model.parameters()``
            (keys ``"param.0"``, ``"param.1"``, ... by position).
        rule: The server-side update rule (default plain SGD, lr 0.01), or its kind by name
            with its arguments as keywords: ``ServerOptimizer(params, "adam", lr=1e-3)``.
        client: An open :class:`~paramserver.worker_client.SyncWorkerClient`; default: one
            opened from the launcher's environment
            (:func:`~paramserver.worker_client.env.connect_sync_from_env`), closed by
            :meth:`close`.
        prefix: Prepended to every key (several models on one cluster).
        num_workers: Wait at construction until this many workers registered (the start
            barrier, so no worker steps alone); default: ``NUM_WORKERS`` of the environment
            when the client comes from it, else no wait.
        overlap: Push each gradient from a backward hook as soon as it is accumulated
            (``register_post_accumulate_grad_hook``), so the pushes travel while backward
            computes the rest, as DDP overlaps its all-reduce; :meth:`step` then waits for
            them. One ``backward()`` per step (a second one would push a key twice).
        missing_grad: A trainable parameter without a gradient: ``"error"``, ``"zeros"`` or
            ``"skip"`` (see :func:`gradients`).
        start_timeout_s: Deadline of the start barrier (seconds).
        **rule_args: The rule's arguments when ``rule`` is a kind's name.

    Raises:
        InvalidArgument: no parameters, a repeated name, an unsupported dtype or a bad rule
            (INVALID_ARGUMENT); the errors of ``init`` and ``wait_for_workers``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        rule: UpdateRule | str | None = None,
        *,
        client: SyncWorkerClient | None = None,
        prefix: str = "",
        num_workers: int | None = None,
        overlap: bool = False,
        missing_grad: MissingGrad = "error",
        start_timeout_s: float = 300.0,
        **rule_args: Unpack[RuleArgs],
    ) -> None:
        if isinstance(rule, str):
            rule = UpdateRule(rule, **rule_args)
        elif rule_args:
            raise InvalidArgument(
                f"ServerOptimizer: {sorted(rule_args)} go with a rule kind given by name "
                "(ServerOptimizer(params, 'sgd', lr=0.1)), not with an UpdateRule"
            )
        if missing_grad not in ("error", "zeros", "skip"):
            raise InvalidArgument(
                f"missing_grad must be error, zeros or skip, got {missing_grad!r}"
            )
        named = _named_tensors(params, prefix)
        self.rule = rule or UpdateRule("sgd", lr=0.01)
        super().__init__([t for _, t in named], {"lr": self.rule.lr})
        self.keys = [k for k, _ in named]
        self._named = named
        self.missing_grad: MissingGrad = missing_grad
        self.overlap = overlap
        self._owns_client = client is None
        if client is None:
            from paramserver.worker_client.env import WorkerEnv, connect_sync_from_env

            env = WorkerEnv.from_env()
            client = connect_sync_from_env().open()
            if num_workers is None:
                num_workers = env.num_workers
        self.client = client
        #: Steps this optimizer object completed (iterations since it was made).
        self.steps = 0
        self._pending: list[concurrent.futures.Future[PushAck]] = []
        self._hooks: list[RemovableHandle] = []
        try:
            stored = client.init({k: tensor_to_numpy(t, k) for k, t in named}, self.rule)
            self._load(stored)
            if num_workers is not None and num_workers > 1:
                client.wait_for_workers(num_workers, timeout_s=start_timeout_s)
            if overlap:
                for key, tensor in named:
                    if tensor.requires_grad:
                        self._hooks.append(
                            tensor.register_post_accumulate_grad_hook(self._hook_for(key))  # type: ignore[no-untyped-call]
                        )
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ internals
    def _hook_for(self, key: str) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:
                return
            if grad.is_sparse:
                grad = grad.to_dense()
            array = tensor_to_numpy(grad.detach().clone(), key)  # backward may reuse .grad
            self._pending.append(self.client.push_async({key: array}))

        return hook

    def _load(self, values: Mapping[str, np.ndarray]) -> None:
        with torch.no_grad():
            for key, tensor in self._named:
                src = numpy_to_tensor(values[key], key)
                if src.dtype != tensor.dtype or tuple(src.shape) != tuple(tensor.shape):
                    raise InvalidArgument(
                        f"parameter {key!r} is {tensor.dtype} {tuple(tensor.shape)} but the "
                        f"server holds {src.dtype} {tuple(src.shape)}"
                    )
                tensor.copy_(src)

    def _gradients(self, pushed: set[str]) -> dict[str, np.ndarray]:
        named = ((key, tensor) for key, tensor in self._named if key not in pushed)
        return named_gradients(named, self.missing_grad)

    # ------------------------------------------------------------------ torch.optim API
    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None, *, num_samples: int = 1
    ) -> float | None:
        """Push this worker's gradients, end its clock, and load the parameters the
        consistency model allows.

        Args:
            closure: Re-evaluates the model and returns the loss (as for any torch optimizer).
            num_samples: Examples behind the gradients (``weighted_mean`` aggregation).

        Returns:
            The closure's loss, or None.

        Raises:
            InvalidArgument: a missing gradient under ``missing_grad="error"``, or a gradient
                the servers refuse (INVALID_ARGUMENT); the errors of push, clock and pull
                (e.g. WaitTimeout, DEADLINE_EXCEEDED, naming the workers waited for).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pending, self._pending = self._pending, []
        pushed = set()
        for future in pending:
            future.result()
        if self.overlap:
            pushed = {k for k, t in self._named if t.requires_grad and t.grad is not None}
        grads = self._gradients(pushed if pending else set())
        if grads:
            self.client.push(grads, num_samples=num_samples)
        self.client.clock()
        self._load(self.client.pull(self.keys))
        self.steps += 1
        return loss

    def state_dict(self) -> StateDict:
        """What this worker holds of the optimizer: torch's ``param_groups`` and, under
        ``"paramserver"``, the keys, the rule, this object's step count and the worker's
        clock. The optimizer *state* (momentum, moments) is not here: the servers hold it
        beside each key and keep it in their checkpoints (``paramserver checkpoint``)."""
        out = super().state_dict()
        out["paramserver"] = {
            "keys": list(self.keys),
            "rule": dataclasses.asdict(self.rule),
            "steps": self.steps,
            "clock": int(self.client.clock_value),
        }
        return out

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Check that ``state_dict`` came from an optimizer of the same keys and rule and
        take back its step count. It changes nothing on the servers: their parameters and
        optimizer state are the cluster's (restore a server checkpoint to roll those back).

        Raises:
            InvalidArgument: other keys or another rule (INVALID_ARGUMENT).
        """
        ours = self.state_dict()["paramserver"]
        theirs = dict(state_dict.get("paramserver") or {})
        for field in ("keys", "rule"):
            if field in theirs and theirs[field] != ours[field]:
                raise InvalidArgument(
                    f"ServerOptimizer.load_state_dict: the state's {field} {theirs[field]!r} "
                    f"differ from this optimizer's {ours[field]!r}"
                )
        self.steps = int(theirs.get("steps", self.steps))

    def synchronize(self, timeout_s: float = 600.0, poll_s: float = 0.05) -> None:
        """Wait until every live worker has ended as many clocks as this one (the end of
        training, when every worker ran the same number of steps), then load the parameters.

        Under SSP and ASP a step loads parameters that may lack up to s clocks of the other
        workers' updates, so workers finish with different models; after this call every
        worker holds the same final one, every acknowledged update applied (pushes are
        applied before the clock that follows them). Under BSP it is the model the last
        step already loaded.

        Raises:
            WaitTimeout: (DEADLINE_EXCEEDED) a worker still had not ended its clocks after
                ``timeout_s`` seconds (the message names the clocks).
        """
        want = int(self.client.clock_value)
        deadline = time.monotonic() + timeout_s
        while (have := int(self.client.status().view.min_clock)) < want:
            if time.monotonic() > deadline:
                raise WaitTimeout(
                    f"synchronize: the slowest live worker is at clock {have}, this one at "
                    f"{want}, after {timeout_s:.0f} s"
                )
            time.sleep(poll_s)
        self._load(self.client.pull(self.keys))

    def close(self) -> None:
        """Remove the backward hooks; close the client if this optimizer opened it (the
        worker leaves the cluster)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._owns_client and getattr(self, "client", None) is not None:
            self.client.close()


class ShardSampler(torch.utils.data.Sampler[int]):
    """Shards a map-style dataset over the workers, as ``torch.utils.data.DistributedSampler``
    does, and resumes where this worker's name left off.

    Epoch ``e`` is a permutation of ``range(len(dataset))`` seeded by ``seed + e`` (or the
    identity without ``shuffle``), padded by repeating its start (or cut, with
    ``drop_last``) to a multiple of the worker count; worker ``i`` takes every
    ``num_workers``-th index from ``i``. Every worker thus gets the same number of batches,
    which BSP needs. :meth:`set_epoch` picks the epoch, as for ``DistributedSampler``; without
    it each pass over the sampler is the next epoch (0, 1, 2, ...).

    Resuming: with ``progress`` (a :class:`ServerOptimizer`, a client, or a number of
    completed steps) the sampler learns at its first epoch how many iterations this worker's
    name completed (:meth:`~paramserver.worker_client.WorkerClient.progress`), and skips that
    many batches of ``batch_size``, counted from epoch 0: epochs already trained yield
    nothing, the interrupted one yields its untrained rest. A worker restarted under its name
    (``paramserver run --max-restarts``) thus trains no batch twice. Pass the
    ``batch_size`` of the DataLoader (batches of consecutive indices, the last one kept).

    Re-sharding: with ``reshard=True`` (and a client in ``progress``) each :meth:`set_epoch`
    reads the live workers' names from the cluster and, when their number changed, splits
    that epoch over them (this worker's index: its name's place among them, sorted). Resuming
    counts batches with the worker count of the first epoch, so combine the two only when the
    count held for the epochs already trained.

    Args:
        dataset: A sized dataset (only ``len(dataset)`` is used).
        num_workers, worker_index: Default: ``NUM_WORKERS`` / ``WORKER_INDEX`` of the
            environment (1 and 0 when unset).
        shuffle, seed, drop_last: As ``DistributedSampler``.
        batch_size: Batch size of the DataLoader (what a completed step consumed).
        progress: Where to resume from (see above); None: from the start.
        reshard: Follow the live worker count at each epoch.

    Raises:
        InvalidArgument: an index out of range, or a count or batch size below 1
            (INVALID_ARGUMENT).
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        num_workers: int | None = None,
        worker_index: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        batch_size: int = 1,
        progress: ServerOptimizer | SyncWorkerClient | int | None = None,
        reshard: bool = False,
    ) -> None:
        if num_workers is None or worker_index is None:
            import os

            from paramserver.worker_client.env import NUM_WORKERS_ENV, WORKER_INDEX_ENV

            if num_workers is None:
                num_workers = int(os.environ.get(NUM_WORKERS_ENV, "1") or 1)
            if worker_index is None:
                worker_index = int(os.environ.get(WORKER_INDEX_ENV, "0") or 0)
        if num_workers < 1 or not 0 <= worker_index < num_workers or batch_size < 1:
            raise InvalidArgument(
                f"ShardSampler: need num_workers >= 1, 0 <= worker_index < num_workers and "
                f"batch_size >= 1; got {num_workers}, {worker_index}, {batch_size}"
            )
        self.size = len(dataset)
        self.num_workers = num_workers
        self.worker_index = worker_index
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.batch_size = batch_size
        self.epoch = 0
        self.reshard = reshard
        self._progress = progress
        #: Batches still to skip (None: not learnt yet).
        self._skip: int | None = None if progress is not None else 0
        self._passes = 0  # passes over the sampler so far
        self._epoch_set = False  # set_epoch was called since the last pass

    def _client(self) -> SyncWorkerClient | None:
        source = self._progress
        if isinstance(source, ServerOptimizer):
            return source.client
        if source is None or isinstance(source, int):
            return None
        return source

    def _per_worker(self) -> int:
        if self.drop_last:
            return self.size // self.num_workers
        return -(-self.size // self.num_workers)

    def _batches_per_epoch(self) -> int:
        return -(-self._per_worker() // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s permutation (and, with ``reshard``, its live workers).
        Without a call between two passes over the sampler, the next pass is the next epoch."""
        self.epoch = epoch
        self._epoch_set = True
        self._refresh()

    def _refresh(self) -> None:
        client = self._client()
        if self.reshard and client is not None:
            status = client.status()
            names = sorted({w.worker_name for w in status.workers if w.live})
            me = client.client.worker_name
            if me in names and len(names) != self.num_workers:
                self.num_workers, self.worker_index = len(names), names.index(me)

    def _learn_progress(self) -> int:
        if self._skip is None:
            source = self._progress
            if isinstance(source, int):
                steps = source
            else:
                client = self._client()
                assert client is not None
                steps = client.progress().steps
            self._skip = steps
        return self._skip

    def _indices(self) -> list[int]:
        if self.shuffle:
            gen = torch.Generator()
            gen.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=gen).tolist()
        else:
            order = list(range(self.size))
        total = self._per_worker() * self.num_workers
        if total > len(order):  # pad by repeating the start, as DistributedSampler does
            order = (order * (-(-total // max(1, len(order)))))[:total]
        return order[:total][self.worker_index : total : self.num_workers]

    def _start(self) -> int:
        """Index into this epoch's share where this worker resumes (its length: skip all)."""
        skip = self._learn_progress()
        per_epoch = self._batches_per_epoch()
        done_epochs, done_batches = divmod(skip, per_epoch) if per_epoch else (0, 0)
        if self.epoch < done_epochs:
            return self._per_worker()
        if self.epoch == done_epochs:
            return min(self._per_worker(), done_batches * self.batch_size)
        return 0

    def __iter__(self) -> Iterator[int]:
        if self._passes and not self._epoch_set:
            self.epoch += 1
            self._refresh()
        self._passes += 1
        self._epoch_set = False
        return iter(self._indices()[self._start() :])

    def __len__(self) -> int:
        return self._per_worker() - self._start()
