"""`paged_attention_forward`: attention that reads each layer's K/V through the block tables of a `PagedCache`."""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .config import ATTENTION_NAME
from .forward import bound_paged_cache
from .kernels import in_place_backend
from .kernels.reference import eager_paged_attention
from .kernels.reference import repeat_kv as _repeat_kv
from .step_attention import step_attention_forward

__all__ = ["ATTENTION_NAME", "eager_paged_attention", "paged_attention_forward", "paged_attention_mask"]


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    paged_cache=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention registered as `"hf_paged"` in transformers' `AttentionInterface` (its mask as `"hf_paged"` in
    `AttentionMaskInterface`).

    When the forward runs with a `PagedCache` (`paged_cache`, or the cache hf_paged's forward hook bound to this
    thread), `key` and `value` are only this step's tokens, already written into the pool; the full K/V of the layer
    is read through the row block tables (`PagedCache.read_layer`; the layer `PagedCache.attending_layer` names: the
    cache slot the model's update wrote, which may differ from `module.layer_idx`). Without a paged cache, or for an
    attention whose layer wrote nothing in the running forward (a vision encoder's), it attends over the
    `key`/`value` given.
    The grouped-query factor comes from the tensor shapes; `scaling`, `softcap`, attention sinks (`s_aux`) and the
    (sliding-window, padded) mask are honoured. With `output_attentions=True` (which transformers passes down) it
    computes in plain torch ops and returns the attention probabilities, as eager attention does; otherwise it runs
    SDPA and returns no weights.
    """
    if kwargs.get("hf_paged_step") is not None:  # a compiled decode step: every paged tensor is an argument
        return step_attention_forward(
            module, query, key, value, attention_mask, scaling, dropout, softcap, s_aux, **kwargs
        )
    if paged_cache is None:
        paged_cache = bound_paged_cache()
    reads_tables = paged_cache is not None and paged_cache.reads_tables_in_attention()
    layer_idx = paged_cache.attending_layer(getattr(module, "layer_idx", None)) if reads_tables else None
    if layer_idx is not None:
        paged_cache.check_attention_inputs(layer_idx, key, value)
        packed = paged_cache.packed_rows()
        if paged_cache.eager_math:
            kwargs["eager"] = True
        if packed is not None:
            return _packed_attention(
                module, query, paged_cache, layer_idx, packed, scaling, dropout, softcap, s_aux, **kwargs
            )
        backend = _in_place_backend(module, query, paged_cache, layer_idx, dropout, kwargs)
        if backend is not None and paged_cache.kernel.takes(query.shape[2]):
            out = _in_place_right_aligned(
                backend, query, paged_cache, layer_idx, attention_mask, scaling, softcap, s_aux
            )
            if out is not None:
                return out, None
        if _groups_possible(query, attention_mask, kwargs):
            groups = paged_cache.key_groups()
            if groups is not None:
                return _grouped_attention(
                    module,
                    query,
                    paged_cache,
                    layer_idx,
                    groups,
                    attention_mask,
                    scaling,
                    dropout,
                    softcap,
                    s_aux,
                    **kwargs,
                )
        paged_cache.count_attention("gather")
        key, value = paged_cache.read_layer(layer_idx, new=(key, value))  # the left pads' K/V too, as in stock
    return _attention(module, query, key, value, attention_mask, scaling, dropout, softcap, s_aux, **kwargs)


def _in_place_backend(module, query, paged_cache, layer_idx, dropout, kwargs) -> str | None:
    """The in-place backend (`kernels`) this attention call may read the blocks with, or `None`: a kernel was
    chosen, no attention probabilities or eager math are asked for, no dropout, and the backend (or its fallback)
    supports the query and the pool's blocks (dtype, device)."""
    if not paged_cache.kernel.in_place or kwargs.get("output_attentions") or kwargs.get("eager"):
        return None
    if dropout and module.training:
        return None
    key_cache, _ = paged_cache.layer_blocks(layer_idx)
    return paged_cache.kernel.backend_for(query, key_cache)


def _kernel_call(backend, query, paged_cache, layer_idx, block_tables, seq_lens, query_start, scaling, softcap, s_aux):
    """In-place `backend` over packed `query` (`[tokens, heads, head_dim]`) of the rows `block_tables` names."""
    key_cache, value_cache = paged_cache.layer_blocks(layer_idx)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    paged_cache.forward_batch.read_in_place(layer_idx)
    paged_cache.count_attention(backend)
    return in_place_backend(backend).attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start,
        scale,
        paged_cache.layer_window(layer_idx),
        softcap,
        s_aux,
    )


def _in_place_right_aligned(backend, query, paged_cache, layer_idx, attention_mask, scaling, softcap, s_aux):
    """Attention of a right-aligned forward read in place, `[batch, new, heads, head_dim]`, or `None` when the
    model's mask says more than "each row's tokens, causally, in the window" (`ForwardBatch.in_place_readable`)."""
    batch = paged_cache.forward_batch
    if not batch.in_place_readable(attention_mask, paged_cache.layer_window(layer_idx)):
        return None
    rows, num_heads, num_new, head_dim = query.shape
    packed = query.transpose(1, 2).reshape(rows * num_new, num_heads, head_dim)
    block_tables, seq_lens = batch.kernel_tables(layer_idx, query.device)
    query_start = paged_cache.query_starts(rows, num_new, query.device)
    out = _kernel_call(
        backend, packed, paged_cache, layer_idx, block_tables, seq_lens, query_start, scaling, softcap, s_aux
    )
    return out.view(rows, num_new, num_heads, head_dim)


def _groups_possible(query, attention_mask, kwargs) -> bool:
    """Whether a right-aligned forward's rows may attend in key groups: one query per row (a decode step) with a
    per-row mask, and no attention probabilities to return for the whole batch."""
    return (
        query.shape[2] == 1
        and attention_mask is not None
        and attention_mask.shape[0] == query.shape[0]
        and not kwargs.get("output_attentions")
    )


def _grouped_attention(
    module, query, paged_cache, layer_idx, groups, attention_mask, scaling, dropout, softcap, s_aux, **kwargs
):
    """Attention of a right-aligned forward whose rows read their keys in groups (`BatchCache.key_groups`): each
    group reads only the positions from its longest row's first one on, under the matching columns of the mask."""
    paged_cache.count_attention("gather")
    output = None
    for group in groups:
        key, value = paged_cache.read_layer(layer_idx, group.rows, group.start)
        mask = attention_mask.index_select(0, group.rows)
        mask = mask[..., mask.shape[-1] - key.shape[2] :]
        out, _ = _attention(
            module, query.index_select(0, group.rows), key, value, mask, scaling, dropout, softcap, s_aux, **kwargs
        )
        if output is None:
            output = out.new_empty(query.shape[0], *out.shape[1:])
        output.index_copy_(0, group.rows, out)
    return output, None


def _attention(module, query, key, value, attention_mask, scaling, dropout, softcap, s_aux, eager=False, **kwargs):
    """SDPA (transformers' own) over `key`/`value`, or plain torch ops (`eager_paged_attention`) where SDPA cannot
    express the call or `eager` asks for eager attention's math."""
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    n_rep = num_heads // num_kv_heads
    dropout = dropout if module.training else 0.0
    if eager or softcap is not None or s_aux is not None or kwargs.get("output_attentions"):
        return eager_paged_attention(
            query, key, value, attention_mask, scaling, dropout, softcap, s_aux, training=module.training
        )
    if n_rep > 1 and getattr(module, "num_key_value_groups", None) != n_rep:
        key, value = _repeat_kv(key, n_rep), _repeat_kv(value, n_rep)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _packed_attention(module, query, paged_cache, layer_idx, packed, scaling, dropout, softcap, s_aux, **kwargs):
    """Attention of a packed forward: `query` is `[1, heads, T, head_dim]` (every row's new tokens one after
    another). Each query group (`PackedRows.groups`) lays its rows' queries out as `[rows, heads, width, head_dim]`,
    reads its rows' keys through their tables up to its longest row, attends under its mask, and its outputs go
    back to their packed places: `[1, T, heads, head_dim]`."""
    num_heads, head_dim = query.shape[1], query.shape[-1]
    window = paged_cache.layer_window(layer_idx)
    output = None  # in the attention's output dtype (under autocast: not the query's)
    groups = packed.groups
    kernel = paged_cache.kernel
    part = None
    backend = _in_place_backend(module, query, paged_cache, layer_idx, dropout, kwargs) if kernel.in_place else None
    if backend is not None:
        part = packed.in_place_part(kernel.max_queries)
    if part is not None:
        tokens = query[0].transpose(0, 1)  # [T, heads, head_dim], a view
        if part.token_index is not None:
            tokens = tokens.index_select(0, part.token_index)
        block_tables, seq_lens = paged_cache.forward_batch.kernel_tables(layer_idx, query.device)
        if part.token_index is not None:
            block_tables, seq_lens = block_tables.index_select(0, part.rows), seq_lens.index_select(0, part.rows)
        out = _kernel_call(
            backend, tokens, paged_cache, layer_idx, block_tables, seq_lens, part.query_start, scaling, softcap, s_aux
        )
        if part.token_index is None:
            return out[None], None
        output = out.new_empty(query.shape[2], num_heads, head_dim)
        output.index_copy_(0, part.token_index, out)
        groups = part.rest
    whole = len(packed.groups) == 1
    if groups:
        paged_cache.count_attention("gather")
    for group in groups:
        rows, width = group.rows.numel(), group.width
        per_row = query[0].index_select(1, group.unpack_index).view(num_heads, rows, width, head_dim).transpose(0, 1)
        keys, values = paged_cache.read_layer(layer_idx, None if whole else group.rows, 0, group.key_length)
        out, _ = _attention(
            module, per_row, keys, values, group.mask(window), scaling, dropout, softcap, s_aux, **kwargs
        )
        if output is None:
            output = out.new_empty(query.shape[2], num_heads, head_dim)
        output.index_copy_(
            0, group.token_index, out.reshape(rows * width, num_heads, head_dim).index_select(0, group.source_index)
        )
    return output[None], None


def paged_attention_mask(*args, **kwargs):
    """The mask function registered as `"hf_paged"` in `AttentionMaskInterface`: transformers' `sdpa_mask`, except
    in a packed forward, whose attention builds each row's mask itself (`None` is returned, nothing is built)."""
    cache = bound_paged_cache()
    if cache is not None and cache.packed_rows() is not None:
        return None
    return sdpa_mask(*args, **kwargs)
