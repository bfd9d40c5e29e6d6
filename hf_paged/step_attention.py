"""The attention of a compiled step: `"hf_paged_step"`, which takes every paged tensor of the step as an argument.

`paged_attention_forward` (`"hf_paged"`) finds its cache through a per-thread binding and asks the running
`ForwardBatch` where each layer's K/V lie: host-side Python that `torch.compile` would guard on and compile again for
every step. A compiled step instead hands the model one `StepTensors` as the keyword argument `hf_paged_step`, which
transformers' decoder models pass down to their attention function: each layer stores its new K/V into their planned
slots (`torch.ops.hf_paged.write_kv`) and attends through the block tables (`torch.ops.hf_paged.paged_attention`).
Both ops are opaque nodes of the compiled graph; everything else the forward does (embeddings, norms, rotary,
matmuls) is traced and compiled. No mask is built: `"hf_paged_step"` has no mask function, so transformers skips
mask creation, and the kernel applies each row's causal window from `seq_lens` and `query_start`.

Example:

```python
>>> import torch
>>> from hf_paged.reference_models import tiny_model
>>> from hf_paged.step_attention import STEP_ATTENTION_NAME, StepTensors, register_step_attention
>>> model = tiny_model("llama")
>>> layers, shape = model.config.num_hidden_layers, (8, 4, model.config.num_key_value_heads, model.config.head_dim)
>>> blocks = tuple((torch.zeros(shape), torch.zeros(shape)) for _ in range(layers))  # 8 blocks of 4 tokens
>>> step = StepTensors(  # one row of 3 new tokens, in block 5
...     kv=blocks, slots=(torch.tensor([20, 21, 22]),), block_tables=(torch.tensor([[5]], dtype=torch.int32),),
...     seq_lens=(torch.tensor([3], dtype=torch.int32),), query_start=torch.tensor([0, 3], dtype=torch.int32),
...     group_of=(0,) * layers, windows=(None,) * layers, kernel="gather",
... )
>>> ids = torch.tensor([[5, 6, 7]])
>>> register_step_attention()
>>> model.set_attn_implementation(STEP_ATTENTION_NAME)
>>> with torch.no_grad():
...     paged = model(input_ids=ids, position_ids=torch.arange(3)[None], use_cache=False, hf_paged_step=step).logits
>>> model.set_attn_implementation("sdpa")
>>> with torch.no_grad():
...     stock = model(input_ids=ids).logits
>>> torch.allclose(paged, stock, atol=1e-5)
True

```
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from .kernels import native_ops, ops
from .kv_format import FORMATS

STEP_ATTENTION_NAME = "hf_paged_step"
_calls: list[int] | None = None  # while set (eagerly, by the step runner's first step): every layer that attends

__all__ = [
    "STEP_ATTENTION_NAME",
    "StepTensors",
    "count_attention_calls",
    "register_step_attention",
    "step_attention_forward",
]


class StepTensors(NamedTuple):
    """Everything a packed step's attention reads, as tensors and constants (a `NamedTuple`, so `torch.compile`
    takes its tensors as graph inputs and guards on its constants).

    Attributes:
        kv (`tuple`): per layer, the `(key_cache, value_cache)` blocks of its lane,
            `[num_blocks, block_size, kv_heads, head_dim]`; quantized pages: `(key_codes, key_scales, value_codes,
            value_scales)` (`hf_paged.kv_format`); keys per channel (`"int4-channel"`): `(rows, stage_tables,
            block_size)`, the lane's bytes (`StagedKVStorage.raw`), the pool's companion tables and its block size.
        slots (`tuple[torch.Tensor, ...]`): per layer group, int64 `[T]`: the slot every new token is stored in, in
            packed order.
        block_tables (`tuple[torch.Tensor, ...]`): per layer group, int32 `[rows, width]`.
        seq_lens (`tuple[torch.Tensor, ...]`): per layer group, int32 `[rows]`: tokens of every row after the step.
        query_start (`torch.Tensor`): int32 `[rows + 1]`: where each row's new tokens start in the packed step.
        group_of (`tuple[int, ...]`): the layer group of every layer.
        windows (`tuple[int | None, ...]`): the attention window of every layer (`None`: full attention).
        kernel (`str`): the `kernels.paged_attention` backend name (`"auto"`, `"cpu"`, `"gather"`, ...).
        kv_dtype (`str`): how the pages store K/V (`"auto"`: the model's dtype; `"int8"`, `"int4"`,
            `"int4-channel"`: quantized).
    """

    kv: tuple
    slots: tuple
    block_tables: tuple
    seq_lens: tuple
    query_start: torch.Tensor
    group_of: tuple
    windows: tuple
    kernel: str
    kv_dtype: str = "auto"

    def varying(self) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        """The dimensions that change from step to step (tokens, rows, table width), for `ops.mark_varying`."""
        dims = [(self.query_start, (0,))]
        for slots, tables, lengths in zip(self.slots, self.block_tables, self.seq_lens):
            dims += [(slots, (0,)), (tables, (0, 1)), (lengths, (0,))]
        return dims

    @classmethod
    def of_batch(cls, cache, query_start: torch.Tensor, device: torch.device, width: int | None = None):
        """The `StepTensors` of `cache`'s running `ForwardBatch` (planned; every layer's pages allocated), its new
        tokens packed row after row as `query_start` says. `width`: pad every block table to that many columns
        (static shapes for a compiled decode; the padding names each row's first live block, as past a row's end;
        a wider table keeps its width)."""
        batch, layout, storage = cache.forward_batch, cache.layout, cache.pool.storage
        if device.type == "cpu":
            native_ops.load()  # the ops' CPU implementation without Python (built at first use)
        tables = [batch.kernel_tables(group.layers[0], device) for group in layout.groups]
        return cls(
            kv=pages_of(storage, len(layout.layer_windows)),
            slots=tuple(_own(addressing.write_slots.to(device)) for addressing in batch.groups),
            block_tables=tuple(_own(_padded(table, width)) for table, _ in tables),
            seq_lens=tuple(_own(lengths) for _, lengths in tables),
            query_start=query_start,
            group_of=layout.group_of,
            windows=layout.layer_windows,
            kernel=cache.kernel.requested,
            kv_dtype=storage.format.name,
        )


def pages_of(storage, num_layers: int) -> tuple:
    """`StepTensors.kv` of a pool's storage: per layer its K and V blocks, or their codes and scales."""
    pages = []
    for layer in range(num_layers):
        if storage.stages_keys:
            rows = storage.raw[storage.lane_of(layer)]
            pages.append((rows, storage.tables_on(rows.device), storage.block_size))
            continue
        key_cache, value_cache = storage.layer_tensors(layer)
        quantized = storage.format.quantized
        pages.append(
            (key_cache.codes, key_cache.scales, value_cache.codes, value_cache.scales)
            if quantized
            else (key_cache, value_cache)
        )
    return tuple(pages)


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, contiguous and not a view: Dynamo guards on a view's base, which the next step's tensor may lack."""
    return (
        tensor
        if tensor._base is None and tensor.is_contiguous()
        else tensor.clone(memory_format=torch.contiguous_format)
    )


def _padded(table: torch.Tensor, width: int | None) -> torch.Tensor:
    """`table` with columns added up to `width` (none where it is as wide or wider), each naming the row's first
    block."""
    if width is None or table.shape[1] >= width:
        return table
    return torch.cat([table, table[:, :1].expand(-1, width - table.shape[1])], dim=1)


def step_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    hf_paged_step: StepTensors | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention registered as `"hf_paged_step"` (and taken by `"hf_paged"` when `hf_paged_step` is passed): store
    this layer's new K/V (`[rows, kv_heads, T, head_dim]`) in the step's slots, then attend every query (`[rows,
    heads, T, head_dim]`: a packed step is one row of every request's tokens, a decode step one token per row) over
    its row's K/V through the block tables. Returns `[rows, T, heads, head_dim]` and no weights."""
    step = hf_paged_step
    if step is None:
        raise RuntimeError(
            f"the {STEP_ATTENTION_NAME!r} attention runs only inside hf_paged's compiled steps, which pass "
            "`hf_paged_step`; this model's attention was called without it (the model does not pass keyword "
            "arguments down to its attention)"
        )
    if kwargs.get("output_attentions"):
        raise NotImplementedError(f"the {STEP_ATTENTION_NAME!r} attention returns no attention probabilities")
    layer = module.layer_idx
    if not torch.compiler.is_compiling() and _calls is not None:
        _calls.append(layer)
    group = step.group_of[layer]
    rows, num_heads, num_new, head_dim = query.shape
    scale = head_dim**-0.5 if scaling is None else scaling
    tables, lengths, window = step.block_tables[group], step.seq_lens[group], step.windows[layer]
    if step.kv_dtype == "auto":
        key_cache, value_cache = step.kv[layer]
        ops.write_kv(key_cache, value_cache, step.slots[group], _packed(key), _packed(value))
        out = ops.paged_attention(
            _packed(query), key_cache, value_cache, tables, lengths, step.query_start, scale, window, softcap, s_aux,
            step.kernel,
        )  # fmt: skip
    elif FORMATS[step.kv_dtype].keys_per_channel:
        lane, stage_tables, block_size = step.kv[layer]
        ops.write_kv_staged(lane, stage_tables, block_size, step.slots[group], _packed(key), _packed(value))
        out = ops.paged_attention_staged(
            _packed(query), lane, stage_tables, block_size, key.shape[1], tables, lengths, step.query_start, scale,
            window, softcap, s_aux, step.kernel,
        )  # fmt: skip
    else:
        pages = step.kv[layer]
        ops.write_kv_quantized(*pages, step.slots[group], _packed(key), _packed(value), step.kv_dtype)
        out = ops.paged_attention_quantized(
            _packed(query), *pages, tables, lengths, step.query_start, scale, step.kv_dtype, window, softcap, s_aux,
            step.kernel,
        )  # fmt: skip
    return out.view(rows, num_new, num_heads, head_dim), None


def _packed(states: torch.Tensor) -> torch.Tensor:
    """`[rows, heads, T, head_dim]` as `[rows * T, heads, head_dim]`, row after row."""
    rows, heads, num_new, head_dim = states.shape
    return states.transpose(1, 2).reshape(rows * num_new, heads, head_dim)


def register_step_attention() -> None:
    """Register `step_attention_forward` as `"hf_paged_step"` in transformers' `AttentionInterface` (idempotent;
    no mask function: transformers then builds no mask for it)."""
    from transformers import AttentionInterface

    AttentionInterface.register(STEP_ATTENTION_NAME, step_attention_forward)


@contextlib.contextmanager
def count_attention_calls():
    """Collect the layer index of every eager `step_attention_forward` call in the block (a list)."""
    global _calls
    calls: list[int] = []
    _calls = calls
    try:
        yield calls
    finally:
        _calls = None
