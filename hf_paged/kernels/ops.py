"""The paged attention and the K/V write as torch custom ops, so `torch.compile` can trace a step through them.

`torch.ops.hf_paged.paged_attention` is `kernels.paged_attention` (every backend behind its `backend` argument) and
`torch.ops.hf_paged.write_kv` stores new tokens' K/V into their slots of a layer's blocks, in place. Each has a fake
(meta) implementation that only states the output's shape, so a compiled graph holds each as one opaque node: no
graph break at the attention (the CPU kernel is a ctypes call, which Dynamo cannot trace) and no recompilation when
the number of tokens changes (see `mark_varying`). Quantized pages (`kv_dtype="int8"`/`"int4"`) have ops of their
own, `paged_attention_quantized` and `write_kv_quantized`, which take each cache as its codes and scales and the
format's name (the same quantization and kernels as eager steps). Pages with keys per channel (`"int4-channel"`)
have `paged_attention_staged` and `write_kv_staged`, which take a layer's lane as its one byte tensor of rows with
the pool's companion tables and read it through `StagedKVStorage.over_lane` (CPU steps: the write that fills a block
decides on the host which blocks to quantize). Importing this module registers the ops. On the CPU,
`native_ops.load()` replaces the Python implementation of the plain and quantized ops with C++ (the same results);
`paged_attention_any`, `paged_attention_quantized_any` and `write_kv_quantized_any` keep the Python one for the calls
the C++ side passes on.

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

from ..kv_format import QuantizedPages, hadamard, kv_format
from ..staged_storage import StagedKVStorage, StagedPages
from . import paged_attention as dispatch

__all__ = [
    "mark_varying",
    "paged_attention",
    "paged_attention_quantized",
    "paged_attention_staged",
    "write_kv",
    "write_kv_quantized",
    "write_kv_staged",
]


# Defined with the low-level `torch.library.Library` API rather than `torch.library.custom_op`: the latter wraps every
# call in Python layers (autograd, in-place bookkeeping, default filling) that cost a compiled decode step of
# SmolLM2's 30 layers about 2 ms on the CPU. Neither op has a backward (inference only).
_LIBRARY = torch.library.Library("hf_paged", "DEF")
_SCHEMAS = {  # name -> arguments and returns
    "paged_attention": "(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
    "Tensor query_start, float scale, int? window=None, float? softcap=None, Tensor? sinks=None, "
    "str backend='auto') -> Tensor",
    "write_kv": "(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slots, Tensor keys, Tensor values) -> ()",
    "paged_attention_quantized": "(Tensor query, Tensor key_codes, Tensor key_scales, Tensor value_codes, "
    "Tensor value_scales, Tensor block_tables, Tensor seq_lens, Tensor query_start, float scale, str kv_dtype, "
    "int? window=None, float? softcap=None, Tensor? sinks=None, str backend='auto') -> Tensor",
    "write_kv_quantized": "(Tensor(a!) key_codes, Tensor(b!) key_scales, Tensor(c!) value_codes, "
    "Tensor(d!) value_scales, Tensor slots, Tensor keys, Tensor values, str kv_dtype) -> ()",
    "paged_attention_staged": "(Tensor query, Tensor rows, Tensor stage_tables, int block_size, int kv_heads, "
    "Tensor block_tables, Tensor seq_lens, Tensor query_start, float scale, int? window=None, float? softcap=None, "
    "Tensor? sinks=None, str backend='auto') -> Tensor",
    "write_kv_staged": "(Tensor(a!) rows, Tensor stage_tables, int block_size, Tensor slots, Tensor keys, "
    "Tensor values) -> ()",
}
# The ops whose CPU implementation in C++ (`native_ops`) passes the calls it does not take on to a twin
# `<name>_any`: the same schema, the Python implementation only.
_PASSED_ON = ("paged_attention", "paged_attention_quantized", "write_kv_quantized")
for _name, _schema in _SCHEMAS.items():
    _LIBRARY.define(_name + _schema)
for _name in _PASSED_ON:
    _LIBRARY.define(f"{_name}_any{_SCHEMAS[_name]}")
_LIBRARY.define("hadamard_of(Tensor x) -> Tensor")  # `kv_format.hadamard`, asked for by the C++ ops per head dim


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


def _paged_attention_quantized(
    query, key_codes, key_scales, value_codes, value_scales, block_tables, seq_lens, query_start, scale, kv_dtype,
    window=None, softcap=None, sinks=None, backend="auto",
):  # fmt: skip
    """`hf_paged::paged_attention` over quantized pages (`kv_format`): each cache given as its codes and scales,
    read back in `query`'s dtype."""
    fmt = kv_format(kv_dtype)
    key_cache = QuantizedPages(fmt, key_codes, key_scales, query.dtype)
    value_cache = QuantizedPages(fmt, value_codes, value_scales, query.dtype)
    return _paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start, scale, window, softcap, sinks, backend
    )


def _write_kv_quantized(key_codes, key_scales, value_codes, value_scales, slots, keys, values, kv_dtype) -> None:
    """`hf_paged::write_kv` into quantized pages: every token's K and V quantized on its own and stored with its
    scale in slot `slots[i]` (`KVFormat.store`, as `KVStorage.write` does)."""
    fmt = kv_format(kv_dtype)
    fmt.store(keys, key_codes, key_scales, slots)
    fmt.store(values, value_codes, value_scales, slots)


def _paged_attention_staged(
    query, rows, stage_tables, block_size, kv_heads, block_tables, seq_lens, query_start, scale, window=None,
    softcap=None, sinks=None, backend="auto",
):  # fmt: skip
    """`hf_paged::paged_attention` over pages with keys per channel: `rows` is the layer's lane
    (`StagedKVStorage.raw[lane]`, keys in `query`'s dtype while staged) and `stage_tables` the pool's companion
    tables, read as `StagedPages`."""
    storage = StagedKVStorage.over_lane(rows, stage_tables, block_size, kv_heads, query.shape[-1], query.dtype)
    key_cache, value_cache = StagedPages(storage, 0, "keys"), StagedPages(storage, 0, "values")
    return _paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start, scale, window, softcap, sinks, backend
    )


def _write_kv_staged(rows, stage_tables, block_size, slots, keys, values) -> None:
    """`hf_paged::write_kv` into pages with keys per channel (`StagedKVStorage.write_lane`: values quantized, keys
    into their open block's companions, the keys of every block the write fills quantized per channel)."""
    _, heads, head_dim = keys.shape
    storage = StagedKVStorage.over_lane(rows, stage_tables, block_size, heads, head_dim, keys.dtype)
    storage.write_lane(0, slots, keys, values.to(keys.dtype))


PYTHON_IMPLEMENTATIONS = {  # every op's Python implementation (`native_ops` replaces some on the CPU)
    "paged_attention": _paged_attention,
    "write_kv": _write_kv,
    "paged_attention_quantized": _paged_attention_quantized,
    "write_kv_quantized": _write_kv_quantized,
    "paged_attention_staged": _paged_attention_staged,
    "write_kv_staged": _write_kv_staged,
}
for _name, _implementation in PYTHON_IMPLEMENTATIONS.items():
    _LIBRARY.impl(_name, _implementation, "CompositeExplicitAutograd")
    if _name in _PASSED_ON:
        _LIBRARY.impl(f"{_name}_any", _implementation, "CompositeExplicitAutograd")
_LIBRARY.impl("hadamard_of", lambda x: hadamard(x.shape[-1], x.device), "CompositeExplicitAutograd")


def _fake_attention(query, *args, **kwargs) -> torch.Tensor:
    """Every attention op's fake implementation: a new tensor shaped and typed as the query."""
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def _fake_write(*args, **kwargs) -> None:
    """Every write op's fake implementation: nothing returned (they write into their caches, as their schemas say)."""


for _name in (*_SCHEMAS, *(f"{name}_any" for name in _PASSED_ON)):
    _fake = _fake_attention if _name.startswith("paged_attention") else _fake_write
    torch.library.register_fake(f"hf_paged::{_name}", _fake, lib=_LIBRARY)


paged_attention = torch.ops.hf_paged.paged_attention.default
paged_attention_any = torch.ops.hf_paged.paged_attention_any.default
write_kv = torch.ops.hf_paged.write_kv.default
paged_attention_quantized = torch.ops.hf_paged.paged_attention_quantized.default
paged_attention_quantized_any = torch.ops.hf_paged.paged_attention_quantized_any.default
write_kv_quantized_any = torch.ops.hf_paged.write_kv_quantized_any.default
write_kv_quantized = torch.ops.hf_paged.write_kv_quantized.default
paged_attention_staged = torch.ops.hf_paged.paged_attention_staged.default
write_kv_staged = torch.ops.hf_paged.write_kv_staged.default


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
