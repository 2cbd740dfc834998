"""PyTorch adapter: push a module's gradients and pull its parameters by name.

Needs the optional extra ``pip install 'paramserver[torch]'``. Keys are the names of
``module.named_parameters()`` (``"0.weight"``, ``"encoder.layer1.bias"``), optionally with a
prefix, so several modules can share one server. Usage with the async client::

    async with connect("127.0.0.1:50051", worker_name="w0") as ps:
        await init_from_module(ps, model, rule=UpdateRule("sgd", lr=0.1, momentum=0.9))
        for x, y in batches:
            await pull_parameters(ps, model)       # waits as BSP/SSP require
            model.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            await push_gradients(ps, model, num_samples=len(y))
            await ps.clock()

With the blocking :class:`~paramserver.worker_client.SyncWorkerClient` the same steps use the
synchronous helpers: ``ps.init(module_parameters(model), rule)``,
``load_parameters(model, ps.pull(parameter_keys(model)))`` and ``ps.push(gradients(model))``.

Conversion (no floating-point round trip anywhere; bit-exact both ways):

- float16, float32, float64, int32, int64 tensors become numpy arrays of the same dtype; on
  the CPU the array is a view of the tensor's memory (zero copy), valid until the tensor changes.
- bfloat16 stays 2 bytes per element: the tensor's raw bits are viewed as int16
  (``torch.Tensor.view(torch.int16)``) and the numpy array viewed back as
  ``ml_dtypes.bfloat16``, so the server stores and sends bfloat16.
- Any other dtype (bool, uint8, complex, float8, ...) is refused with InvalidArgument.
- Pulled values are copied into the parameters in place (``torch.no_grad``), so the
  parameters keep their dtype, device (CPU or CUDA), identity and any optimizer references.

Parameters with ``requires_grad=False`` (frozen) are declared and pulled but never pushed. A
trainable parameter whose ``.grad`` is None (it took no part in the loss) is refused by default
(``missing_grad="error"``, InvalidArgument naming it); ``"zeros"`` pushes a zero gradient
instead (every key keeps receiving one update per worker per step, as BSP's synchronous
aggregation expects) and ``"skip"`` leaves it out of the push.

Embedding tables (``docs/embedding-tables.md``): :class:`RemoteEmbedding` and
:class:`RemoteEmbeddingBag` are ``torch.nn.Embedding`` / ``EmbeddingBag`` whose rows live in a
server table: forward pulls the batch's unique rows, backward pushes their sparse gradients
(summed per id) for the table's server-side rule to apply. The bag takes ``per_sample_weights``,
``padding_idx`` and ``include_last_offset`` as ``torch.nn.EmbeddingBag`` does.
:class:`RemoteEmbeddingBagCollection` (:mod:`paramserver.integrations.torch_collection`) pools
many sparse features (keyed jagged ids) with one request per shard each way.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from typing import Any, Literal

import ml_dtypes
import numpy as np

from paramserver.core.optimizers import UpdateRule
from paramserver.errors import InvalidArgument, WaitTimeout
from paramserver.worker_client.client import PushAck, WorkerClient
from paramserver.worker_client.cluster import ClusterWorkerClient
from paramserver.worker_client.sync import SyncWorkerClient

try:
    import torch
except ImportError as exc:  # pragma: no cover - depends on the environment
    # (ModuleNotFoundError naming torch: callers that skip a missing optional extra see which)
    raise ModuleNotFoundError(
        "paramserver.integrations.torch needs PyTorch: pip install 'paramserver[torch]'",
        name="torch",
    ) from exc

from paramserver.integrations.torch_collection import (
    KeyedJaggedIds,
    RemoteBagTable,
    RemoteEmbeddingBagCollection,
)

__all__ = [
    "KeyedJaggedIds",
    "MissingGrad",
    "RemoteBagTable",
    "RemoteEmbedding",
    "RemoteEmbeddingBag",
    "RemoteEmbeddingBagCollection",
    "ServerOptimizer",
    "ShardSampler",
    "TorchWorker",
    "gradients",
    "init_from_module",
    "load_parameters",
    "module_parameters",
    "numpy_to_tensor",
    "parameter_keys",
    "pull_parameters",
    "push_gradients",
    "tensor_to_numpy",
]

MissingGrad = Literal["error", "zeros", "skip"]

#: torch dtype -> numpy dtype of the same width and bits (bfloat16 via its int16 bit pattern).
_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
}


def _supported() -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in _NUMPY_DTYPES)


def tensor_to_numpy(value: torch.Tensor, key: str = "") -> np.ndarray:
    """The tensor's values as a numpy array of the same dtype and shape, bit for bit.

    A contiguous CPU tensor is viewed, not copied (bfloat16 included: its bits are viewed as
    int16, then as ``ml_dtypes.bfloat16``); a CUDA or non-contiguous tensor is copied once.

    Args:
        value: A tensor of dtype float16, bfloat16, float32, float64, int32 or int64, on any
            device, any shape (``()`` and zero-size included).
        key: Parameter key, named in errors.

    Returns:
        ndarray of the matching numpy dtype (``ml_dtypes.bfloat16`` for bfloat16), same shape.

    Raises:
        InvalidArgument: any other dtype (INVALID_ARGUMENT).
    """
    np_dtype = _NUMPY_DTYPES.get(value.dtype)
    if np_dtype is None:
        raise InvalidArgument(
            f"tensor {key!r}: unsupported torch dtype {value.dtype}; supported: {_supported()}"
        )
    flat = value.detach().cpu().contiguous()
    if value.dtype == torch.bfloat16:
        # numpy has no bfloat16: move the raw 16-bit patterns, never the values.
        return flat.view(torch.int16).numpy().view(np_dtype)
    out: np.ndarray = flat.numpy()
    return out


def numpy_to_tensor(array: np.ndarray, key: str = "") -> torch.Tensor:
    """A CPU tensor viewing ``array``'s memory (same dtype, shape and bits; bfloat16 kept).

    Raises:
        InvalidArgument: a dtype other than float16, bfloat16, float32, float64, int32, int64
            (INVALID_ARGUMENT).
    """
    arr = np.asarray(array)
    if not (arr.flags.c_contiguous and arr.flags.writeable):  # as torch.from_numpy wants
        arr = arr.copy(order="C")  # (not ascontiguousarray: it turns shape () into (1,))
    if arr.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    if arr.dtype not in _NUMPY_DTYPES.values():
        raise InvalidArgument(f"tensor {key!r}: unsupported numpy dtype {arr.dtype}")
    return torch.from_numpy(arr)


def _named(
    module: torch.nn.Module, prefix: str, buffers: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, param in module.named_parameters():
        yield prefix + name, param
    if buffers:
        for name, buf in module.named_buffers():
            yield prefix + name, buf


def parameter_keys(
    module: torch.nn.Module, *, prefix: str = "", buffers: bool = False
) -> list[str]:
    """Server keys of the module's parameters (and buffers): ``prefix + name``."""
    return [key for key, _ in _named(module, prefix, buffers)]


def module_parameters(
    module: torch.nn.Module, *, prefix: str = "", buffers: bool = False
) -> dict[str, np.ndarray]:
    """``prefix + name`` -> the parameter's values (see :func:`tensor_to_numpy`).

    Args:
        module: Any ``torch.nn.Module``.
        prefix: Prepended to every parameter name.
        buffers: Include ``named_buffers()`` too (e.g. BatchNorm running statistics).

    Raises:
        InvalidArgument: a parameter of an unsupported dtype (INVALID_ARGUMENT).
    """
    return {key: tensor_to_numpy(value, key) for key, value in _named(module, prefix, buffers)}


def gradients(
    module: torch.nn.Module, *, prefix: str = "", missing_grad: MissingGrad = "error"
) -> dict[str, np.ndarray]:
    """``prefix + name`` -> the ``.grad`` of every trainable parameter, in its own dtype.

    Frozen parameters (``requires_grad=False``) are left out.

    Args:
        module: A module after ``backward()``.
        prefix: Prepended to every parameter name.
        missing_grad: What to do with a trainable parameter whose ``.grad`` is None:
            ``"error"`` (raise), ``"zeros"`` (a zero gradient) or ``"skip"`` (leave it out).

    Raises:
        InvalidArgument: a trainable parameter without a gradient under ``"error"``, or an
            unsupported dtype (INVALID_ARGUMENT).
    """
    if missing_grad not in ("error", "zeros", "skip"):
        raise InvalidArgument(f"missing_grad must be error, zeros or skip, got {missing_grad!r}")
    out: dict[str, np.ndarray] = {}
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        key = prefix + name
        grad = param.grad
        if grad is None:
            if missing_grad == "error":
                raise InvalidArgument(
                    f"parameter {key!r} has no gradient (.grad is None: it took no part in the "
                    f"loss, or backward() was not called); pass missing_grad='zeros' or 'skip', "
                    f"or freeze it with requires_grad_(False)"
                )
            if missing_grad == "skip":
                continue
            grad = torch.zeros_like(param)
        if grad.is_sparse:
            grad = grad.to_dense()
        out[key] = tensor_to_numpy(grad, key)
    return out


def load_parameters(
    module: torch.nn.Module,
    values: Mapping[str, np.ndarray],
    *,
    prefix: str = "",
    buffers: bool = False,
    strict: bool = True,
) -> None:
    """Copy ``values`` into the module's parameters (and buffers) in place.

    Every value is checked before any is copied, so a refusal changes nothing. Each tensor keeps
    its dtype, device and identity (``Tensor.copy_`` under ``torch.no_grad``).

    Args:
        module: The module to update.
        values: ``prefix + name`` -> array of the parameter's exact dtype and shape.
        prefix: Prepended to every parameter name.
        buffers: Load ``named_buffers()`` too.
        strict: Require a value for every parameter (and buffer); otherwise missing ones are
            left as they are. Keys in ``values`` that name no parameter are always ignored.

    Raises:
        InvalidArgument: a missing key under ``strict``, or a dtype or shape that differs from
            the parameter's (INVALID_ARGUMENT); nothing is copied then.
    """
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for key, target in _named(module, prefix, buffers):
        if key not in values:
            if strict:
                raise InvalidArgument(f"no value for parameter {key!r} (pulled keys lack it)")
            continue
        src = numpy_to_tensor(values[key], key)
        if src.dtype != target.dtype or tuple(src.shape) != tuple(target.shape):
            raise InvalidArgument(
                f"parameter {key!r} is {target.dtype} {tuple(target.shape)} but the server "
                f"holds {src.dtype} {tuple(src.shape)}"
            )
        pairs.append((target, src))
    with torch.no_grad():
        for target, src in pairs:
            target.copy_(src)


async def init_from_module(
    client: WorkerClient | ClusterWorkerClient,
    module: torch.nn.Module,
    rule: UpdateRule | None = None,
    *,
    prefix: str = "",
    buffers: bool = False,
    load: bool = True,
) -> list[str]:
    """Declare every parameter (and buffer) of ``module`` on the server; first writer wins.

    Args:
        client: A connected worker session.
        module: Its current values are the initial values.
        rule: Server-side update rule of the parameters (default plain SGD).
        prefix: Prepended to every parameter name.
        buffers: Declare ``named_buffers()`` too, with the ``assign`` rule (integer buffers
            such as ``num_batches_tracked`` take no optimizer); they are pulled, never pushed
            by :func:`push_gradients`.
        load: Copy the stored values back into ``module``, so every worker starts from the
            first writer's values.

    Returns:
        The declared keys, in ``named_parameters()`` (then ``named_buffers()``) order.

    Raises:
        InvalidArgument: an unsupported dtype or a bad rule (INVALID_ARGUMENT).
    """
    values = module_parameters(module, prefix=prefix)
    stored = await client.init(values, rule=rule)
    if buffers:
        buffer_values = {
            prefix + name: tensor_to_numpy(buf, prefix + name)
            for name, buf in module.named_buffers()
        }
        if buffer_values:
            stored.update(await client.init(buffer_values, rule=UpdateRule("assign")))
            values.update(buffer_values)
    if load:
        load_parameters(module, stored, prefix=prefix, buffers=buffers)
    return list(values)


async def push_gradients(
    client: WorkerClient | ClusterWorkerClient,
    module: torch.nn.Module,
    *,
    prefix: str = "",
    num_samples: int = 1,
    missing_grad: MissingGrad = "error",
) -> PushAck:
    """Push every trainable parameter's ``.grad`` under its name (see :func:`gradients`).

    Raises:
        InvalidArgument: a missing gradient under ``missing_grad="error"``, or the server
            refused a dtype/shape or a non-finite value (INVALID_ARGUMENT); the errors of
            :meth:`WorkerClient.push` otherwise.
    """
    grads = gradients(module, prefix=prefix, missing_grad=missing_grad)
    return await client.push(grads, num_samples=num_samples)


async def pull_parameters(
    client: WorkerClient | ClusterWorkerClient,
    module: torch.nn.Module,
    *,
    prefix: str = "",
    buffers: bool = False,
    timeout_s: float | None = None,
) -> None:
    """Pull the module's keys (waiting as BSP/SSP require) and copy them in place.

    Raises:
        KeyNotFound (NOT_FOUND) for an undeclared key; InvalidArgument (INVALID_ARGUMENT) when
        the server's dtype or shape differs from the parameter's (nothing copied); the errors
        of :meth:`WorkerClient.pull` otherwise.
    """
    keys = parameter_keys(module, prefix=prefix, buffers=buffers)
    values = await client.pull(keys, timeout_s=timeout_s)
    load_parameters(module, values, prefix=prefix, buffers=buffers)


class TorchWorker:
    """One module bound to one worker session: ``init`` once, then ``pull`` / ``push`` / ``clock``.

    Args:
        client: A connected worker session.
        module: The model; its parameters are updated in place by :meth:`pull`.
        prefix: Prepended to every parameter name.
        buffers: Declare and pull buffers too.
        missing_grad: See :func:`gradients`.
    """

    def __init__(
        self,
        client: WorkerClient | ClusterWorkerClient,
        module: torch.nn.Module,
        *,
        prefix: str = "",
        buffers: bool = False,
        missing_grad: MissingGrad = "error",
    ) -> None:
        self.client = client
        self.module = module
        self.prefix = prefix
        self.buffers = buffers
        self.missing_grad: MissingGrad = missing_grad

    async def init(self, rule: UpdateRule | None = None) -> list[str]:
        """:func:`init_from_module`; returns the declared keys."""
        return await init_from_module(
            self.client, self.module, rule, prefix=self.prefix, buffers=self.buffers
        )

    async def pull(self, *, timeout_s: float | None = None) -> None:
        """:func:`pull_parameters` into the module."""
        await pull_parameters(
            self.client, self.module, prefix=self.prefix, buffers=self.buffers, timeout_s=timeout_s
        )

    async def push(self, *, num_samples: int = 1) -> PushAck:
        """:func:`push_gradients` of the module."""
        return await push_gradients(
            self.client,
            self.module,
            prefix=self.prefix,
            num_samples=num_samples,
            missing_grad=self.missing_grad,
        )

    async def clock(self) -> int:
        """End the iteration (:meth:`WorkerClient.clock`); returns the new clock."""
        return await self.client.clock()


# ------------------------------------------------------------------------------ embeddings
class _RemoteRows(torch.nn.Module):
    """Shared machinery of :class:`RemoteEmbedding` and :class:`RemoteEmbeddingBag`.

    Forward pulls the batch's unique rows (``torch.unique``) as a leaf tensor of shape
    (n_unique, dim); backward delivers that leaf's gradient, the sparse gradient of the table
    already summed per id, and pushes it with ``push_rows``. With a blocking client
    (:class:`~paramserver.worker_client.SyncWorkerClient`) both happen inside ``forward`` /
    ``backward``. With the async client, ``await module.prefetch(ids)`` before forward and
    ``await module.push_pending()`` after backward (forward then reads the prefetched rows).
    """

    def __init__(
        self, client: Any, table: str, dim: int, *, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.client = client
        self.table = table
        self.dim = dim
        self.dtype = dtype
        #: An id whose row is never pulled, read or pushed (the bag's ``padding_idx``).
        self._skip_id: int | None = None
        self._async = inspect.iscoroutinefunction(getattr(client, "pull_rows", None))
        self._prefetched: tuple[np.ndarray, np.ndarray] | None = None
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []

    async def prefetch(self, ids: torch.Tensor | np.ndarray) -> None:
        """Pull the unique rows of ``ids`` (async client) for the next forward."""
        uniq = np.unique(np.asarray(ids, dtype=np.int64).reshape(-1))
        if self._skip_id is not None:
            uniq = uniq[uniq != self._skip_id]
        rows = await self.client.pull_rows(self.table, uniq)
        self._prefetched = (uniq, np.asarray(rows))

    async def push_pending(self) -> list[Any]:
        """Push the row gradients the last backward passes produced (async client)."""
        pending, self._pending = self._pending, []
        return [await self.client.push_rows(self.table, u, g) for u, g in pending]

    def _local(self, ids: torch.Tensor) -> tuple[np.ndarray, torch.Tensor, int | None]:
        """The batch's distinct ids (int64 (m,), ascending), ``ids`` as positions among them
        (``ids``' shape), and the position of the skipped id (None when absent)."""
        flat = ids.reshape(-1).to(torch.int64).cpu()
        uniq_t, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        uniq = uniq_t.numpy()
        skip = None
        if self._skip_id is not None:
            at = int(np.searchsorted(uniq, self._skip_id))
            if at < uniq.shape[0] and int(uniq[at]) == self._skip_id:
                skip = at
        return uniq, inverse.reshape(ids.shape), skip

    def _weight(self, uniq: np.ndarray, skip: int | None) -> torch.Tensor:
        """The rows of ``uniq`` as a leaf tensor (m, dim) whose gradient is pushed; the row at
        position ``skip`` is zeros, neither pulled nor pushed."""
        fetch = uniq if skip is None else np.delete(uniq, skip)
        if self._async:
            cached = self._prefetched
            if cached is None or not np.isin(fetch, cached[0], assume_unique=True).all():
                raise InvalidArgument(
                    f"table {self.table!r}: with an async client, await prefetch(ids) before "
                    "forward (the forward's ids were not prefetched)"
                )
            rows = cached[1][np.searchsorted(cached[0], fetch)]
        else:
            rows = np.asarray(self.client.pull_rows(self.table, fetch))
        rows = rows.astype(np.float32)
        if skip is not None:
            rows = np.insert(rows, skip, 0.0, axis=0)
        weight = torch.from_numpy(np.ascontiguousarray(rows)).to(self.dtype)
        if torch.is_grad_enabled():
            weight.requires_grad_(True)
            weight.register_hook(lambda g: self._on_grad(fetch, skip, g))  # type: ignore[no-untyped-call]
        return weight

    def _rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        uniq, local, skip = self._local(ids)
        return self._weight(uniq, skip), local

    def _on_grad(self, fetch: np.ndarray, skip: int | None, grad: torch.Tensor) -> None:
        g = grad.detach().to(torch.float32).cpu().numpy()
        if skip is not None:
            g = np.delete(g, skip, axis=0)
            if fetch.shape[0] == 0:  # only the skipped id: nothing to push
                return
        g = np.ascontiguousarray(g)
        if self._async:
            self._pending.append((fetch, g))
        else:
            self.client.push_rows(self.table, fetch, g)


class RemoteEmbedding(_RemoteRows):
    """``torch.nn.Embedding`` whose table lives on the parameter server.

    Args:
        client: A blocking client (``connect_sync``) or the async client (then use
            :meth:`prefetch` / :meth:`push_pending`).
        table: Table name (declared with ``init_table``; its rule updates the rows).
        dim: Row width.
        dtype: dtype of the rows handed to the model (the table's storage dtype is its own).

    Forward: ``ids`` int64 tensor of any shape -> ``ids.shape + (dim,)``.
    """

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        weight, local = self._rows(ids)
        return torch.nn.functional.embedding(local, weight)


class RemoteEmbeddingBag(_RemoteRows):
    """``torch.nn.EmbeddingBag`` (``sum`` / ``mean``) whose table lives on the parameter server.

    Args:
        client, table, dim, dtype: As :class:`RemoteEmbedding`.
        mode: ``"sum"`` or ``"mean"``.
        include_last_offset: As ``torch.nn.EmbeddingBag``: ``offsets`` has one more element,
            the end of the last bag (the CSR format).
        padding_idx: An id (>= 0) whose entries do not contribute to their bag (a ``mean``
            bag does not count them; a bag of padding only gives zeros) and whose row gets no
            gradient, as ``torch.nn.EmbeddingBag``'s ``padding_idx``. Its row is never pulled
            or pushed, so the server neither stores it nor advances its optimizer state.
            Negative values (counted from ``num_embeddings`` in torch) are refused: the module
            does not know the table's size.

    Forward ``(input, offsets=None, per_sample_weights=None)`` as ``torch.nn.EmbeddingBag``:
    ``input`` 1-D int64 ids with ``offsets`` (bag starts, 1-D, ``offsets[0] == 0``) ->
    (bags, dim); or ``input`` 2-D (bags of equal length) with ``offsets=None``.
    ``per_sample_weights`` (``input``'s shape, the module's ``dtype``) scales each entry before
    the sum (``mode="sum"`` only). Semantics of ``torch.nn.functional.embedding_bag``; empty
    bags give zeros. Torch checks the arguments (on a one-column stand-in of the rows) before
    any row is pulled, so a call torch refuses raises torch's own error (NotImplementedError
    for ``per_sample_weights`` with ``mode="mean"``, ValueError for a wrong shape) and touches
    no server.

    Raises:
        InvalidArgument: a mode other than ``sum``/``mean``, or a negative or non-integer
            ``padding_idx`` (INVALID_ARGUMENT).
    """

    def __init__(
        self,
        client: Any,
        table: str,
        dim: int,
        *,
        mode: str = "mean",
        dtype: torch.dtype = torch.float32,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
    ) -> None:
        if mode not in ("sum", "mean"):
            raise InvalidArgument(f"RemoteEmbeddingBag mode must be 'sum' or 'mean', got {mode!r}")
        if padding_idx is not None and (
            isinstance(padding_idx, bool) or not isinstance(padding_idx, int) or padding_idx < 0
        ):
            raise InvalidArgument(
                f"RemoteEmbeddingBag padding_idx must be an id >= 0 or None, got {padding_idx!r}"
            )
        super().__init__(client, table, dim, dtype=dtype)
        self.mode = mode
        self.include_last_offset = include_last_offset
        self.padding_idx = padding_idx
        self._skip_id = padding_idx

    def forward(
        self,
        input: torch.Tensor,  # torch.nn.EmbeddingBag.forward's name
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        uniq, local, skip = self._local(input)

        def bag(weight: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.embedding_bag(
                local,
                weight,
                offsets,
                mode=self.mode,
                per_sample_weights=per_sample_weights,
                include_last_offset=self.include_last_offset,
                padding_idx=skip,
            )

        with torch.no_grad():  # torch's own argument checks, before any row is pulled
            bag(torch.zeros((uniq.shape[0], 1), dtype=self.dtype))
        return bag(self._weight(uniq, skip))


# ------------------------------------------------------------------------------ training loop
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
        **rule_args: Any,
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
        self._hooks: list[Any] = []
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
    def _hook_for(self, key: str) -> Any:
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
        out: dict[str, np.ndarray] = {}
        for key, tensor in self._named:
            if not tensor.requires_grad or key in pushed:
                continue
            grad = tensor.grad
            if grad is None:
                if self.missing_grad == "error":
                    raise InvalidArgument(
                        f"parameter {key!r} has no gradient (.grad is None: it took no part "
                        "in the loss, or backward() was not called); pass missing_grad='zeros' "
                        "or 'skip', or freeze it with requires_grad_(False)"
                    )
                if self.missing_grad == "skip":
                    continue
                grad = torch.zeros_like(tensor)
            if grad.is_sparse:
                grad = grad.to_dense()
            out[key] = tensor_to_numpy(grad, key)
        return out

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

    def state_dict(self) -> dict[str, Any]:
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

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
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
        dataset: Any sized dataset (only ``len(dataset)`` is used).
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
