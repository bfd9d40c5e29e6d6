"""The low-rank update of a compiled step's adapters as a torch custom op, `torch.ops.hf_paged.lora_delta`.

A compiled step traces every adapter hook into its graph (`AdapterSet`, `CompiledStepLora`). Traced as ATen ops,
each hooked module's two matmuls and mask become kernels inductor generates and compiles (C++ on the CPU); with 120
hooked projections in SmolLM2 that made compiling the adapters' forward take 4x the base forward's time (285 s vs
76 s), for operations inductor cannot fuse further (their operands are graph inputs, not frozen weights). As one
opaque op each, the graph calls ATen's matmuls directly; the op's fake implementation only states the shape.

Example:

```python
>>> import torch
>>> from hf_paged.adapters import ops
>>> x, a, b = torch.randn(3, 8), torch.randn(4, 8), torch.randn(6, 4)   # 3 positions; slots x rank = 4; out 6
>>> mask = torch.tensor([[1.0, 1, 0, 0], [0, 0, 1, 1], [0, 0, 0, 0]])  # position 2: the base model
>>> delta = ops.lora_delta(x, a, b, mask)
>>> delta.shape, bool(delta[2].eq(0).all())
(torch.Size([3, 6]), True)

```
"""

import torch

__all__ = ["lora_delta"]

_LIBRARY = torch.library.Library("hf_paged", "FRAGMENT")
_LIBRARY.define("lora_delta(Tensor x, Tensor a, Tensor b, Tensor mask) -> Tensor")


def _lora_delta(x, a, b, mask):
    """`((x @ a.T) * mask) @ b.T`: every position's update from its own slot's factors (`x` `[positions, in]`, `a`
    `[slots x R, in]`, `b` `[out, slots x R]`, `mask` `[positions, slots x R]`)."""
    low = x @ a.T
    low.mul_(mask)
    return low @ b.T


_LIBRARY.impl("lora_delta", _lora_delta, "CompositeExplicitAutograd")


@torch.library.register_fake("hf_paged::lora_delta", lib=_LIBRARY)
def _(x, a, b, mask):
    return x.new_empty(x.shape[0], b.shape[0])


lora_delta = torch.ops.hf_paged.lora_delta.default
