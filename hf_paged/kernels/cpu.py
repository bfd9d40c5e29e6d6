"""The CPU backend: `csrc/paged_attention_cpu.cpp`, reading K/V through the block tables in place, called through
ctypes (built at first use, see `kernels.build`)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..kv_format import QuantizedPages, attends_rotated_pages
from ..staged_storage import StagedPages
from .build import load_library

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
KV_FORMATS = {None: 0, 8: 1, 4: 2, "channel": 3}  # in the query's dtype; int8; int4 codes (by bits); keys per channel
QUERY_TILE = 16  # queries of one row an item attends for at a time
MIN_SPLIT_KEYS = 512  # a small batch splits a row's keys over the threads, at least this many keys a split
MIN_WORK_PER_THREAD = 2048  # query-vector x key products worth a thread of their own (smaller calls use fewer)
ABI_VERSION = 4


class _Params(ctypes.Structure):
    _fields_ = [
        ("query", ctypes.c_void_p),
        ("key_cache", ctypes.c_void_p),
        ("value_cache", ctypes.c_void_p),
        ("key_scales", ctypes.c_void_p),
        ("value_scales", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p),
        ("query_start", ctypes.c_void_p),
        ("sinks", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("q_stride_token", ctypes.c_int64),
        ("q_stride_head", ctypes.c_int64),
        ("out_stride_token", ctypes.c_int64),
        ("out_stride_head", ctypes.c_int64),
        ("kv_stride_block", ctypes.c_int64),
        ("kv_stride_token", ctypes.c_int64),
        ("kv_stride_head", ctypes.c_int64),
        ("scale_stride_block", ctypes.c_int64),
        ("scale_stride_token", ctypes.c_int64),
        ("scale_stride_head", ctypes.c_int64),
        ("num_rows", ctypes.c_int32),
        ("num_q_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("window", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("num_threads", ctypes.c_int32),
        ("query_tile", ctypes.c_int32),
        ("min_split_keys", ctypes.c_int32),
        ("min_work_per_thread", ctypes.c_int64),
        ("key_params", ctypes.c_void_p),
        ("kp_stride_block", ctypes.c_int64),
        ("kp_stride_head", ctypes.c_int64),
        ("stage_tables", ctypes.c_void_p),
        ("stage_stride", ctypes.c_int64),
        ("staging", ctypes.c_void_p),
        ("st_stride_block", ctypes.c_int64),
        ("st_stride_token", ctypes.c_int64),
        ("st_stride_head", ctypes.c_int64),
        ("staging_tokens", ctypes.c_int32),
        ("query_plain", ctypes.c_void_p),
    ]


_library = None


def library() -> ctypes.CDLL:
    """The built kernel (raises `KernelBuildError` where it cannot be built)."""
    global _library
    if _library is None:
        _library = bind(load_library(SOURCE))
    return _library


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib`, a build of `SOURCE`, with its entry points typed (raises `RuntimeError` for another ABI)."""
    lib.hf_paged_attention.argtypes = [ctypes.POINTER(_Params), ctypes.c_int, ctypes.c_int]
    lib.hf_paged_attention.restype = ctypes.c_int
    lib.hf_paged_abi_version.restype = ctypes.c_int
    if lib.hf_paged_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{SOURCE.name}: ABI {lib.hf_paged_abi_version()}, expected {ABI_VERSION}")
    return lib


def supports(query: torch.Tensor, key_cache: torch.Tensor | QuantizedPages) -> bool:
    """Whether this backend can run a call on these tensors (blocks in the query's dtype, or quantized pages read
    back in it)."""
    if isinstance(key_cache, StagedPages):
        stored = key_cache.storage.keys[key_cache.lane]
    else:
        stored = key_cache.codes if isinstance(key_cache, QuantizedPages) else key_cache
    return (
        query.device.type == "cpu"
        and stored.device.type == "cpu"
        and query.dtype == key_cache.dtype
        and query.dtype in DTYPES
        and query.stride(-1) == 1
        and stored.stride(-1) == 1
    )


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
    """`kernels.paged_attention` on the CPU, reading the blocks where they lie (quantized pages: their codes and
    scales, dequantized as each row is loaded; stored rotated, attended in their rotated space; keys per channel:
    full blocks' keys against the rotated query, open blocks' exact keys against the query itself)."""
    lib = library()
    num_tokens, num_q_heads, head_dim = query.shape
    if out is None:
        out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=query.dtype)
    block_tables, seq_lens, query_start = _int32(block_tables), _int32(seq_lens), _int32(query_start)
    if sinks is not None:
        sinks = sinks.detach().to(torch.float32).contiguous()
    key_scales = value_scales = None
    bits = None
    channel = {}
    if isinstance(key_cache, StagedPages):
        storage, lane = key_cache.storage, key_cache.lane
        bits, params, tables, staging = "channel", storage.key_scales[lane], storage.tables_on(query.device), None
        staging = storage.staging[lane]
        channel = {
            "key_params": params.data_ptr(),
            "kp_stride_block": params.stride(0),
            "kp_stride_head": params.stride(1),
            "stage_tables": tables.data_ptr(),  # [blocks, 2, companions]: the open block's companions first
            "stage_stride": tables.stride(0),
            "staging": staging.data_ptr(),
            "st_stride_block": staging.stride(0),
            "st_stride_token": staging.stride(1),
            "st_stride_head": staging.stride(2),
            "staging_tokens": staging.shape[1],
            "query_plain": query_plain.data_ptr(),
        }
        if query_plain.stride() != query.stride():
            raise ValueError("the plain query must be laid out as the rotated one")
        key_cache, key_scales = storage.keys[lane], storage.value_scales[lane]  # (keys use key_params)
        value_cache, value_scales = storage.values[lane], storage.value_scales[lane]
    elif isinstance(key_cache, QuantizedPages):
        bits = key_cache.format.bits
        key_cache, key_scales = key_cache.codes, key_cache.scales.contiguous()
        value_cache, value_scales = value_cache.codes, value_cache.scales.contiguous()
    if value_cache.stride() != key_cache.stride() or value_cache.shape != key_cache.shape:
        value_cache = value_cache.contiguous()
        key_cache = key_cache.contiguous()
    scale_strides = key_scales.stride() if key_scales is not None else (0, 0, 0)
    params = _Params(
        query=query.data_ptr(),
        key_cache=key_cache.data_ptr(),
        value_cache=value_cache.data_ptr(),
        key_scales=None if key_scales is None else key_scales.data_ptr(),
        value_scales=None if value_scales is None else value_scales.data_ptr(),
        out=out.data_ptr(),
        block_tables=block_tables.data_ptr(),
        seq_lens=seq_lens.data_ptr(),
        query_start=query_start.data_ptr(),
        sinks=None if sinks is None else sinks.data_ptr(),
        table_stride=block_tables.stride(0) if block_tables.dim() == 2 else 0,
        q_stride_token=query.stride(0),
        q_stride_head=query.stride(1),
        out_stride_token=out.stride(0),
        out_stride_head=out.stride(1),
        kv_stride_block=key_cache.stride(0),
        kv_stride_token=key_cache.stride(1),
        kv_stride_head=key_cache.stride(2),
        scale_stride_block=scale_strides[0],
        scale_stride_token=scale_strides[1],
        scale_stride_head=scale_strides[2],
        num_rows=seq_lens.numel(),
        num_q_heads=num_q_heads,
        num_kv_heads=key_cache.shape[2],
        head_dim=head_dim,
        block_size=key_cache.shape[1],
        window=0 if window is None else int(window),
        scale=float(scale),
        softcap=0.0 if softcap is None else float(softcap),
        num_threads=torch.get_num_threads(),
        query_tile=QUERY_TILE,
        min_split_keys=MIN_SPLIT_KEYS,
        min_work_per_thread=MIN_WORK_PER_THREAD,
        **channel,
    )
    status = lib.hf_paged_attention(ctypes.byref(params), DTYPES[query.dtype], KV_FORMATS[bits])
    if status != 0:
        raise RuntimeError(f"the CPU paged-attention kernel refused its arguments (status {status})")
    return out


cpu_paged_attention = attention


def _int32(index: torch.Tensor) -> torch.Tensor:
    """`index` as a contiguous int32 CPU tensor (itself when it is one: the common case, checked cheaply)."""
    if index.dtype == torch.int32 and index.device.type == "cpu" and index.is_contiguous():
        return index
    return index.to("cpu", torch.int32).contiguous()
