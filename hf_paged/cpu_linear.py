"""Faster CPU matmuls for a model's `nn.Linear` layers: weights packed once into oneDNN's blocked layout.

On CPU, torch's `nn.Linear` multiplies through its BLAS (MKL in the x86 wheels) with the weight as it lies, every
call. oneDNN (shipped inside torch as `torch.ops.mkldnn`) can reorder a weight once into the blocked layout its
matmul kernels read best and keep it; with the small row counts of decoding (1-64 tokens a step) that is much faster
on some CPUs (SmolLM2's forward on an AMD EPYC, 2 threads: 1.3x at 1 token, 1.6x at 8, 1.7x at 64;
benchmarks/cpu_linear.py, docs/benchmarks.md). vLLM's CPU backend multiplies the same way.

The results are a different summation order of the same products: they differ from stock `nn.Linear` by float
rounding (about 1e-7 relative in fp32), so greedy tokens may differ from an unpacked model's at near-ties. Paged
generation stays exact against `DynamicCache` on the *same* packed model. Packing is therefore opt-in
(`Engine(..., cpu_linear="onednn")`, `hf-paged serve --cpu-linear onednn`) and undone by `unpack_linears`.

A packed layer falls back to stock `nn.Linear` for any call the packed weight cannot answer exactly as asked:
gradients needed (training), an input of another dtype or device. A weight changed in place (an optimizer step, a
merged adapter) is packed again on the next call (its version counter moved); a weight replaced by another tensor
likewise.

Example:

```python
>>> import torch
>>> from hf_paged.cpu_linear import pack_linears, unpack_linears
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
>>> x = torch.randn(3, 8)
>>> with torch.no_grad():
...     stock = model(x)
...     packed = pack_linears(model)
...     fast = model(x)
>>> packed, torch.allclose(fast, stock, atol=1e-5)
(2, True)
>>> unpack_linears(model)
2

```
"""

from __future__ import annotations

import functools
import types

import torch

CPU_LINEARS = ("stock", "onednn")
PACKED_DTYPES = (torch.float32, torch.bfloat16)
_BATCH_HINT = 64  # the row count oneDNN tunes the packed layout for; any count runs


@functools.lru_cache(maxsize=1)
def onednn_available() -> bool:
    """Whether this torch can pack linear weights with oneDNN (CPU builds with MKL-DNN: the x86 and arm64 wheels)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2), 1)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), weight, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(out, torch.full((1, 2), 2.0)))


def check_cpu_linear(name) -> str:
    """`name` if it is one of `CPU_LINEARS`, else a `ValueError` naming it and the choices."""
    if not isinstance(name, str) or name not in CPU_LINEARS:
        raise ValueError(f"cpu_linear must be one of {list(CPU_LINEARS)}, got {name!r}")
    return name


def packable(module: torch.nn.Module) -> bool:
    """Whether `module` is a stock `nn.Linear` (not a subclass, which may compute otherwise) whose weight is a plain
    CPU tensor of a packed dtype (not a tensor-parallel shard, a quantized or a meta tensor)."""
    if type(module) is not torch.nn.Linear:
        return False
    weight = module.weight
    return type(weight.data) is torch.Tensor and weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES


def pack_linears(model: torch.nn.Module) -> int:
    """Pack the weight of every stock `nn.Linear` of `model` on the CPU for oneDNN's matmul and route the layer's
    calls through it (see the module docstring); returns how many layers are packed now. Packing twice does
    nothing more. Raises `RuntimeError` where this torch has no oneDNN."""
    if not onednn_available():
        raise RuntimeError(
            "cpu_linear='onednn' needs torch's oneDNN (MKL-DNN) CPU matmul, which this torch build lacks "
            f"(torch {torch.__version__}); use cpu_linear='stock'"
        )
    count = 0
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), _PackedForward):
            count += 1
        elif packable(module):
            module.forward = _PackedForward(module)
            count += 1
    return count


def unpack_linears(model: torch.nn.Module) -> int:
    """Give every layer `pack_linears` packed its stock forward back (and drop the packed weights); returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), _PackedForward):
            del module.forward
            count += 1
    return count


def packed_linears(model: torch.nn.Module) -> int:
    """How many of `model`'s layers are packed."""
    return sum(isinstance(m.__dict__.get("forward"), _PackedForward) for m in model.modules())


class _PackedForward:
    """The forward of one packed `nn.Linear`: oneDNN's matmul over the packed weight, or the stock forward."""

    def __init__(self, module: torch.nn.Linear):
        self.stock = types.MethodType(torch.nn.Linear.forward, module)
        self.module = module
        self.packed: torch.Tensor | None = None
        self.source: tuple | None = None  # `_identity` of the weight the packed copy was made from

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.module.weight
        if (
            x.dtype != weight.dtype
            or x.device.type != "cpu"
            or not packable(self.module)
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        ):
            return self.stock(x)
        source = _identity(weight)
        if source != self.source:
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
            self.source = source
        bias = self.module.bias
        return torch.ops.mkldnn._linear_pointwise(
            x, self.packed, None if bias is None else bias.detach(), "none", [], ""
        )


def _identity(weight: torch.Tensor) -> tuple:
    """What changes when `weight` is replaced or written in place: the tensor, its storage and its version counter
    (a tensor made under `torch.inference_mode` has none: its storage stands for it)."""
    try:
        version = weight._version
    except RuntimeError:
        version = None
    return id(weight), weight.data_ptr(), version
