"""Paged-attention kernels against the gather reference on random block tables, the backend choice, and the
fallback where the CPU kernel cannot be built."""

from __future__ import annotations

import ctypes
import math
import platform
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hf_paged
from hf_paged import kernels
from hf_paged.kernels import build, cpu
from hf_paged.kernels.reference import eager_paged_attention, gather_paged_attention
from hf_paged.reference_models import tiny_model

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def random_call(
    seed: int,
    lengths: list[int],
    counts: list[int],
    kv_heads: int = 2,
    group: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    shared_prefix: int = 0,
    spare_blocks: int = 3,
):
    """A kernel call over a pool whose blocks are handed out in random order. Every row's first `shared_prefix`
    tokens' full blocks are shared by all rows (prefix sharing / copy-on-write sources); entries past a row's blocks
    name block 0."""
    generator = torch.Generator().manual_seed(seed)
    shared_blocks = min(shared_prefix, min(lengths)) // block_size
    row_blocks = [math.ceil(length / block_size) for length in lengths]
    num_blocks = shared_blocks + sum(b - shared_blocks for b in row_blocks) + spare_blocks
    order = torch.randperm(num_blocks, generator=generator).tolist()
    shared, rest = order[:shared_blocks], order[shared_blocks:]
    tables = torch.zeros(len(lengths), max(row_blocks), dtype=torch.int32)
    for row, blocks in enumerate(row_blocks):
        own = [rest.pop() for _ in range(blocks - shared_blocks)]
        tables[row, :blocks] = torch.tensor(shared + own, dtype=torch.int32)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    query = torch.randn(sum(counts), kv_heads * group, head_dim, generator=generator).to(dtype)
    starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    return query, key_cache, value_cache, tables, torch.tensor(lengths, dtype=torch.int32), starts


def max_error(call, dtype=torch.float32, **options) -> float:
    query, key_cache, value_cache, tables, lengths, starts = call
    scale = query.shape[-1] ** -0.5
    got = kernels.paged_attention(
        query, key_cache, value_cache, tables, lengths, starts, scale=scale, kernel="cpu", **options
    )
    # the reference in fp32, from the same (rounded) inputs
    want = gather_paged_attention(
        query.float(),
        key_cache.float(),
        value_cache.float(),
        tables,
        lengths,
        starts,
        scale,
        options.get("window"),
        options.get("softcap"),
        options.get("sinks"),
    )
    assert got.shape == query.shape and got.dtype == query.dtype
    return (got.float() - want).abs().max().item()


@st.composite
def rows(draw, max_rows=5, max_length=300):
    num_rows = draw(st.integers(1, max_rows))
    lengths, counts = [], []
    for _ in range(num_rows):
        length = draw(st.integers(1, max_length))
        # decode (1), short chunks, whole prompts (count == length: an empty context before the chunk)
        count = draw(st.sampled_from([1, 1, 2, 5, 17, length]))
        lengths.append(length)
        counts.append(min(count, length))
    return lengths, counts


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=rows(),
    group=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([64, 128, 40]),
    block_size=st.sampled_from([16, 32, 8, 5]),
    window=st.sampled_from([None, None, 1, 7, 16, 33, 100]),
    softcap=st.sampled_from([None, None, 5.0]),
    sinks=st.booleans(),
    shared_prefix=st.sampled_from([0, 40, 200]),
    split_keys=st.sampled_from([None, 8, 50]),
    min_work=st.sampled_from([None, 1]),
    seed=st.integers(0, 2**16),
)
def test_cpu_kernel_matches_the_reference(
    shape, group, head_dim, block_size, window, softcap, sinks, shared_prefix, split_keys, min_work, seed
):
    lengths, counts = shape
    call = random_call(
        seed,
        lengths,
        counts,
        kv_heads=2,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        shared_prefix=shared_prefix,
    )
    sink_logits = torch.randn(2 * group, generator=torch.Generator().manual_seed(seed)) if sinks else None
    defaults = cpu.MIN_SPLIT_KEYS, cpu.MIN_WORK_PER_THREAD
    cpu.MIN_SPLIT_KEYS = split_keys or defaults[0]  # small: rows split their keys over the threads much more often
    cpu.MIN_WORK_PER_THREAD = min_work or defaults[1]  # 1: every call runs on all of torch's threads
    try:
        assert max_error(call, window=window, softcap=softcap, sinks=sink_logits) <= TOLERANCE[torch.float32]
    finally:
        cpu.MIN_SPLIT_KEYS, cpu.MIN_WORK_PER_THREAD = defaults


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="AVX-512 is an x86 instruction set")
def test_the_kernel_built_without_avx512_matches_the_reference(tmp_path, monkeypatch):
    # where the CPU has AVX-512 the kernel adds its dot products' lanes with AVX-512 instructions; other CPUs run the
    # portable loops, built here by turning AVX-512 off
    target = tmp_path / "paged_attention_portable.so"
    command = [build.compiler(), *build.CXX_FLAGS, "-mno-avx512f", str(cpu.SOURCE), "-o", str(target)]
    subprocess.run(command, check=True, capture_output=True, timeout=build.BUILD_TIMEOUT_S)
    monkeypatch.setattr(cpu, "_library", cpu.bind(ctypes.CDLL(str(target))))
    for seed, head_dim, group in [(0, 64, 3), (1, 128, 1), (2, 40, 2)]:
        call = random_call(seed, [300, 17, 1, 64], [1, 5, 1, 64], group=group, head_dim=head_dim, shared_prefix=16)
        assert max_error(call, window=100 if seed == 1 else None) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 24])
def test_cpu_kernel_half_precision_storage(dtype, window):
    call = random_call(3, [70, 5, 130], [1, 5, 9], dtype=dtype, shared_prefix=32)
    assert max_error(call, window=window) <= TOLERANCE[dtype]


def test_small_decode_batch_splits_keys_and_merges_them_exactly():
    # one row, one KV head: the kernel splits the 4,000 keys over the threads and merges the partial softmaxes
    call = random_call(11, [4000], [1], kv_heads=1, group=4, block_size=16)
    sinks = torch.tensor([0.5, -1.0, 3.0, 0.0])
    assert max_error(call) <= TOLERANCE[torch.float32]
    assert max_error(call, sinks=sinks, window=1500) <= TOLERANCE[torch.float32]


def test_rows_of_very_different_lengths_in_one_call():
    call = random_call(5, [1, 2048, 3, 700, 16], [1, 1, 3, 12, 16], kv_heads=2, group=3)
    assert max_error(call) <= TOLERANCE[torch.float32]


def test_auto_on_the_cpu_gathers_only_the_rows_of_more_queries_than_the_kernel_takes(monkeypatch):
    # a decode row, a short chunk and a long prompt chunk in one call (a compiled Engine step): the kernel reads the
    # first two in place, the long one gathers, as the "hf_paged" attention splits them; outputs in packed order
    counts = [1, 40, kernels.AUTO_CPU_MAX_QUERIES + 30, 1]
    query, key_cache, value_cache, tables, lengths, starts = random_call(3, [90, 60, 400, 33], counts)
    seen = []
    kernel = cpu.attention
    monkeypatch.setattr(cpu, "attention", lambda q, *args: seen.append(args[3].tolist()) or kernel(q, *args))
    scale = query.shape[-1] ** -0.5
    got = kernels.paged_attention(query, key_cache, value_cache, tables, lengths, starts, scale=scale, window=300)
    want = gather_paged_attention(query, key_cache, value_cache, tables, lengths, starts, scale, 300)
    assert seen == [[90, 60, 33]]  # the in-place call's seq_lens: rows 0, 1 and 3 only
    assert (got - want).abs().max().item() <= TOLERANCE[torch.float32]
    seen.clear()
    short = [1, 40, 7, 1]
    query, key_cache, value_cache, tables, lengths, starts = random_call(3, [90, 60, 400, 33], short)
    kernels.paged_attention(query, key_cache, value_cache, tables, lengths, starts, scale=scale)
    assert seen == [[90, 60, 400, 33]]  # nothing too long: one in-place call


def test_window_starting_mid_block_reads_only_the_window():
    # poison every key outside the window: a kernel that read them would change the output
    query, key_cache, value_cache, tables, lengths, starts = random_call(7, [100], [1], block_size=16)
    window = 21  # the query at 99 sees keys 79 .. 99: block 4 from its 15th slot on
    poisoned_keys, poisoned_values = key_cache.clone(), value_cache.clone()
    for position in range(0, 79):
        block, offset = tables[0, position // 16], position % 16
        poisoned_keys[block, offset] = 1e4
        poisoned_values[block, offset] = float("nan")
    args = (tables, lengths, starts)
    clean = kernels.paged_attention(query, key_cache, value_cache, *args, scale=0.125, window=window, kernel="cpu")
    poisoned = kernels.paged_attention(
        query, poisoned_keys, poisoned_values, *args, scale=0.125, window=window, kernel="cpu"
    )
    assert torch.equal(clean, poisoned)
    # negative control: without the window the poisoned keys are read
    assert torch.isnan(
        kernels.paged_attention(query, poisoned_keys, poisoned_values, *args, scale=0.125, kernel="cpu")
    ).any()


def test_copy_on_write_blocks_are_read_from_each_rows_own_copy():
    # rows 0 and 1 share their first block; row 1's last block is its own copy with different contents
    query, key_cache, value_cache, tables, lengths, starts = random_call(9, [20, 20], [1, 1], block_size=16)
    tables[1, 0] = tables[0, 0]
    key_cache[tables[1, 1]] = key_cache[tables[0, 1]] + 1.0
    out = kernels.paged_attention(query, key_cache, value_cache, tables, lengths, starts, scale=0.1, kernel="cpu")
    ref = gather_paged_attention(query, key_cache, value_cache, tables, lengths, starts, 0.1)
    assert (out - ref).abs().max() <= TOLERANCE[torch.float32]


def test_gather_reference_matches_eager_attention_on_a_dense_batch():
    # the reference itself, against eager attention on the dense K/V of one row
    query, key_cache, value_cache, tables, lengths, starts = random_call(2, [37], [5], block_size=8)
    ref = gather_paged_attention(query, key_cache, value_cache, tables, lengths, starts, 0.2, softcap=3.0)
    slots = torch.cat([torch.arange(b * 8, b * 8 + 8) for b in tables[0].tolist()])[:37]
    keys = key_cache.flatten(0, 1)[slots].transpose(0, 1)[None]
    values = value_cache.flatten(0, 1)[slots].transpose(0, 1)[None]
    dense, _ = eager_paged_attention(query.transpose(0, 1)[None], keys, values, None, 0.2, softcap=3.0)
    assert torch.allclose(ref, dense[0], atol=1e-6)


def test_resolve_kernel():
    assert kernels.resolve_kernel("gather", "cpu") == kernels.KernelChoice("gather", "gather")
    auto = kernels.resolve_kernel("auto", "cpu")
    assert auto.backend == "cpu" and auto.takes(1) and auto.takes(kernels.AUTO_CPU_MAX_QUERIES)
    assert not auto.takes(kernels.AUTO_CPU_MAX_QUERIES + 1)
    assert kernels.resolve_kernel("cpu", "cpu").takes(10_000)
    assert kernels.resolve_kernel("auto", "meta").backend == "gather"
    with pytest.raises(
        ValueError, match=r"kernel must be one of \['auto', 'gather', 'cpu', 'triton', 'flash'\], got 'fast'"
    ):
        kernels.resolve_kernel("fast", "cpu")


def test_unsupported_inputs_use_the_reference():
    query, key_cache, value_cache, tables, lengths, starts = random_call(1, [9], [2])
    assert not cpu.supports(query.double(), key_cache.double())
    out = kernels.paged_attention(
        query.double(), key_cache.double(), value_cache.double(), tables, lengths, starts, scale=0.3, kernel="cpu"
    )
    assert out.dtype == torch.float64


def test_build_is_cached_and_reused(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HF_PAGED_KERNEL_CACHE", str(tmp_path))
    with caplog.at_level("INFO", logger="hf_paged.kernels.build"):
        first = build.build(cpu.SOURCE)
        second = build.build(cpu.SOURCE)
    assert first == second and first.parent == tmp_path and first.exists()
    assert len([r for r in caplog.records if "built paged_attention_cpu.cpp" in r.getMessage()]) == 1


def test_no_compiler_falls_back_to_gather_with_one_warning(tmp_path):
    # a fresh process with no compiler and an empty kernel cache: generate still works (gather), warned once
    script = textwrap.dedent(
        """
        import warnings, torch, hf_paged
        from hf_paged.reference_models import tiny_model
        model = tiny_model("llama")
        ids = torch.tensor([[5, 6, 7, 8]])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0,
                                     cache_implementation="paged", return_dict_in_generate=True)
                calls = out.past_key_values.attention_calls
                out.past_key_values.release()
        stock = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        messages = [str(w.message) for w in caught if "kernel" in str(w.message)]
        print(len(messages), calls, torch.equal(out.sequences, stock))
        print(messages[0])
        try:  # asked for by name, it is refused rather than replaced
            model.generate(ids, max_new_tokens=2, cache_implementation="paged", cache_config={"kernel": "cpu"})
        except hf_paged.kernels.KernelUnavailableError as error:
            print(error)
        print(hf_paged.get_pool(model).stats().num_used)
        """
    )
    env = {"HF_PAGED_CXX": "/nonexistent/c++", "HF_PAGED_KERNEL_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    summary, message, refusal, used = result.stdout.strip().splitlines()[-4:]
    assert summary == "1 {'gather': 8} True"
    assert "CPU paged-attention kernel is not available" in message and "/nonexistent/c++" in message
    assert refusal.startswith("cache_config kernel='cpu' cannot run here: it could not be built here")
    assert refusal.endswith("Kernels available on cpu with blocks of 16 tokens: ['auto', 'gather']") and used == "0"


def test_a_failing_build_is_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_PAGED_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_PAGED_CXX", sys.executable)  # "compiles" by running python on the source: fails
    build.forget_loaded()
    try:
        with pytest.raises(build.KernelBuildError, match="failed"):
            build.load_library(cpu.SOURCE)
    finally:
        build.forget_loaded()


@pytest.mark.parametrize("name", ["triton", "flash"])
def test_a_kernel_asked_for_by_name_that_cannot_run_here_is_refused_with_the_kernels_that_can(name, monkeypatch):
    """`kernel="triton"` on the CPU used to warn and gather while `kernel="flash"` raised: both are refused now,
    before any forward, naming why and what runs here; `"auto"` chooses without a word."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as on a user's CPU: no Triton interpreter
    model = tiny_model("llama", num_hidden_layers=1)
    ids = torch.tensor([[5, 6, 7, 8]])
    options = {"max_new_tokens": 2, "do_sample": False, "pad_token_id": 0, "cache_implementation": "paged"}
    with pytest.raises(kernels.KernelUnavailableError) as refused:
        model.generate(ids, **options, cache_config={"kernel": name})
    assert isinstance(refused.value, ValueError) and f"kernel={name!r} cannot run here" in str(refused.value)
    assert str(refused.value).endswith("Kernels available on cpu with blocks of 16 tokens: ['auto', 'gather', 'cpu']")
    assert hf_paged.get_pool(model).stats().num_used == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model.generate(ids, **options, cache_config={"kernel": "auto"}, return_dict_in_generate=True)
    assert out.past_key_values.stats().attention_kernel == "cpu"
    out.past_key_values.release()
