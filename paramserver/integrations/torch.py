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
- Every other dtype (bool, uint8, complex, float8, ...) is refused with InvalidArgument.
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

Import every name from here. They live in :mod:`~paramserver.integrations.torch_params`
(conversions, parameters by name, :class:`TorchWorker`),
:mod:`~paramserver.integrations.torch_embedding` (the remote embedding modules) and
:mod:`~paramserver.integrations.torch_training` (:class:`ServerOptimizer`,
:class:`ShardSampler`).
"""

from __future__ import annotations

try:
    import torch  # noqa: F401  (the adapter's submodules need it; say which extra brings it)
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
from paramserver.integrations.torch_embedding import RemoteEmbedding, RemoteEmbeddingBag
from paramserver.integrations.torch_params import (
    MissingGrad,
    TorchWorker,
    gradients,
    init_from_module,
    load_parameters,
    module_parameters,
    numpy_to_tensor,
    parameter_keys,
    pull_parameters,
    push_gradients,
    tensor_to_numpy,
)
from paramserver.integrations.torch_training import ServerOptimizer, ShardSampler

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
