"""Host-to-device copies of the small index tensors a forward builds from Python lists (block tables, slots,
lengths), without a host synchronisation on CUDA."""

from __future__ import annotations

import torch


def device_tensor(data, device: torch.device | str | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch.tensor(data, dtype=dtype, device=device)`; on CUDA built in pinned host memory and copied with
    `non_blocking=True`, so the host does not wait for the device's queue (a plain copy from pageable memory
    synchronises the stream).

    Example:

    ```python
    >>> device_tensor([[3, 1], [2, 0]], "cpu", torch.int32)
    tensor([[3, 1],
            [2, 0]], dtype=torch.int32)

    ```
    """
    if device is None or torch.device(device).type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype).pin_memory().to(device, non_blocking=True)
