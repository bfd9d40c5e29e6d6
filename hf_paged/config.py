"""`cache_config` keys understood by hf_paged, parsed and validated in one place."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch

from .channel_keys import CHANNEL_BLOCK_SIZE
from .kernels import DEFAULT_BLOCK_SIZE, auto_block_size, check_kernel_name
from .kv_format import check_kv_dtype, kv_format
from .sizes import parse_memory

DEFAULT_CPU_KV_BYTES = 1024**3
DEFAULT_MAX_BLOCKS = 65536  # cap of the default sizing only (explicit num_blocks / max_memory are not capped)
DEFAULT_GPU_MEMORY_FRACTION = 0.9
ATTENTION_NAME = "hf_paged"  # the paged attention's name in transformers' attention and mask interfaces
DEFAULT_ATTN_IMPLEMENTATION = ATTENTION_NAME


@dataclass(frozen=True)
class PagedCacheConfig:
    """Options of the paged KV cache, given as `cache_config={...}` to `generate` or as keywords to `PagedCache`.

    Args:
        block_size (`int` or `"auto"`, *optional*): tokens per block (default 16). `"auto"`: the size the fastest
            attention backend of the model's device reads (256 on CUDA with flash-attn 2, else 16; see
            `kernels.auto_block_size`).
        num_blocks (`int`, *optional*): blocks in the model's pool. Exclusive with `max_memory`.
        max_memory (`int | str`, *optional*): KV bytes for the pool (`"512MiB"`), turned into `num_blocks`.
        memory_fraction (`float`, *optional*): on CUDA, the fraction of free device memory the pool may take
            when neither `num_blocks` nor `max_memory` is given (default 0.9).
        attn_implementation (`str`, *optional*): attention used while generating with the paged cache: `"hf_paged"`
            (default, reads K/V through the block tables) or a stock one such as `"sdpa"` or `"eager"`.
        prefix_caching (`bool`, *optional*): share full blocks by content across sequences and calls, and skip the
            prefill of a cached prompt prefix (default True).
        kernel (`str`, *optional*): the paged-attention backend of the `"hf_paged"` attention: `"auto"` (default:
            read the blocks in place where this device has a kernel, choosing per shape), `"gather"` (copy each
            row's K/V out of the blocks, then SDPA: the reference), `"cpu"` (always the in-place CPU kernel where
            it can run), `"triton"` (the Triton kernel, CUDA; needs `triton`) or `"flash"` (flash-attn 2, CUDA,
            blocks of a multiple of 256; needs `flash-attn`). See `hf_paged.kernels` and docs/gpu.md.
        kv_dtype (`str`, *optional*): how the pool stores K/V: `"auto"` (default: the model's dtype), `"int8"` or
            `"int4"` (quantized pages with a bfloat16 scale per token and KV head: about 0.52x and 0.27x the bytes
            of bfloat16 pages). A property of the model's pool, as `block_size`. See `hf_paged.kv_format` and the
            "Quantized pages" section of docs/design.md.
        kv_offload (`dict`, *optional*): tiers that keep the prefix cache's blocks beyond the pool and across
            processes: `{"dir": PATH, "disk_bytes": "20GiB", "remote": "redis://HOST:PORT/DB", "host_bytes":
            "4GiB"}` (see `hf_paged.offload.OffloadConfig`). Attached to the model's pool; off by default.

    Example:

    ```python
    >>> PagedCacheConfig.from_dict({"block_size": 8, "max_memory": "64MiB"}).block_size
    8

    ```
    """

    block_size: int | None = None
    num_blocks: int | None = None
    max_memory: int | None = None
    memory_fraction: float | None = None
    attn_implementation: str | None = None
    prefix_caching: bool | None = None
    kernel: str | None = None
    kv_dtype: str | None = None
    kv_offload: object = None

    @classmethod
    def from_dict(cls, options: dict | PagedCacheConfig | None) -> PagedCacheConfig:
        """The config of `cache_config` options (a dict, or a `PagedCacheConfig` itself)."""
        if isinstance(options, PagedCacheConfig):
            options = options.options()
        if options is not None and not isinstance(options, Mapping):
            raise TypeError(
                f"cache_config must be a dict or a PagedCacheConfig, got {type(options).__name__} {options!r}"
            )
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown cache_config key(s) {unknown}; hf_paged understands {sorted(known)}")
        config = cls(**options)
        config._validate()
        return config

    def _validate(self) -> None:
        for name in ("block_size", "num_blocks"):
            value = getattr(self, name)
            if value is None or (name == "block_size" and value == "auto"):
                continue
            if name == "block_size" and isinstance(value, str):
                raise TypeError(f"cache_config block_size must be a positive int or 'auto', got {value!r}")
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"cache_config {name} must be a positive int, got {value!r}")
            if value <= 0:
                raise ValueError(f"cache_config {name} must be a positive int (>= 1), got {value}")
        if self.num_blocks is not None and self.max_memory is not None:
            raise ValueError(
                f"give either num_blocks ({self.num_blocks}) or max_memory ({self.max_memory!r}), not both"
            )
        if self.max_memory is not None:
            object.__setattr__(self, "max_memory", parse_memory(self.max_memory))
        fraction = self.memory_fraction
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))):
            raise TypeError(f"cache_config memory_fraction must be a number in (0, 1], got {fraction!r}")
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"cache_config memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.prefix_caching is not None and not isinstance(self.prefix_caching, bool):
            raise TypeError(f"cache_config prefix_caching must be True or False, got {self.prefix_caching!r}")
        if self.kernel is not None:
            check_kernel_name(self.kernel)
        if self.kv_dtype is not None:
            check_kv_dtype(self.kv_dtype)
        if self.kv_offload is not None:
            from .offload.config import OffloadConfig

            object.__setattr__(self, "kv_offload", OffloadConfig.from_dict(self.kv_offload))
            if self.kv_offload is not None and self.prefix_caching is False:
                raise ValueError(
                    "cache_config kv_offload keeps the prefix cache's blocks beyond the pool; with "
                    "prefix_caching=False there are none: drop one of them"
                )
        if self.attn_implementation is not None and not isinstance(self.attn_implementation, str):
            raise TypeError(f"cache_config attn_implementation must be a string, got {self.attn_implementation!r}")

    def options(self) -> dict:
        """The keys that were given, as `cache_config` keywords."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def block_size_on(self, device: torch.device | str) -> int:
        """The block size of a pool on `device`: the one given, `DEFAULT_BLOCK_SIZE`, or what `"auto"` picks there."""
        if self.block_size == "auto":
            return auto_block_size(device, self.kernel)
        if self.block_size is None and kv_format(self.resolved_kv_dtype).keys_per_channel:
            return CHANNEL_BLOCK_SIZE  # the group its keys are quantized over
        return self.block_size if self.block_size is not None else DEFAULT_BLOCK_SIZE

    @property
    def resolved_kv_dtype(self) -> str:
        return self.kv_dtype if self.kv_dtype is not None else "auto"

    @property
    def resolved_prefix_caching(self) -> bool:
        return self.prefix_caching is not False

    @property
    def resolved_attn_implementation(self) -> str:
        return self.attn_implementation or DEFAULT_ATTN_IMPLEMENTATION
