"""The paged attention and the K/V write as torch custom ops, so `torch.compile` can trace a step through them.

`torch.ops.hf_paged.paged_attention` is `kernels.paged_attention` (every backend behind its `backend` argument) and
`torch.ops.hf_paged.write_kv` stores new tokens' K/V into their slots of a layer's blocks, in place. Each has a fake
(meta) implementation that only states the output's shape, so a compiled graph holds each as one opaque node: no
graph break at the attention (the CPU kernel is a ctypes call, which Dynamo cannot trace) and no recompilation when
the number of tokens changes (see `mark_varying`). Blocks stored unquantized only: quantized pages (codes and
scales) are not tensors of one shape these ops take. Importing this module registers the ops.

Example:

```python
>>> import torch
>>> from hf_paged.kernels import ops
>>> key_cache, value_cache = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
>>> keys, values = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
>>> ops.write_kv(key_cache, value_cache, torch.tensor([32, 33, 34]), keys, values)   # block 2, slots 0-2
>>> out = ops.paged_attention(
...     torch.randn(3, 4, 8), key_cache, value_cache,
...     block_tables=torch.tensor([[2]], dtype=torch.int32), seq_lens=torch.tensor([3], dtype=torch.int32),
...     query_start=torch.tensor([0, 3], dtype=torch.int32), scale=8**-0.5, backend="gather",
... )
>>> out.shape, torch.equal(key_cache[2, :3], keys)
(torch.Size([3, 4, 8]), True)

```
"""

import torch

from . import paged_attention as dispatch

__all__ = ["mark_varying", "paged_attention", "write_kv"]


# Defined with the low-level `torch.library.Library` API rather than `torch.library.custom_op`: the latter wraps every
# call in Python layers (autograd, in-place bookkeeping, default filling) that cost a compiled decode step of
# SmolLM2's 30 layers about 2 ms on the CPU. Neither op has a backward (inference only).
_LIBRARY = torch.library.Library("hf_paged", "DEF")
_LIBRARY.define(
    "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
    "Tensor query_start, float scale, int? window=None, float? softcap=None, Tensor? sinks=None, "
    "str backend='auto') -> Tensor"
)
_LIBRARY.define(
    "write_kv(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slots, Tensor keys, Tensor values) -> ()"
)


def _paged_attention(
    query, key_cache, value_cache, block_tables, seq_lens, query_start, scale, window=None, softcap=None, sinks=None,
    backend="auto",
):  # fmt: skip
    """`kernels.paged_attention` as the op `hf_paged::paged_attention` (same arguments, its `kernel` named
    `backend`, a name inductor's lowering keeps for itself; a new tensor)."""
    out = dispatch(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start,
        scale=scale,
        window=window,
        softcap=softcap,
        sinks=sinks,
        kernel=backend,
    )
    return out if out.is_contiguous() else out.contiguous()


def _write_kv(key_cache, value_cache, slots, keys, values) -> None:
    """Store `keys[i]` and `values[i]` (`[tokens, kv_heads, head_dim]`) in slot `slots[i]` (block id x block size +
    offset) of `key_cache` and `value_cache` (`[num_blocks, block_size, kv_heads, head_dim]`), in place."""
    key_cache.view(-1, *keys.shape[1:]).index_copy_(0, slots, keys.to(key_cache.dtype))
    value_cache.view(-1, *values.shape[1:]).index_copy_(0, slots, values.to(value_cache.dtype))


_LIBRARY.impl("paged_attention", _paged_attention, "CompositeExplicitAutograd")
_LIBRARY.impl("write_kv", _write_kv, "CompositeExplicitAutograd")


@torch.library.register_fake("hf_paged::paged_attention", lib=_LIBRARY)
def _(
    query, key_cache, value_cache, block_tables, seq_lens, query_start, scale, window=None, softcap=None, sinks=None,
    backend="auto",
):  # fmt: skip
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@torch.library.register_fake("hf_paged::write_kv", lib=_LIBRARY)
def _(key_cache, value_cache, slots, keys, values) -> None:
    return None


paged_attention = torch.ops.hf_paged.paged_attention.default
write_kv = torch.ops.hf_paged.write_kv.default


def mark_varying(*tensor_dims: tuple[torch.Tensor, tuple[int, ...]]) -> None:
    """Mark the dimensions of a step's tensors that change from step to step (tokens, rows, block-table width) as
    sizes a compiled graph takes as inputs, 0 and 1 included: `torch.compile` would otherwise specialize on sizes 0
    and 1 and on sizes that happen to be equal in its first call, and compile again when they change.

    Example: `mark_varying((query, (0,)), (block_tables, (0, 1)))` before calling a function compiled with
    `fullgraph=True, dynamic=False`.
    """
    from torch._dynamo.decorators import mark_unbacked

    for tensor, dims in tensor_dims:
        for dim in dims:
            mark_unbacked(tensor, dim)
