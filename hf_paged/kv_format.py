"""How the pool stores a token's K/V: in the model's dtype (`"auto"`), or quantized to 8 or 4 bits with a scale per
token and KV head that lives in the block next to its codes.

A quantized token is written once and never re-quantized: its scale depends on its own values only (absmax of the
head's `head_dim` channels, symmetric), so a block being filled, copied on write or shared by prefix caching holds
exactly the codes and scales written, and every reader (the gather reference, the CPU kernel) dequantizes the same
values: `code * scale`, in fp32. A code is a step function of its K/V: the same tokens' K/V computed in a batch of
another shape differ by float rounding and can get other codes, so a block shared by prefix caching holds the codes
of the call that computed it, not always those a later call would write (docs/exactness.md).

A per-token scale is set by the vector's largest channel, and keys have a few outlier channels: the others get
few levels (SmolLM2 with plain per-token int4: perplexity +52%; plain int8: 54% of greedy 64-token continuations
identical to unquantized pages). Both formats therefore store every K and V vector rotated by an orthonormal
Hadamard matrix `H` (Walsh-Hadamard over the head dim, block-diagonal where the head dim is not a power of two),
which spreads an outlier over all channels (int4: +10%; int8: 84% identical; benchmarks/kv_quant.py and
docs/benchmarks.md). Attention is unchanged by the rotation:
`q . k = (q H) . (k H)` and `sum p v = (sum p (v H)) H` (`H` is its own inverse), so a kernel rotates the queries
once, attends over the rotated pages as they lie, and rotates its output back; the gather reference rotates the
dequantized K/V back instead. Scales are bfloat16: 2 bytes a token and head, with the range of float32 (no
vector is too small or too large to scale).

| `kv_dtype` | codes              | bytes per token and head (head_dim 64) | vs bfloat16 | vs float32 |
|------------|--------------------|----------------------------------------|-------------|------------|
| `"auto"`   | the model's dtype  | 128 (bf16), 256 (fp32)                 | 1           | 0.5        |
| `"int8"`   | int8, -127..127    | 64 + 2                                 | 0.516       | 0.258      |
| `"int4"`   | two a byte, -7..7  | 32 + 2                                 | 0.266       | 0.133      |

Example:

```python
>>> import torch
>>> fmt = KVFormat("int8", bits=8)                          # int8 codes, not rotated (to show them)
>>> x = torch.tensor([[[127.0, -254.0, 50.0, 0.0]]])       # 1 token, 1 head, head_dim 4
>>> codes, scales = fmt.quantize(x)                         # scale: absmax / 127 = 2.0
>>> codes, scales
(tensor([[[  64, -127,   25,    0]]], dtype=torch.int8), tensor([[2.]], dtype=torch.bfloat16))
>>> fmt.dequantize(codes, scales, torch.float32)
tensor([[[ 128., -254.,   50.,    0.]]])
>>> codes, scales = kv_format("int4").quantize(x)         # kv_dtype="int4": rotated, two codes a byte
>>> codes.shape, codes.dtype
(torch.Size([1, 1, 2]), torch.uint8)

```
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

KV_DTYPES = ("auto", "int8", "int4", "int4-channel")
SCALE_DTYPE = torch.bfloat16
_SCALE_MAX = torch.finfo(SCALE_DTYPE).max


def check_kv_dtype(name) -> str:
    """`name` if it is one of `KV_DTYPES`, else a `ValueError` naming it and the choices."""
    if not isinstance(name, str) or name not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {list(KV_DTYPES)}, got {name!r}")
    return name


@dataclass(frozen=True)
class KVFormat:
    """One way of storing K/V in the pool.

    Attributes:
        name (`str`): one of `KV_DTYPES`.
        bits (`int`, *optional*): bits a value for quantized formats; `None` for `"auto"` (the model's dtype).
        rotated (`bool`): vectors are stored rotated by `hadamard(head_dim)` (see the module docstring).
        keys_per_channel (`bool`): keys are quantized per channel over each full block, a block's keys kept in full
            precision until it fills (`hf_paged.channel_keys`); values as the other formats, per token.
    """

    name: str
    bits: int | None = None
    rotated: bool = False
    keys_per_channel: bool = False

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def max_code(self) -> int:
        """The largest code magnitude (127 for 8 bits, 7 for 4 bits; symmetric, so 0 is exact)."""
        return 2 ** (self.bits - 1) - 1

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.int8 if self.bits == 8 else torch.uint8

    def code_dim(self, head_dim: int) -> int:
        """Bytes of codes of one token's head."""
        return head_dim * self.bits // 8

    def bytes_per_head(self, head_dim: int, dtype: torch.dtype) -> int:
        """What one token's K (or V) of one head costs, scale included."""
        if not self.quantized:
            return head_dim * torch.finfo(dtype).bits // 8
        return self.code_dim(head_dim) + torch.finfo(SCALE_DTYPE).bits // 8

    def check_head_dim(self, head_dim: int, where: str = "the model") -> None:
        """Refuse a head dim this format cannot hold (4 bits packs two channels a byte: an even head dim)."""
        if self.quantized and (head_dim * self.bits) % 8:
            raise ValueError(
                f"kv_dtype={self.name!r} packs {8 // self.bits} values a byte and needs an even head_dim, but "
                f"{where} has head_dim={head_dim}; use kv_dtype='int8' or 'auto'"
            )

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes `[..., code_dim]` and bfloat16 scales `[...]` of `x` (`[..., head_dim]`), each vector on its own
        (rotated first where the format is `rotated`)."""
        x = x.float()
        if self.rotated:
            x = rotate(x)
        absmax = x.abs().amax(dim=-1)
        scales = (absmax / self.max_code).clamp(max=_SCALE_MAX).to(SCALE_DTYPE)
        divisor = scales.float()
        divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor))
        codes = torch.round(x / divisor[..., None]).clamp_(-self.max_code, self.max_code)
        if self.bits == 8:
            return codes.to(torch.int8), scales
        nibbles = (codes + 8).to(torch.uint8)  # 1..15, 8 is zero
        return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4), scales

    def store(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor) -> None:
        """Quantize `x` (`[tokens, heads, head_dim]`) and write token `i`'s codes and scales into slot `slots[i]` of
        `codes` and `scales` (`[num_blocks, block_size, heads, ...]`), in place."""
        new_codes, new_scales = self.quantize(x)
        codes.view(-1, *new_codes.shape[1:]).index_copy_(0, slots, new_codes)
        scales.view(-1, new_scales.shape[1]).index_copy_(0, slots, new_scales)

    def dequantize(
        self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, rotate_back: bool = True
    ) -> torch.Tensor:
        """`[..., head_dim]` values of `codes` and `scales` in `dtype` (computed in fp32, as the kernels do);
        `rotate_back=False` leaves a `rotated` format's values as stored (what a kernel reads)."""
        if self.bits == 8:
            values = codes.float()
        else:
            low = (codes & 15).to(torch.int16) - 8
            high = (codes >> 4).to(torch.int16) - 8
            values = torch.stack((low, high), dim=-1).flatten(-2).float()
        values = values * scales.float()[..., None]
        if self.rotated and rotate_back:
            values = rotate(values)
        return values.to(dtype)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """`x` as the pages give it back: quantized and dequantized (itself for `"auto"`)."""
        if not self.quantized:
            return x
        return self.dequantize(*self.quantize(x), x.dtype)

    def round_trip_bound(self, x: torch.Tensor) -> torch.Tensor:
        """The largest error `dequantize(quantize(x))` may make on an element of each vector of `x` (`[...]`): half
        a scale step, plus the bfloat16 rounding of the scale itself (a `rotated` format: of the rotated vector,
        whose error spreads over the head dim: bounded by the vector's L2 error, `sqrt(head_dim)` such steps)."""
        x = x.float()
        if not self.rotated:
            return x.abs().amax(dim=-1) / self.max_code * (0.5 + 2.0**-8) + 1e-12
        step = rotate(x).abs().amax(dim=-1) / self.max_code * (0.5 + 2.0**-8)
        return step * x.shape[-1] ** 0.5 + 1e-6 * x.abs().amax(dim=-1) + 1e-12


FORMATS = {
    "auto": KVFormat("auto"),
    "int8": KVFormat("int8", 8, rotated=True),
    "int4": KVFormat("int4", 4, rotated=True),
    "int4-channel": KVFormat("int4-channel", 4, rotated=True, keys_per_channel=True),
}


@functools.lru_cache(maxsize=16)
def hadamard(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal, symmetric (so self-inverse) `[head_dim, head_dim]` float32 rotation of rotated formats:
    Walsh-Hadamard blocks of the largest power of two dividing `head_dim`, on the diagonal.

    Example:

    ```python
    >>> h = hadamard(4)
    >>> h * 2
    tensor([[ 1.,  1.,  1.,  1.],
            [ 1., -1.,  1., -1.],
            [ 1.,  1., -1., -1.],
            [ 1., -1., -1.,  1.]])
    >>> torch.allclose(h @ h, torch.eye(4))
    True

    ```
    """
    size = head_dim & -head_dim  # the largest power of two dividing head_dim
    block = torch.ones(1, 1)
    while block.shape[0] < size:
        block = torch.cat([torch.cat([block, block], 1), torch.cat([block, -block], 1)], 0)
    block = block / size**0.5
    return torch.block_diag(*[block] * (head_dim // size)).to(device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """`x @ hadamard(head_dim)` over the last dim, in fp32 (its own inverse)."""
    return x.float() @ hadamard(x.shape[-1], x.device)


def attends_rotated_pages(attention):
    """Let a kernel's `attention(query, key_cache, value_cache, *args, out=None)`, which reads K/V as the pages hold
    them, attend quantized pages stored rotated: the queries are rotated in and the output back out (attention is
    unchanged by the rotation, see the module docstring); pages with `keys_per_channel` (`StagedPages`) also get the
    query as it is, `query_plain`, for their open blocks' keys, which are stored unrotated. Any other call goes
    through as it is."""

    @functools.wraps(attention)
    def wrapper(query, key_cache, value_cache, *args, out=None, **kwargs):
        if getattr(key_cache, "keys_per_channel", False):  # StagedPages: open blocks' keys are stored unrotated
            kwargs["query_plain"] = query
        elif not (isinstance(key_cache, QuantizedPages) and key_cache.format.rotated):
            return attention(query, key_cache, value_cache, *args, out=out, **kwargs)
        rotated = attention(rotate(query).to(query.dtype), key_cache, value_cache, *args, **kwargs)
        result = rotate(rotated).to(query.dtype)
        return result if out is None else out.copy_(result)

    return wrapper


def kv_format(name: str | None) -> KVFormat:
    """The `KVFormat` named `name` (`None`: `"auto"`)."""
    return FORMATS[check_kv_dtype("auto" if name is None else name)]


class QuantizedPages:
    """One layer's K (or V) blocks in a quantized format, as the kernels read them: `codes` `[num_blocks,
    block_size, num_kv_heads, code_dim]` and `scales` `[num_blocks, block_size, num_kv_heads]`. Looks like the
    dense blocks it stands for where the kernels look: `shape` (`[..., head_dim]`), `dtype` (the dtype it is read
    back in: the model's), `device`.

    Example:

    ```python
    >>> import torch
    >>> fmt = kv_format("int8")
    >>> codes, scales = fmt.quantize(torch.randn(4, 16, 2, 8))
    >>> pages = QuantizedPages(fmt, codes, scales, torch.float32)
    >>> pages.shape, pages.dequantize().shape
    (torch.Size([4, 16, 2, 8]), torch.Size([4, 16, 2, 8]))

    ```
    """

    def __init__(self, fmt: KVFormat, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
        self.format = fmt
        self.codes = codes
        self.scales = scales
        self.dtype = dtype
        head_dim = codes.shape[-1] * 8 // fmt.bits
        self.shape = torch.Size((*codes.shape[:-1], head_dim))

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dequantize(self) -> torch.Tensor:
        """Every block read back (for tests and the reference)."""
        return self.format.dequantize(self.codes, self.scales, self.dtype)

    def __repr__(self) -> str:
        return f"QuantizedPages({self.format.name}, shape={tuple(self.shape)}, dtype={self.dtype})"
