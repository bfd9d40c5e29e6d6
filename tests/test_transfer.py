"""`device_tensor`: host lists as device tensors, the same values and dtypes as `torch.tensor` everywhere."""

from __future__ import annotations

import pytest
import torch

from hf_paged.transfer import device_tensor


@pytest.mark.parametrize("dtype", [None, torch.int32, torch.long])
def test_same_as_torch_tensor_on_the_cpu(dtype):
    data = [[3, 1, 4], [1, 5, 9]]
    assert torch.equal(device_tensor(data, "cpu", dtype), torch.tensor(data, dtype=dtype))
    assert device_tensor(data, None, dtype).dtype == torch.tensor(data, dtype=dtype).dtype


@pytest.mark.gpu
def test_pinned_non_blocking_copy_on_cuda_arrives_whole():
    data = list(range(100_000))
    out = device_tensor(data, "cuda", torch.int32)
    assert out.is_cuda and out.dtype == torch.int32
    assert torch.equal(out.cpu(), torch.tensor(data, dtype=torch.int32))
