"""torch <-> numpy conversion of the PyTorch adapter (no server): dtypes and bits kept,
zero-copy views, refusals that name the parameter and change nothing; the missing-torch error."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from paramserver.errors import InvalidArgument  # noqa: E402
from paramserver.integrations.torch import (  # noqa: E402
    gradients,
    load_parameters,
    module_parameters,
    numpy_to_tensor,
    tensor_to_numpy,
)

pytestmark = pytest.mark.timeout(30)

PAIRS = [
    (torch.float16, np.dtype(np.float16)),
    (torch.bfloat16, np.dtype(ml_dtypes.bfloat16)),
    (torch.float32, np.dtype(np.float32)),
    (torch.float64, np.dtype(np.float64)),
    (torch.int32, np.dtype(np.int32)),
    (torch.int64, np.dtype(np.int64)),
]


@pytest.mark.parametrize(("tdtype", "ndtype"), PAIRS, ids=[str(p[0]) for p in PAIRS])
@pytest.mark.parametrize("shape", [(), (0,), (3, 4), (2, 0, 5)], ids=str)
def test_dtype_shape_and_bits_kept_both_ways(
    tdtype: torch.dtype, ndtype: np.dtype, shape: tuple[int, ...]
) -> None:
    """Random bit patterns (from numpy's generator) survive torch -> numpy -> torch."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 256, size=(*shape, ndtype.itemsize), dtype=np.uint8)
    ref = bits.view(ndtype).reshape(shape)  # the expected values, built without torch
    t = torch.from_numpy(bits.copy().view(f"<i{ndtype.itemsize}").reshape(shape))
    if tdtype.is_floating_point:
        t = t.view(tdtype)
    arr = tensor_to_numpy(t, "k")
    assert arr.dtype == ndtype
    assert arr.shape == shape
    assert arr.tobytes() == ref.tobytes()
    back = numpy_to_tensor(arr, "k")
    assert back.dtype == tdtype
    assert tuple(back.shape) == shape
    same_width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[ndtype.itemsize]
    assert torch.equal(back.view(same_width), t.view(same_width))


def test_cpu_tensors_are_viewed_not_copied() -> None:
    """A contiguous CPU tensor shares memory with its array (bfloat16 too: 2 bytes each)."""
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.zeros(4, dtype=dtype)
        arr = tensor_to_numpy(t)
        assert arr.nbytes == 4 * t.element_size()
        t[1] = 3.0
        assert float(arr[1]) == 3.0


def test_non_contiguous_tensor_is_copied_in_c_order() -> None:
    t = torch.arange(12, dtype=torch.float64).reshape(3, 4).T
    np.testing.assert_array_equal(tensor_to_numpy(t), np.arange(12.0).reshape(3, 4).T)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.complex64])
def test_unsupported_dtype_names_the_key(dtype: torch.dtype) -> None:
    with pytest.raises(InvalidArgument, match=r"tensor 'mask': unsupported torch dtype"):
        tensor_to_numpy(torch.zeros(2, dtype=dtype), "mask")


def test_keys_are_prefixed_parameter_names() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    assert list(module_parameters(net, prefix="m/")) == [
        "m/0.weight",
        "m/0.bias",
        "m/1.weight",
        "m/1.bias",
    ]
    with_buffers = module_parameters(net, buffers=True)
    assert with_buffers["1.num_batches_tracked"].dtype == np.int64
    assert with_buffers["1.running_var"].dtype == np.float32


def test_gradients_bad_policy_refused() -> None:
    with pytest.raises(InvalidArgument, match="missing_grad"):
        gradients(torch.nn.Linear(2, 2), missing_grad="ignore")  # type: ignore[arg-type]


def test_load_refuses_shape_or_missing_key_and_changes_nothing() -> None:
    net = torch.nn.Linear(3, 2)
    torch.nn.init.zeros_(net.weight)
    good_w = np.ones((2, 3), np.float32)
    with pytest.raises(InvalidArgument, match=r"'bias' is torch\.float32 \(2,\)"):
        load_parameters(net, {"weight": good_w, "bias": np.ones(3, np.float32)})
    with pytest.raises(InvalidArgument, match="no value for parameter 'bias'"):
        load_parameters(net, {"weight": good_w})
    assert torch.count_nonzero(net.weight) == 0
    load_parameters(net, {"weight": good_w}, strict=False)
    assert torch.equal(net.weight, torch.ones(2, 3))


@pytest.mark.timeout(60)
def test_missing_torch_names_the_extra() -> None:
    """Without torch, importing the adapter fails with a message naming the extra."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "try:\n"
        "    import paramserver.integrations.torch\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert "pip install 'paramserver[torch]'" in out.stdout, out.stdout + out.stderr
