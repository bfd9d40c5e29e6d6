"""The flash-attn backend: flash-attn 2's own paged kernels over the blocks as they lie.

A decode step (one query per row: `tokens == rows`) calls `flash_attn_with_kvcache(q, k_cache, v_cache,
cache_seqlens=, block_table=)`; any other call (prefill chunks, mixed packed steps) calls
`flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, ..., block_table=)`. Both read the storage's
layout, `[num_blocks, block_size, kv_heads, head_dim]`, through int32 tables. Our conventions map to flash-attn's:

- causal, bottom-right aligned: a row's queries are its last tokens, as `paged_attention` says;
- the K/V of the new tokens are already in the blocks (written by the cache), so `cache_seqlens` (and
  `cu_seqlens_k`) count them, and no `k`/`v` is passed;
- `window` (a query at `p` sees keys `k` with `p - k < window`) is `window_size=(window - 1, 0)`;
- `softcap=None` is `softcap=0.0`; grouped-query heads are flash-attn's own (query head `h` reads KV head
  `h // group`).

flash-attn 2 reads paged K/V only in blocks of a multiple of 256 tokens (`BLOCK_MULTIPLE`), in fp16 or bf16, on CUDA;
it has no attention sinks (calls with sinks go to the Triton kernel, or gather). The arguments are built by pure
functions (`decode_arguments`, `varlen_arguments`) that the tests check on the CPU against a reference of
flash-attn's documented semantics; `attention` only adds the call.
"""

from __future__ import annotations

import functools

import torch

from ..kv_format import QuantizedPages

BLOCK_MULTIPLE = 256  # flash-attn 2: page_block_size must be a multiple of 256
DTYPES = (torch.float16, torch.bfloat16)
INSTALL_HINT = "pip install 'hf_paged[flash]'"


@functools.cache
def available() -> bool:
    """Whether `flash_attn` (2.6 or later: paged varlen) can be imported here."""
    try:
        import flash_attn
    except ImportError:
        return False
    try:
        major, minor = (int(part) for part in flash_attn.__version__.split(".")[:2])
    except ValueError:
        return True
    return (major, minor) >= (2, 6)


def accepts_block_size(block_size: int) -> bool:
    """Whether flash-attn 2 reads blocks of `block_size` tokens (a multiple of `BLOCK_MULTIPLE`)."""
    return block_size % BLOCK_MULTIPLE == 0


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether this backend can run a call on these tensors."""
    return (
        not isinstance(key_cache, QuantizedPages)  # quantized pages: the CPU kernel and gather read them
        and available()
        and query.device.type == "cuda"
        and key_cache.device == query.device
        and query.dtype == key_cache.dtype
        and query.dtype in DTYPES
        and accepts_block_size(key_cache.shape[1])
        and query.stride(-1) == 1
        and key_cache.stride(-1) == 1
    )


def window_size(window: int | None) -> tuple[int, int]:
    """flash-attn's `(left, right)` of our `window`: keys `[p - (window - 1), p]` of a query at `p`; `(-1, -1)`:
    none (causal alone bounds the right)."""
    return (-1, -1) if window is None else (int(window) - 1, 0)


def decode_arguments(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> dict:
    """The keyword arguments of `flash_attn_with_kvcache` for a decode step (`query` `[rows, heads, head_dim]`, one
    query per row); its output `[rows, 1, heads, head_dim]` reshapes to `query`'s shape."""
    return {
        "q": query.unsqueeze(1),
        "k_cache": key_cache,
        "v_cache": value_cache,
        "cache_seqlens": seq_lens.to(device=query.device, dtype=torch.int32),
        "block_table": block_tables.to(device=query.device, dtype=torch.int32),
        "softmax_scale": float(scale),
        "causal": True,
        "window_size": window_size(window),
        "softcap": 0.0 if softcap is None else float(softcap),
    }


def varlen_arguments(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> dict:
    """The keyword arguments of `flash_attn_varlen_func` over packed `query` (`[tokens, heads, head_dim]`). The
    longest query and key lengths are bounds known without reading the device (`tokens`, the tables' width times
    the block size): flash-attn sizes its grid with them and skips what lies past each row's real lengths."""
    device = query.device
    seq_lens = seq_lens.to(device=device, dtype=torch.int32)
    cu_seqlens_k = torch.zeros(seq_lens.numel() + 1, dtype=torch.int32, device=device)
    torch.cumsum(seq_lens, 0, dtype=torch.int32, out=cu_seqlens_k[1:])
    return {
        "q": query,
        "k": key_cache,
        "v": value_cache,
        "cu_seqlens_q": query_start.to(device=device, dtype=torch.int32),
        "cu_seqlens_k": cu_seqlens_k,
        "max_seqlen_q": query.shape[0],
        "max_seqlen_k": block_tables.shape[1] * key_cache.shape[1],
        "softmax_scale": float(scale),
        "causal": True,
        "window_size": window_size(window),
        "softcap": 0.0 if softcap is None else float(softcap),
        "block_table": block_tables.to(device=device, dtype=torch.int32),
    }


def is_decode(query: torch.Tensor, seq_lens: torch.Tensor) -> bool:
    """Whether a call is a decode step: one query per row (every row has at least one), known from the shapes."""
    return query.shape[0] == seq_lens.numel()


def attention(
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
    """`kernels.paged_attention` through flash-attn 2 (sinks, which it lacks, through `fallback_attention`)."""
    if sinks is not None:
        return fallback_attention(
            query, key_cache, value_cache, block_tables, seq_lens, query_start, scale, window, softcap, sinks
        )
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    if is_decode(query, seq_lens):
        arguments = decode_arguments(query, key_cache, value_cache, block_tables, seq_lens, scale, window, softcap)
        return flash_attn_with_kvcache(**arguments).view_as(query)
    arguments = varlen_arguments(
        query, key_cache, value_cache, block_tables, seq_lens, query_start, scale, window, softcap
    )
    return flash_attn_varlen_func(**arguments)


def fallback_attention(*args) -> torch.Tensor:
    """A call flash-attn cannot express, by the Triton kernel where it runs, else by gathering."""
    from .reference import gather_paged_attention
    from .triton import attention as triton_attention
    from .triton import supports as triton_supports

    if triton_supports(args[0], args[1]):
        return triton_attention(*args)
    return gather_paged_attention(*args)
