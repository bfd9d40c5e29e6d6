"""Paged-attention kernels behind one call: attention over a layer's block storage as it lies.

`paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start, scale=...)` attends every row's
queries over the keys its block table names, causally, with grouped-query heads, an optional sliding window, logit
soft-cap and attention sinks. One call covers decode steps (one query per row), prefill chunks and mixed packed
steps. Backends:

- `"gather"`: the reference; copies each row's K/V out of the blocks, then attends with torch ops. Runs anywhere.
- `"cpu"`: reads the blocks in place, multi-threaded (C++ built at first use, see `kernels.build`); fp32, bf16, fp16.
- `"triton"`: reads the blocks in place on CUDA devices (`kernels.triton`; any block size; quantized pages too);
  needs `triton` (`pip install 'hf_paged[triton]'`). On the CPU it runs only under Triton's interpreter
  (`TRITON_INTERPRET=1`), which is how the tests prove it without a GPU.
- `"flash"`: flash-attn 2's paged kernels on CUDA (`kernels.flash`); needs `flash-attn` (`pip install
  'hf_paged[flash]'`), fp16/bf16 and blocks of a multiple of 256 tokens; the calls it cannot take go to the
  Triton kernel where it runs, else gather.

`resolve_kernel(name, device, block_size)` turns a `cache_config={"kernel": ...}` choice into a `KernelChoice`:
`"auto"` picks the fastest backend available for the device and block size and, per call, for the shape (on the
CPU, rows of at most `AUTO_CPU_MAX_QUERIES` (256) queries read in place; longer prompt chunks gather, where SDPA's
blocked matmuls catch up; on CUDA flash-attn where it takes the block size, else the Triton kernel, else gather).

Example:

```python
>>> import torch
>>> from hf_paged.kernels import paged_attention
>>> key_cache = value_cache = torch.randn(4, 16, 2, 8)     # 4 blocks of 16 tokens, 2 KV heads, head_dim 8
>>> query = torch.randn(3, 4, 8)                           # row 0: 1 query (decode); row 1: 2 queries
>>> out = paged_attention(
...     query, key_cache, value_cache,
...     block_tables=torch.tensor([[2, 0], [1, 3]], dtype=torch.int32),
...     seq_lens=torch.tensor([20, 5], dtype=torch.int32),         # row 0 holds 20 tokens, row 1 holds 5
...     query_start=torch.tensor([0, 1, 3], dtype=torch.int32),
...     scale=8**-0.5, kernel="gather",
... )
>>> out.shape
torch.Size([3, 4, 8])

```
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import warnings
from dataclasses import dataclass

import torch

from . import cpu, flash
from . import triton as triton_backend
from .build import KernelBuildError
from .reference import gather_paged_attention

KERNELS = ("auto", "gather", "cpu", "triton", "flash")
AUTO_CPU_MAX_QUERIES = 256  # measured: benchmarks/paged_kernel.py, benchmarks/in_place_queries.py (docs/benchmarks.md)
DEFAULT_BLOCK_SIZE = 16  # tokens per block unless cache_config names a size (or "auto" picks 256 for flash-attn)
DEFAULT_KERNEL = os.environ.get("HF_PAGED_KERNEL", "auto")

__all__ = [
    "AUTO_CPU_MAX_QUERIES",
    "DEFAULT_KERNEL",
    "KERNELS",
    "KernelChoice",
    "KernelUnavailableError",
    "auto_block_size",
    "available_kernels",
    "unavailable_reason",
    "in_place_backend",
    "paged_attention",
    "resolve_kernel",
]

logger = logging.getLogger(__name__)
_warned: set[str] = set()
_warn_lock = threading.Lock()


class KernelUnavailableError(ImportError, ValueError):
    """A backend asked for by name (`kernel="cpu"`, `"triton"`, `"flash"`) that cannot run here: its package is not
    installed (the message names the extra that installs it), the pool is on another device, it could not be built,
    or it cannot read the pool's block size. The message lists the kernels available here. An `ImportError` and a
    `ValueError`."""


@dataclass(frozen=True)
class KernelChoice:
    """Which backend a paged cache's attention calls, and for which shapes.

    Attributes:
        requested (`str`): what was asked for (one of `KERNELS`).
        backend (`str`): the backend that runs (`"gather"` where the requested one cannot run here).
        max_queries (`int`, *optional*): rows with more new tokens than this gather instead (`None`: no limit).
        fallback (`str`, *optional*): the in-place backend of the calls `backend` cannot take (flash-attn: fp32
            tensors, attention sinks); `None`: those calls gather.

    Example:

    ```python
    >>> choice = KernelChoice("auto", "cpu", max_queries=8)
    >>> choice.in_place, choice.takes(1), choice.takes(9)
    (True, True, False)

    ```
    """

    requested: str
    backend: str
    max_queries: int | None = None
    fallback: str | None = None

    @property
    def in_place(self) -> bool:
        """Whether calls read the blocks where they lie (any backend but `"gather"`)."""
        return self.backend != "gather"

    def takes(self, num_queries: int) -> bool:
        """Whether a row with `num_queries` new tokens goes to the in-place backend."""
        return self.in_place and (self.max_queries is None or num_queries <= self.max_queries)

    def backend_for(self, query: torch.Tensor, key_cache: torch.Tensor) -> str | None:
        """The in-place backend that runs a call on these tensors: `backend`, else `fallback`, where it `supports`
        them; `None`: the call gathers."""
        readers = getattr(key_cache, "in_place_backends", None)  # pages only some backends read (StagedPages)
        for name in (self.backend, self.fallback):
            if name is None or name == "gather" or (readers is not None and name not in readers):
                continue
            if in_place_backend(name).supports(query, key_cache):
                return name
        return None


# name -> module with supports(query, key_cache) and attention(...)
_IN_PLACE_BACKENDS = {"cpu": cpu, "triton": triton_backend, "flash": flash}
_PACKAGES = {"triton": triton_backend, "flash": flash}  # backends needing a package, with `available()`


def in_place_backend(name: str):
    """The module of in-place backend `name`: `supports(query, key_cache)` and `attention(...)` (the arguments of
    `paged_attention`, positionally, without `kernel`)."""
    return _IN_PLACE_BACKENDS[name]


def auto_block_size(device: torch.device | str, kernel: str | None = None) -> int:
    """The block size `cache_config={"block_size": "auto"}` picks on `device` for `kernel` (`None`: `DEFAULT_KERNEL`):
    the one the fastest backend there reads: `flash.BLOCK_MULTIPLE` (256) on CUDA where flash-attn is installed and
    the kernel may be flash-attn, else `DEFAULT_BLOCK_SIZE` (16: the CPU kernel and the Triton kernel read any size;
    16 wastes little at the end of a sequence).

    Example:

    ```python
    >>> auto_block_size("cpu")
    16

    ```
    """
    name = check_kernel_name(DEFAULT_KERNEL if kernel is None else kernel)
    if torch.device(device).type == "cuda" and name in ("auto", "flash") and flash.available():
        return flash.BLOCK_MULTIPLE
    return DEFAULT_BLOCK_SIZE


def check_kernel_name(name) -> str:
    if not isinstance(name, str) or name not in KERNELS:
        raise ValueError(f"cache_config kernel must be one of {list(KERNELS)}, got {name!r}")
    return name


def _warn_once(key: str, message: str) -> None:
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _log_once(key: str, message: str) -> None:
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.info(message)


def available_kernels(device: torch.device | str, block_size: int | None = None) -> list[str]:
    """The names `cache_config={"kernel": ...}` accepts on `device` with blocks of `block_size` tokens: `"auto"` and
    `"gather"` everywhere, and each in-place backend that runs here (`"cpu"` where it builds; `"triton"` with its
    package on CUDA, or on the CPU under `TRITON_INTERPRET=1`; `"flash"` with flash-attn on CUDA, for blocks of a
    multiple of 256).

    Example:

    ```python
    >>> available_kernels("cpu")[:3]
    ['auto', 'gather', 'cpu']

    ```
    """
    return ["auto", "gather"] + [
        name for name in ("cpu", "triton", "flash") if _cannot_run(name, torch.device(device), block_size) is None
    ]


def unavailable_reason(name: str, device: torch.device | str, block_size: int | None = None) -> str | None:
    """Why `cache_config={"kernel": name}` cannot run on `device` with blocks of `block_size` tokens, or `None`
    (always `None` for `"auto"` and `"gather"`)."""
    name = check_kernel_name(name)
    return None if name in ("auto", "gather") else _cannot_run(name, torch.device(device), block_size)


def _cannot_run(name: str, device: torch.device, block_size: int | None) -> str | None:
    """Why in-place backend `name` cannot run on `device` with blocks of `block_size` tokens, or `None`."""
    if name == "cpu":
        if device.type != "cpu":
            return f"it reads blocks in CPU memory, and the pool is on {device}"
        try:
            cpu.library()
        except (KernelBuildError, RuntimeError) as error:
            return f"it could not be built here ({error})"
        return None
    if not _PACKAGES[name].available():
        package = "triton" if name == "triton" else "flash-attn"
        return f"it needs the {package} package, which is not installed: {_PACKAGES[name].INSTALL_HINT}"
    if name == "triton":
        runs = triton_backend.runs_on(device)
        return None if runs else "it runs on CUDA devices (or the CPU under TRITON_INTERPRET=1)"
    if device.type != "cuda":
        return f"it runs on CUDA devices, and the pool is on {device}"
    if block_size is not None and not flash.accepts_block_size(block_size):
        return (
            f"flash-attn 2 reads paged K/V in blocks of a multiple of {flash.BLOCK_MULTIPLE} tokens, not {block_size} "
            f"(cache_config block_size={flash.BLOCK_MULTIPLE} runs it)"
        )
    return None


def resolve_kernel(name: str | None, device: torch.device | str, block_size: int | None = None) -> KernelChoice:
    """The `KernelChoice` of `cache_config={"kernel": name}` on `device` with blocks of `block_size` tokens (`None`:
    `DEFAULT_KERNEL`; `block_size=None`: any). `"auto"` chooses silently: on CUDA flash-attn where installed and the
    block size allows it, then the Triton kernel, then gather; on the CPU the in-place kernel, gathering for rows of
    more than `AUTO_CPU_MAX_QUERIES` queries (and everywhere, with one warning, when it cannot be built). A backend
    asked for by name runs, or is refused.

    Raises:
        ValueError: `name` is not one of `KERNELS`.
        KernelUnavailableError: a backend asked for by name cannot run here (its package is missing, another device,
            not built, a block size it cannot read); the message says why and lists the kernels available here.
    """
    name = check_kernel_name(DEFAULT_KERNEL if name is None else name)
    device = torch.device(device)
    if name == "gather":
        return KernelChoice(name, "gather")
    if name != "auto":
        reason = _cannot_run(name, device, block_size)
        if reason is not None:
            raise KernelUnavailableError(
                f"cache_config kernel={name!r} cannot run here: {reason}. Kernels available on {device}"
                f"{'' if block_size is None else f' with blocks of {block_size} tokens'}: "
                f"{available_kernels(device, block_size)}"
            )
        return _flash_choice(name) if name == "flash" else KernelChoice(name, name)
    if device.type == "cuda":
        if _cannot_run("flash", device, block_size) is None:
            return _flash_choice(name)
        backend = "triton" if triton_backend.available() else "gather"
        if flash.available():  # installed, but not for this block size
            _log_once(
                f"flash-block:{block_size}",
                f"hf_paged: flash-attn 2 reads paged K/V in blocks of a multiple of {flash.BLOCK_MULTIPLE} tokens, "
                f"not {block_size}; kernel='auto' uses kernel={backend!r} (cache_config block_size="
                f"{flash.BLOCK_MULTIPLE} runs flash-attn)",
            )
        return KernelChoice(name, backend)
    if device.type != "cpu":
        return KernelChoice(name, "gather")
    reason = _cannot_run("cpu", device, block_size)
    if reason is not None:
        _warn_once(
            "cpu-build",
            f"hf_paged: the CPU paged-attention kernel is not available: {reason}; attention gathers K/V instead "
            "(kernel='gather'): correct, but slower at long contexts. Install a C++ compiler (g++ or clang++, or "
            "set HF_PAGED_CXX) to read the blocks in place.",
        )
        return KernelChoice(name, "gather")
    return KernelChoice(name, "cpu", AUTO_CPU_MAX_QUERIES)


def _flash_choice(requested: str) -> KernelChoice:
    """flash-attn, the Triton kernel (where installed) taking the calls flash-attn cannot (fp32, attention sinks)."""
    return KernelChoice(requested, "flash", fallback="triton" if triton_backend.available() else None)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """Paged attention of packed queries over K/V read through block tables.

    Args:
        query (`torch.Tensor`): `[tokens, q_heads, head_dim]`: every row's new tokens, row after row.
        key_cache, value_cache (`torch.Tensor`): one layer's blocks, `[num_blocks, block_size, kv_heads, head_dim]`
            (`q_heads` a multiple of `kv_heads`; query head `h` reads KV head `h // (q_heads // kv_heads)`).
        block_tables (`torch.Tensor`): int32 `[rows, max_blocks]`: row `r`'s logical block `i` is physical block
            `block_tables[r, i]`; entries past a row's blocks must still be valid block ids.
        seq_lens (`torch.Tensor`): int32 `[rows]`: tokens of every row, this call's new ones included.
        query_start (`torch.Tensor`): int32 `[rows + 1]`: row `r`'s queries are `query[query_start[r] :
            query_start[r + 1]]`, its last tokens (query `i` of `n` sits at position `seq_lens[r] - n + i`).
        scale (`float`): logit scale.
        window (`int`, *optional*): sliding window: a query at position `p` sees keys `k` with `p - k < window`.
        softcap (`float`, *optional*): logits become `softcap * tanh(logits / softcap)`.
        sinks (`torch.Tensor`, *optional*): `[q_heads]` logits that take softmax mass and carry no value.
        kernel (`str`): `"auto"` (in place where the device has a backend), `"gather"`, `"cpu"`, `"triton"`,
            `"flash"`.

    Returns:
        `torch.Tensor`: `[tokens, q_heads, head_dim]` in the query's dtype.
    """
    choice = resolve_kernel(kernel, query.device, key_cache.shape[1])
    args = (query, key_cache, value_cache, block_tables, seq_lens, query_start, scale, window, softcap, sinks)
    backend = choice.backend_for(query, key_cache)
    if backend is None:
        return gather_paged_attention(*args)
    in_place = in_place_backend(backend).attention
    if choice.max_queries is None or query.device.type != "cpu":
        return in_place(*args)
    starts = query_start.tolist()  # on the CPU: no device read
    counts = [end - start for start, end in zip(starts, starts[1:])]
    if max(counts, default=0) <= choice.max_queries:
        return in_place(*args)
    # "auto" on the CPU: rows of more queries than the kernel takes well gather (as the "hf_paged" attention does)
    output = torch.empty_like(query)
    for function, rows in (
        (in_place, [r for r, count in enumerate(counts) if count <= choice.max_queries]),
        (gather_paged_attention, [r for r, count in enumerate(counts) if count > choice.max_queries]),
    ):
        if not rows:
            continue
        tokens = torch.tensor([t for r in rows for t in range(starts[r], starts[r + 1])])
        row_index = torch.tensor(rows)
        part_start = torch.tensor([0, *itertools.accumulate(counts[r] for r in rows)], dtype=query_start.dtype)
        output[tokens] = function(
            query.index_select(0, tokens),
            key_cache,
            value_cache,
            block_tables.index_select(0, row_index),
            seq_lens.index_select(0, row_index),
            part_start,
            scale,
            window,
            softcap,
            sinks,
        )
    return output
