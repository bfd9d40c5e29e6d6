"""Keys quantized per channel over a whole block (`kv_dtype="int4-channel"`), and how such a block lies in memory.

Keys have a few channels that are large in every token (outliers with a steady sign), so a scale per token spends
its levels on them; a scale per channel does not, but needs every token of the group it covers. This format
therefore quantizes a block's keys only once the block is full: every channel of every KV head gets its own minimum
and step over the block's tokens (asymmetric, 4-bit codes 0..15, both bfloat16), after the vectors are rotated by
`kv_format.hadamard` as the other formats' are. Until then the block's keys are kept exactly, in the model's dtype,
in *staging*: companion blocks of the pool whose bytes hold the keys of the open block (`StagedLayout.companions`
of them per open block, taken from the same free queue, so the budget counts them). Values are quantized per token as
`"int4"` stores them, the moment they are written.

A block of one lane (one layer, `H` KV heads of `D` dims, `B` tokens) is one row of bytes:

| part | bytes | dtype |
|---|---|---|
| key codes `[B, H, D/2]` | `B*H*D/2` | uint8, two codes a byte |
| value codes `[B, H, D/2]` | `B*H*D/2` | uint8, two codes a byte |
| value scales `[B, H]` | `2*B*H` | bfloat16 |
| key steps and minimums `[H, 2, D]` | `4*H*D` | bfloat16 |

padded to a multiple of 16 bytes and of `B`. A companion block's row read as the model's dtype holds
`staging_tokens` tokens of keys `[H, D]`.

Example:

```python
>>> import torch
>>> keys = torch.randn(2, 16, 3, 64)                      # 2 full blocks of 16 tokens, 3 KV heads, head_dim 64
>>> codes, params = quantize_key_blocks(keys)
>>> codes.shape, params.shape, params.dtype               # params[:, :, 0]: steps, params[:, :, 1]: minimums
(torch.Size([2, 16, 3, 32]), torch.Size([2, 3, 2, 64]), torch.bfloat16)
>>> back = dequantize_keys(codes, params[:, None, :, 0], params[:, None, :, 1], torch.float32)
>>> bool((back - keys).abs().max() < 0.5)
True
>>> layout = StagedLayout(block_size=64, num_heads=3, head_dim=64)
>>> layout.row_bytes, layout.staging_tokens(torch.bfloat16), layout.companions(torch.bfloat16)
(13440, 35, 2)

```
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .kv_format import SCALE_DTYPE, rotate

LEVELS = 15  # 4-bit codes 0..15
CHANNEL_BLOCK_SIZE = 64  # the block size (and so the group of tokens keys are quantized over) unless one is given
_PARAM_MAX = torch.finfo(SCALE_DTYPE).max


def quantize_key_blocks(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes `[n, B, H, D/2]` (uint8, two a byte, low nibble first) and bfloat16 parameters `[n, H, 2, D]` (step,
    minimum) of full blocks of keys `[n, B, H, D]`: rotated, then every channel of every head over the block's
    tokens mapped onto 0..15 between its minimum and maximum."""
    x = rotate(keys.float())
    low = x.amin(dim=1).to(SCALE_DTYPE)
    high = x.amax(dim=1)
    step = ((high - low.float()) / LEVELS).clamp(max=_PARAM_MAX).to(SCALE_DTYPE)
    divisor = step.float()
    divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor))
    codes = torch.round((x - low.float()[:, None]) / divisor[:, None]).clamp_(0, LEVELS).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), torch.stack((step, low), dim=2)


def dequantize_keys(
    codes: torch.Tensor, steps: torch.Tensor, minimums: torch.Tensor, dtype: torch.dtype, rotate_back: bool = True
) -> torch.Tensor:
    """Keys `[..., D]` of codes `[..., D/2]` and their blocks' `steps` and `minimums` (`[..., D]`, broadcast):
    `code * step + minimum` in fp32, rotated back unless `rotate_back=False` (what an in-place kernel reads)."""
    low = (codes & 15).to(torch.int16)
    high = (codes >> 4).to(torch.int16)
    values = torch.stack((low, high), dim=-1).flatten(-2).float() * steps.float() + minimums.float()
    return (rotate(values) if rotate_back else values).to(dtype)


def round_trip_key_blocks(keys: torch.Tensor) -> torch.Tensor:
    """Full blocks of keys `[n, B, H, D]` as the pages give them back once quantized (for references and tests)."""
    codes, params = quantize_key_blocks(keys)
    return dequantize_keys(codes, params[:, None, :, 0], params[:, None, :, 1], keys.dtype)


@dataclass(frozen=True)
class StagedLayout:
    """Where each part of a block of one lane lies in its row of bytes (see the module docstring).

    Attributes:
        block_size, num_heads, head_dim (`int`): the lane's `B`, `H`, `D`.
    """

    block_size: int
    num_heads: int
    head_dim: int

    @property
    def code_bytes(self) -> int:
        """Bytes of one block's key (or value) codes."""
        return self.block_size * self.num_heads * self.head_dim // 2

    @property
    def value_scales_at(self) -> int:
        return 2 * self.code_bytes

    @property
    def key_params_at(self) -> int:
        return self.value_scales_at + 2 * self.block_size * self.num_heads

    @property
    def row_bytes(self) -> int:
        """One block of the lane, padded to a multiple of 16 bytes and of the block size."""
        used = self.key_params_at + 4 * self.num_heads * self.head_dim
        unit = math.lcm(16, self.block_size)
        return -(-used // unit) * unit

    def staging_tokens(self, dtype: torch.dtype) -> int:
        """Tokens of keys in `dtype` one companion block holds."""
        return self.row_bytes // (self.num_heads * self.head_dim * torch.finfo(dtype).bits // 8)

    def companions(self, dtype: torch.dtype) -> int:
        """Companion blocks that hold an open block's keys in `dtype`."""
        return -(-self.block_size // self.staging_tokens(dtype))
