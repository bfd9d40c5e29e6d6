"""The reference backend: gather each row's K/V through its block table into a dense copy, then attend with plain
torch ops. Every other backend is tested against it; it runs anywhere torch does."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kv_format import QuantizedPages


def repeat_kv(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
    """`[B, H_kv, L, D]` -> `[B, H_kv * n_rep, L, D]`, each KV head repeated for its query group."""
    if n_rep == 1:
        return hidden
    batch, num_kv_heads, length, head_dim = hidden.shape
    hidden = hidden[:, :, None, :, :].expand(batch, num_kv_heads, n_rep, length, head_dim)
    return hidden.reshape(batch, num_kv_heads * n_rep, length, head_dim)


def causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
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
    key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    logits = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if attention_mask is None:
        attention_mask = causal_mask(query.shape[2], key.shape[2], query.device)
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


def read_slots(cache: torch.Tensor | QuantizedPages, slots: torch.Tensor) -> torch.Tensor:
    """The K (or V) of `slots` (any shape) of a layer's blocks, `[*slots.shape, kv_heads, head_dim]`; quantized
    blocks are dequantized (in fp32, then the model's dtype)."""
    if isinstance(cache, QuantizedPages):
        return cache.format.dequantize(cache.codes.flatten(0, 1)[slots], cache.scales.flatten(0, 1)[slots], cache.dtype)
    if not isinstance(cache, torch.Tensor):  # StagedPages: keys exact while their block is open
        return cache.read(slots)
    return cache.flatten(0, 1)[slots]


def gather_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`kernels.paged_attention` by gathering: every row's K/V is copied out of the blocks into
    `[rows, kv_heads, longest row, head_dim]`, every row's queries into `[rows, q_heads, most queries, head_dim]`,
    and they attend under a causal (and sliding-window) mask, with SDPA or, for soft-capping and sinks, eager math."""
    device = query.device
    block_size = key_cache.shape[1]
    seq_lens = seq_lens.to(device=device, dtype=torch.long)
    query_start = query_start.to(device=device, dtype=torch.long)
    counts = query_start[1:] - query_start[:-1]
    max_len, max_queries = int(seq_lens.max()), int(counts.max())
    positions = torch.arange(max_len, device=device)
    columns = (positions // block_size).clamp(max=block_tables.shape[1] - 1)
    blocks = block_tables.to(device=device, dtype=torch.long).index_select(1, columns)
    slots = blocks * block_size + positions % block_size  # [rows, max_len]
    # past a row's end: its first slot (written), not slots never written (what they hold may not be finite, and a
    # masked NaN still reaches the output through its zero weight)
    slots = torch.where(positions[None, :] < seq_lens[:, None], slots, slots[:, :1])
    keys = read_slots(key_cache, slots).transpose(1, 2)  # [rows, kv_heads, max_len, head_dim]
    values = read_slots(value_cache, slots).transpose(1, 2)
    query_slots = torch.arange(max_queries, device=device)
    last = torch.minimum(query_slots[None, :], (counts - 1)[:, None])
    per_row = query[query_start[:-1, None] + last].transpose(1, 2)  # [rows, q_heads, max_queries, head_dim]
    query_positions = (seq_lens - counts)[:, None] + last  # [rows, max_queries]
    visible = (positions[None, None, :] <= query_positions[:, :, None]) & (
        positions[None, None, :] < seq_lens[:, None, None]
    )
    if window is not None:
        visible &= query_positions[:, :, None] - positions[None, None, :] < window
    mask = visible[:, None]
    if softcap is not None or sinks is not None:
        out, _ = eager_paged_attention(per_row, keys, values, mask, scale, softcap=softcap, sinks=sinks)
    else:
        n_rep = per_row.shape[1] // keys.shape[1]
        keys, values = repeat_kv(keys, n_rep), repeat_kv(values, n_rep)
        out = F.scaled_dot_product_attention(per_row, keys, values, attn_mask=mask, scale=scale).transpose(1, 2)
    real = query_slots[None, :] < counts[:, None]  # [rows, max_queries], row-major = packed order
    return out[real]
