"""Tensors and module parameters by name: the conversions and helpers of the torch adapter.

The user-facing reference is :mod:`paramserver.integrations.torch`, which re-exports every
public name here: the bit-exact tensor <-> numpy conversions, a module's parameters and
gradients keyed by ``prefix + name``, the async helpers that declare, push and pull them, and
:class:`TorchWorker`, which binds one module to one worker session.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Literal

import ml_dtypes
import numpy as np
import torch

from paramserver.core.optimizers import UpdateRule
from paramserver.errors import InvalidArgument
from paramserver.worker_client.client import PushAck, WorkerClient
from paramserver.worker_client.cluster import ClusterWorkerClient

__all__ = [
    "MissingGrad",
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
        module: A ``torch.nn.Module``.
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
    named = ((prefix + name, param) for name, param in module.named_parameters())
    return named_gradients(named, missing_grad)


def named_gradients(
    named: Iterable[tuple[str, torch.Tensor]], missing_grad: MissingGrad
) -> dict[str, np.ndarray]:
    """``key`` -> the ``.grad`` of every trainable tensor of ``named``, in its own dtype
    (:func:`gradients` of a module's parameters; ``ServerOptimizer``'s of its own).

    Raises:
        InvalidArgument: a trainable tensor without a gradient under ``"error"``, or an
            unsupported dtype (INVALID_ARGUMENT).
    """
    out: dict[str, np.ndarray] = {}
    for key, param in named:
        if not param.requires_grad:
            continue
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
