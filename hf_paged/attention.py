"""`paged_attention_forward`: attention that reads each layer's K/V through the block tables of a `PagedCache`."""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .config import ATTENTION_NAME
from .forward import bound_paged_cache

__all__ = ["ATTENTION_NAME", "eager_paged_attention", "paged_attention_forward", "paged_attention_mask"]


def _repeat_kv(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
    """`[B, H_kv, L, D]` -> `[B, H_kv * n_rep, L, D]`, each KV head repeated for its query group."""
    if n_rep == 1:
        return hidden
    batch, num_kv_heads, length, head_dim = hidden.shape
    hidden = hidden[:, :, None, :, :].expand(batch, num_kv_heads, n_rep, length, head_dim)
    return hidden.reshape(batch, num_kv_heads * n_rep, length, head_dim)


def _causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Boolean `[1, 1, q_len, kv_len]` mask: query i (at position kv_len - q_len + i) sees keys up to itself."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    return (torch.arange(kv_len, device=device)[None, :] <= q_pos)[None, None]


def eager_paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    training: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention in plain torch ops, for what SDPA cannot express: logit soft-capping and attention sinks.

    Args:
        query (`torch.Tensor`): `[B, H_q, q, D]`.
        key, value (`torch.Tensor`): `[B, H_kv, L, D]`, `H_q` a multiple of `H_kv` (grouped-query attention).
        attention_mask (`torch.Tensor`, *optional*): boolean (True = attend) or additive float, `[B, 1, q, L]`;
            `None` means causal.
        scaling (`float`, *optional*): logit scale, `D ** -0.5` by default.
        softcap (`float`, *optional*): logits become `softcap * tanh(logits / softcap)`.
        sinks (`torch.Tensor`, *optional*): one learned logit per head that takes softmax mass but has no value.

    Returns:
        `(output [B, q, H_q, D], probabilities [B, H_q, q, L])`.
    """
    n_rep = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, n_rep), _repeat_kv(value, n_rep)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    logits = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if attention_mask is None:
        attention_mask = _causal_mask(query.shape[2], key.shape[2], query.device)
    attention_mask = attention_mask[:, :, :, : key.shape[2]]
    if attention_mask.dtype == torch.bool:
        logits = logits.masked_fill(~attention_mask, torch.finfo(logits.dtype).min)
    else:
        logits = logits + attention_mask
    if sinks is not None:
        sink_logits = sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[2], 1).to(logits.dtype)
        logits = torch.cat([logits, sink_logits], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)[..., :-1].to(query.dtype)
    else:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


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
        key, value = paged_cache.read_layer(layer_idx, new=(key, value))  # the left pads' K/V too, as in stock
    return _attention(module, query, key, value, attention_mask, scaling, dropout, softcap, s_aux, **kwargs)


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
    whole = len(packed.groups) == 1
    for group in packed.groups:
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
