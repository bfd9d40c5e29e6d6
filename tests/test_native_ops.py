"""`kernels.native_ops`: the CPU kernel registered as the CPU implementation of `hf_paged::paged_attention` and
`hf_paged::write_kv`. What it must show: the C++ implementation is what runs on CPU tensors once loaded, its results
are bit-equal to the Python implementation's for every call (those it takes and those it passes on), a bad slot is
refused before anything is written, and without it (not built, or `HF_PAGED_NATIVE_OPS=0`) the Python
implementation serves."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged.kernels import AUTO_CPU_MAX_QUERIES, native_ops, ops
from hf_paged.kv_format import kv_format

from .test_kernels import random_call

pytestmark = pytest.mark.skipif(not native_ops.load(), reason="the CPU ops could not be built here")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]  # float64: the kernel passes it on


def test_the_cpu_implementation_is_the_cpp_one_once_loaded():
    dump = torch._C._dispatch_dump("hf_paged::paged_attention")
    cpu_line = next(line for line in dump.splitlines() if line.startswith("CPU:"))
    assert "paged_ops_cpu.cpp" in cpu_line
    assert torch._C._dispatch_has_kernel_for_dispatch_key("hf_paged::write_kv", "CPU")
    # the op it passes calls on to has no CPU kernel of its own: the Python implementation
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("hf_paged::paged_attention_any", "CPU")


def test_the_python_implementation_can_be_put_back_for_a_block_and_the_cpp_one_returns():
    def cpu_kernel_source() -> str:
        dump = torch._C._dispatch_dump("hf_paged::paged_attention")
        return next(line for line in dump.splitlines() if line.startswith("CPU:"))

    query, key_cache, value_cache, tables, seq_lens, starts = random_call(2, [40, 9], [1, 3], head_dim=32)
    args = (query, key_cache, value_cache, tables, seq_lens, starts, 0.2, None, None, None, "auto")
    native = ops.paged_attention(*args)
    with native_ops.python_implementation():
        assert "paged_ops_cpu.cpp" not in cpu_kernel_source()
        assert torch.equal(ops.paged_attention(*args), native)
    assert "paged_ops_cpu.cpp" in cpu_kernel_source()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 4),
    dtype=st.sampled_from(DTYPES),
    backend=st.sampled_from(["auto", "cpu", "gather"]),
    window=st.sampled_from([None, 7, 40]),
    softcap=st.sampled_from([None, 5.0]),
    sinks=st.booleans(),
    long_row=st.booleans(),
)
def test_results_are_bit_equal_to_the_python_implementation(
    seed, rows, dtype, backend, window, softcap, sinks, long_row
):
    lengths = [(seed * (row + 3)) % 90 + 1 for row in range(rows)]
    counts = [1 + (seed + row) % min(length, 5) for row, length in enumerate(lengths)]
    if long_row:  # a prefill row of more queries than "auto" reads in place: the call goes on to Python (gather)
        lengths[0], counts[0] = AUTO_CPU_MAX_QUERIES + 20, AUTO_CPU_MAX_QUERIES + 1
    query, key_cache, value_cache, tables, seq_lens, starts = random_call(
        seed, lengths, counts, kv_heads=2, group=3, head_dim=32, dtype=dtype
    )
    sink_logits = torch.randn(query.shape[1]).to(dtype) if sinks else None
    args = (query, key_cache, value_cache, tables, seq_lens, starts, 0.17, window, softcap, sink_logits, backend)
    with torch.inference_mode():
        native, python = ops.paged_attention(*args), ops.paged_attention_any(*args)
    assert native.dtype == dtype and native.is_contiguous()
    assert torch.equal(native, python)


def test_a_strided_query_and_a_one_dimensional_call_match_too():
    query, key_cache, value_cache, tables, seq_lens, starts = random_call(3, [40, 9], [1, 1], head_dim=32)
    wide = torch.randn(query.shape[0], query.shape[1], 64)[..., :32]  # rows of 64, head_dim contiguous
    wide.copy_(query)
    for q in (wide, query.transpose(0, 1).contiguous().transpose(0, 1)):  # token stride 32, head stride 2 * 32
        args = (q, key_cache, value_cache, tables, seq_lens, starts, 0.2, None, None, None, "cpu")
        assert torch.equal(ops.paged_attention(*args), ops.paged_attention_any(*args))


@pytest.mark.parametrize("case", ["direct", "converted", "strided"])
def test_write_kv_stores_what_index_copy_stores(case):
    generator = torch.Generator().manual_seed(1)
    key_cache, value_cache = torch.randn(6, 4, 2, 8, generator=generator), torch.randn(6, 4, 2, 8, generator=generator)
    keys, values = torch.randn(5, 2, 8, generator=generator), torch.randn(5, 2, 8, generator=generator)
    if case == "converted":
        keys, values = keys.to(torch.bfloat16), values.to(torch.bfloat16)
    elif case == "strided":
        keys, values = keys.transpose(0, 1).contiguous().transpose(0, 1), values[:, :, :]
    slots = torch.tensor([23, 0, 9, 10, 4])
    expected = key_cache.clone(), value_cache.clone()
    ops.PYTHON_IMPLEMENTATIONS["write_kv"](*expected, slots, keys, values)
    ops.write_kv(key_cache, value_cache, slots, keys, values)
    assert torch.equal(key_cache, expected[0]) and torch.equal(value_cache, expected[1])


@pytest.mark.parametrize("slot", [-1, 24])
def test_write_kv_refuses_a_slot_outside_the_blocks_before_writing_anything(slot):
    key_cache, value_cache = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)
    with pytest.raises(RuntimeError, match=f"slot {slot} is out of bounds for 24 slots"):
        ops.write_kv(key_cache, value_cache, torch.tensor([3, slot]), torch.ones(2, 2, 8), torch.ones(2, 2, 8))
    assert not key_cache.any() and not value_cache.any()  # slot 3, before the bad one, was not written either


_SMALL_CALL = """
cache = torch.zeros(2, 4, 1, 8)
ops.write_kv(cache, cache.clone(), torch.tensor([5]), torch.ones(1, 1, 8), torch.ones(1, 1, 8))
out = ops.paged_attention(torch.ones(1, 2, 8), cache, cache, torch.tensor([[1]], dtype=torch.int32),
                          torch.tensor([2], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 1.0)
result = f"{float(cache[1, 1].sum())} {out.sum().item()}"
"""


def test_the_python_implementation_serves_where_the_cpp_one_is_off():
    # HF_PAGED_NATIVE_OPS=0 and a machine without a compiler: no CPU kernel registered, the same results
    script = "\n".join(
        [
            "import torch",
            "from hf_paged.kernels import native_ops, ops",
            "print(native_ops.load(), native_ops.load(), native_ops.loaded())",
            'print(torch._C._dispatch_has_kernel_for_dispatch_key("hf_paged::paged_attention", "CPU"))',
            _SMALL_CALL,
            "print(result)",
        ]
    )
    here = {"torch": torch, "ops": ops}
    exec(_SMALL_CALL, here)  # the C++ implementation, in this process
    expected = ["False False False", "False", here["result"]]
    env = {**os.environ, native_ops.DISABLE_VARIABLE: "0"}
    off = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert off.returncode == 0, off.stderr
    assert off.stdout.splitlines() == expected
    env = {**os.environ, "HF_PAGED_CXX": "/nonexistent/c++", "HF_PAGED_KERNEL_CACHE": "/nonexistent/cache"}
    unbuilt = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert unbuilt.returncode == 0, unbuilt.stderr
    assert unbuilt.stdout.splitlines() == expected
    warned = [line for line in unbuilt.stderr.splitlines() if "through Python" in line]
    assert len(warned) == 1 and "/nonexistent/c++" in warned[0]  # said once, with the reason


def test_the_ops_pass_torchs_custom_op_checks_with_the_cpp_implementation():
    query, key_cache, value_cache, tables, seq_lens, starts = random_call(5, [30, 17], [2, 1], head_dim=32)
    torch.library.opcheck(
        ops.paged_attention, (query, key_cache, value_cache, tables, seq_lens, starts, 0.3, 20, 5.0, None, "auto")
    )
    slots = torch.tensor([1, 2, 40])
    keys, values = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    torch.library.opcheck(ops.write_kv, (key_cache.clone(), value_cache.clone(), slots, keys, values))


def _quantized_pages(generator: torch.Generator, kv_dtype: str, num_blocks: int, block_size: int, heads: int, dim: int):
    """Random codes and bfloat16 scales of one cache in `kv_dtype` (`kv_format`'s layout)."""
    fmt = kv_format(kv_dtype)
    shape = (num_blocks, block_size, heads, fmt.code_dim(dim))
    if fmt.bits == 8:
        codes = torch.randint(-127, 128, shape, generator=generator, dtype=torch.int8)
    else:
        codes = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
    scales = (torch.rand(num_blocks, block_size, heads, generator=generator) / 50).to(torch.bfloat16)
    return codes, scales


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    kv_dtype=st.sampled_from(["int8", "int4"]),
    dtype=st.sampled_from(DTYPES),
    backend=st.sampled_from(["auto", "cpu", "gather"]),
    window=st.sampled_from([None, 9]),
    sinks=st.booleans(),
    long_row=st.booleans(),
)
def test_quantized_results_are_bit_equal_to_the_python_implementation(
    seed, kv_dtype, dtype, backend, window, sinks, long_row
):
    lengths = [(seed * (row + 3)) % 70 + 1 for row in range(3)]
    counts = [1 + (seed + row) % min(length, 4) for row, length in enumerate(lengths)]
    if long_row:
        lengths[0], counts[0] = AUTO_CPU_MAX_QUERIES + 20, AUTO_CPU_MAX_QUERIES + 1
    query, key_cache, _, tables, seq_lens, starts = random_call(seed, lengths, counts, head_dim=32, dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    pages = [*_quantized_pages(generator, kv_dtype, *key_cache.shape)]
    pages += _quantized_pages(generator, kv_dtype, *key_cache.shape)
    sink_logits = torch.randn(query.shape[1]).to(dtype) if sinks else None
    args = (query, *pages, tables, seq_lens, starts, 0.2, kv_dtype, window, 4.0, sink_logits, backend)
    with torch.inference_mode():
        native, python = ops.paged_attention_quantized(*args), ops.paged_attention_quantized_any(*args)
    assert native.dtype == dtype and native.is_contiguous()
    assert torch.equal(native, python)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_writes_store_the_python_implementations_codes_and_scales(kv_dtype, dtype):
    generator = torch.Generator().manual_seed(3)
    pages = [*_quantized_pages(generator, kv_dtype, 5, 4, 2, 16), *_quantized_pages(generator, kv_dtype, 5, 4, 2, 16)]
    keys, values = torch.randn(4, 2, 16, generator=generator) * 3, torch.randn(4, 2, 16, generator=generator)
    keys[1, 0] = 0  # a zero vector: scale 0, codes 0
    values[2, 1] = 3e38  # beyond what a bfloat16 scale holds: clamped
    keys, values = keys.to(dtype), values.to(dtype)
    slots = torch.tensor([19, 0, 7, 8])
    expected = [page.clone() for page in pages]
    ops.write_kv_quantized_any(*expected, slots, keys, values, kv_dtype)
    ops.write_kv_quantized(*pages, slots, keys, values, kv_dtype)
    for page, reference in zip(pages, expected):
        assert torch.equal(page, reference)
    assert not torch.equal(pages[0], _quantized_pages(torch.Generator().manual_seed(3), kv_dtype, 5, 4, 2, 16)[0])
