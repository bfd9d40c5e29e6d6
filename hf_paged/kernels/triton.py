"""The Triton backend: one paged-attention kernel for decode steps, prefill chunks and mixed packed steps.

A program attends one tile of `BLOCK_Q` consecutive queries of one row for all query heads of one KV head
(`BLOCK_M = BLOCK_Q * group` query rows in one `tl.dot`). It finds its row by a binary search over the query starts
(as vLLM's unified Triton attention does: the grid is `tokens // BLOCK_Q + rows` tiles, an upper bound of every
row's tiles, so the launch needs no host synchronisation), reads K/V through the row's int32 block table a tile of
`TILE_N` keys at a time (each key addressed on its own, so any block size works), skips the tiles wholly in the
future or outside the sliding window (a tile's keys before its first query's window are never loaded, so blocks a
window skipped are never read), and keeps an online softmax in fp32 (soft-cap and sinks included). fp32 storage
multiplies in fp32 (`input_precision="ieee"`, no TF32); fp16/bf16 storage uses the tensor cores' fp16/bf16 products
with fp32 accumulation.

It runs on CUDA devices, and on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1` set before triton is
imported), which is how the tests prove it on machines without a GPU. The interpreter's fp16/bf16 `tl.dot` is
wrong (numpy has no bf16), so there the products of half-precision storage are taken in fp32: the half-precision
tensor-core path itself is proven only on a device. `triton` is imported only when a call runs.
"""

from __future__ import annotations

import functools
import os

import torch

from ..kv_format import QuantizedPages, attends_rotated_pages
from ..staged_storage import StagedPages

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# keys per inner step, by (fp32 products, quantized bits), as measured on an H200 (benchmarks/gpu_page_formats.py
# --tile-n; docs/gpu.md): half-precision products take 128 (2.0x-2.7x 16's speed at decode), fp32 spills beyond 64
# (64: 1.7x-2.5x 16's; 128: 0.6x), and fp32 with int8 pages is fastest at 16 (64: 0.2x).
TILE_N_BY_PRODUCTS = {(False, 0): 128, (False, 8): 128, (False, 4): 128, (True, 0): 64, (True, 8): 16, (True, 4): 64}
TILE_N: int | None = None  # set: every call takes this many keys a step (to measure another choice)
INSTALL_HINT = "pip install 'hf_paged[triton]'"


@functools.cache
def available() -> bool:
    """Whether `triton` can be imported here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (`TRITON_INTERPRET=1`): on CPU tensors, for tests."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def runs_on(device: torch.device | str) -> bool:
    """Whether the kernel can run on tensors of `device`: CUDA, or the CPU under the interpreter."""
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and interpreted())


def supports(query: torch.Tensor, key_cache: torch.Tensor | QuantizedPages) -> bool:
    """Whether this backend can run a call on these tensors (blocks in the query's dtype, or quantized pages read
    back in it)."""
    return (
        available()
        and runs_on(query.device)
        and key_cache.device == query.device
        and query.dtype == key_cache.dtype
        and query.dtype in DTYPES
    )


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@attends_rotated_pages
def attention(
    query: torch.Tensor,
    key_cache: torch.Tensor | QuantizedPages,
    value_cache: torch.Tensor | QuantizedPages,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    query_plain: torch.Tensor | None = None,
) -> torch.Tensor:
    """`kernels.paged_attention` in Triton, reading the blocks where they lie (no host synchronisation). Quantized
    pages (`hf_paged.kv_format`) are read as codes (loaded as vectors of bytes; 4-bit: each byte once, its nibbles
    split into even and odd channels), their per-token scales applied to logits and probabilities, and, being stored
    rotated, attended in their rotated space: the queries are rotated in, the output back out. Keys per channel
    (`"int4-channel"`): full blocks' keys against the rotated queries, open blocks' exact keys against the queries
    themselves."""
    quant_bits, key_scales, value_scales = 0, None, None
    channel = None
    if isinstance(key_cache, StagedPages):
        storage, lane = key_cache.storage, key_cache.lane
        quant_bits, key_scales, value_scales = 4, storage.value_scales[lane], storage.value_scales[lane]
        params, staging = storage.key_scales[lane], storage.staging[lane]
        tables = storage.tables_on(query.device)
        channel = (params, tables, staging)
        key_cache, value_cache = storage.keys[lane], storage.values[lane]
    elif isinstance(key_cache, QuantizedPages):
        quant_bits, key_scales, value_scales = key_cache.format.bits, key_cache.scales, value_cache.scales
        key_cache, value_cache = key_cache.codes, value_cache.codes
        if key_scales.stride() != value_scales.stride():
            key_scales, value_scales = key_scales.contiguous(), value_scales.contiguous()
    kernel = _kernel()
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_q_heads // num_kv_heads
    num_rows = seq_lens.numel()
    if out is None:
        out = torch.empty_like(query)
    device = query.device
    block_tables = block_tables.to(device=device, dtype=torch.int32)
    seq_lens = seq_lens.to(device=device, dtype=torch.int32)
    query_start = query_start.to(device=device, dtype=torch.int32)
    if sinks is not None:
        sinks = sinks.detach().to(device=device, dtype=torch.float32).contiguous()
    constants = kernel_constants(
        query.dtype, group, head_dim, key_cache.shape[1], window is not None, softcap is not None, sinks is not None,
        quant_bits,
    )  # fmt: skip
    if channel is not None:
        params, tables, staging = channel
        constants.update(CHANNEL_KEYS=True, STAGING_TOKENS=staging.shape[1])
        channel_args = (params, *params.stride(), tables, tables.stride(0), staging, *staging.stride(), query_plain)
    else:  # unused pointers and strides
        channel_args = (query, 0, 0, 0, 0, block_tables, 0, query, 0, 0, 0, 0, query)
    grid = (num_tokens // constants["BLOCK_Q"] + num_rows, num_kv_heads)
    kernel[grid](
        query,
        key_cache,
        value_cache,
        out,
        block_tables,
        seq_lens,
        query_start,
        query if sinks is None else sinks,  # an unused pointer when there are no sinks
        query if key_scales is None else key_scales,  # unused without quantized pages
        query if value_scales is None else value_scales,
        num_rows,
        float(scale),
        0 if window is None else int(window),
        0.0 if softcap is None else float(softcap),
        *query.stride(),
        *out.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        block_tables.stride(0),
        *(key_scales.stride() if key_scales is not None else (0, 0, 0)),
        *channel_args,
        **constants,
    )
    return out


def kernel_constants(
    dtype: torch.dtype,
    group: int,
    head_dim: int,
    block_size: int,
    use_window: bool,
    use_softcap: bool,
    use_sinks: bool,
    quant_bits: int,
) -> dict[str, int | bool]:
    """The kernel's compile-time constants for one call: one compiled variant per distinct dict.

    Example:
        >>> kernel_constants(torch.bfloat16, 4, 64, 16, False, False, False, 0)["BLOCK_M"]
        16
    """
    block_m = max(16, _next_power_of_2(group))
    dot_fp32 = dtype == torch.float32 or interpreted()  # the interpreter's fp16/bf16 dots are wrong
    return dict(
        BLOCK_SIZE=block_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=max(16, _next_power_of_2(head_dim)),
        HALF_DIM_PADDED=max(16, _next_power_of_2((head_dim + 1) // 2)),  # bytes of 4-bit codes, padded
        BLOCK_Q=block_m // group,
        BLOCK_M=block_m,
        TILE_N=TILE_N or TILE_N_BY_PRODUCTS[dot_fp32, quant_bits],
        USE_WINDOW=use_window,
        USE_SOFTCAP=use_softcap,
        USE_SINKS=use_sinks,
        DOT_FP32=dot_fp32,
        QUANT_BITS=quant_bits,
        CHANNEL_KEYS=False,  # keys per channel ("int4-channel" pages): set by the call
        STAGING_TOKENS=1,
    )


@functools.cache
def _kernel():
    """The jitted kernel (`triton_kernel`, imported on first use: importing this module never imports triton, and
    `TRITON_INTERPRET` is read when the kernel is defined)."""
    from .triton_kernel import paged_attention_kernel

    return paged_attention_kernel


triton_paged_attention = attention
