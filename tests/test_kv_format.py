"""Quantized pages (`cache_config={"kv_dtype": "int8" | "int4"}`): the format's round trip, the CPU kernel against
dequantize-then-reference, byte accounting, and generation (on both kernels: in place and gather) held
token-identical to stock `generate` over a `DynamicCache` that stores the same quantized values
(tests/quant_helpers.py): greedy, sampling with n > 1, beams, prefix sharing, copy-on-write, sliding and hybrid layer
groups, the Engine's packed steps, and SmolLM2."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import hf_paged
from hf_paged.engine import Engine
from hf_paged.kernels import paged_attention, resolve_kernel
from hf_paged.kv_format import FORMATS, KV_DTYPES, KVFormat, QuantizedPages, hadamard, kv_format
from hf_paged.pool import BlockPool, KVShape
from hf_paged.reference_models import tiny_model
from tests.exactness import SCORE_TOLERANCE, reads_in_place
from tests.quant_helpers import generate_round_trip, round_trip_cache

QUANTIZED = ("int8", "int4")
GREEDY = {"do_sample": False, "max_new_tokens": 12, "pad_token_id": 0}
CPU_KERNEL = resolve_kernel("cpu", "cpu").in_place


def _paged(model, kv_dtype, input_ids, **kwargs):
    config = {"kv_dtype": kv_dtype, "block_size": 4, "num_blocks": 256, **kwargs.pop("cache_config", {})}
    out = model.generate(
        input_ids, cache_implementation="paged", cache_config=config, return_dict_in_generate=True, **kwargs
    )
    out.past_key_values.release()
    return out


def _assert_same_generation(reference, paged):
    assert torch.equal(reference.sequences, paged.sequences)
    if getattr(reference, "logits", None) is not None:
        for ref, got in zip(reference.logits, paged.logits):
            if reads_in_place():
                torch.testing.assert_close(got, ref, rtol=0, atol=SCORE_TOLERANCE)
            else:
                assert torch.equal(ref, got)


# ---------------------------------------------------------------------------------------------- the format itself
@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(QUANTIZED),
    tokens=st.integers(1, 5),
    half_dim=st.integers(1, 40),
    magnitude=st.sampled_from([1e-6, 1e-2, 1.0, 30.0, 1e4]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_error_is_within_half_a_step(name, tokens, half_dim, magnitude, seed):
    fmt = kv_format(name)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 3, 2 * half_dim, generator=generator) * magnitude
    x[0, 0] = 0.0  # an all-zero vector has scale 0 and comes back exactly
    codes, scales = fmt.quantize(x)
    assert codes.shape == (tokens, 3, fmt.code_dim(2 * half_dim)) and scales.shape == (tokens, 3)
    back = fmt.dequantize(codes, scales, torch.float32)
    error = (back - x).abs().amax(dim=-1)
    assert torch.all(error <= fmt.round_trip_bound(x)), (error / fmt.round_trip_bound(x)).max()
    assert torch.equal(back[0, 0], torch.zeros(2 * half_dim))
    if not fmt.rotated:  # the largest value of every vector is exact up to the scale's bfloat16 rounding
        assert torch.allclose(back.abs().amax(-1), x.abs().amax(-1), rtol=4e-3, atol=0)


def test_int4_packs_two_codes_a_byte_low_nibble_first():
    fmt = KVFormat("int4", 4)  # the layout the kernel reads (the "int4" format also rotates before packing)
    codes, scales = fmt.quantize(torch.tensor([[1.0, -7.0, 7.0, 0.0]]))
    assert scales.item() == 1.0
    assert codes.tolist() == [[(1 + 8) | ((-7 + 8) << 4), (7 + 8) | (0 + 8) << 4]]


def test_int4_pages_hold_rotated_vectors_and_attention_is_unchanged_by_the_rotation():
    fmt = kv_format("int4")
    x = torch.zeros(1, 1, 8)
    x[0, 0, 3] = 5.0  # one outlier channel: spread evenly over all eight by the rotation
    codes, scales = fmt.quantize(x)
    stored = fmt.dequantize(codes, scales, torch.float32, rotate_back=False)
    assert torch.allclose(stored.abs(), torch.full_like(stored, 5.0 / 8**0.5), rtol=1e-2)
    assert torch.allclose(fmt.dequantize(codes, scales, torch.float32), x, atol=2e-2)  # the scale in bfloat16
    h = hadamard(48)  # block-diagonal where the head dim is not a power of two
    assert torch.allclose(h @ h, torch.eye(48), atol=1e-6) and torch.equal(h, h.T)
    q, k = torch.randn(48), torch.randn(48)
    assert torch.allclose((q @ h) @ (k @ h), q @ k, atol=1e-5)


def test_int8_codes_are_symmetric():
    codes, _ = KVFormat("int8", 8).quantize(torch.tensor([[-2.0, 2.0, 1.0]]))
    assert codes.tolist() == [[-127, 127, 64]]


def test_a_negative_control_the_bound_can_fail():
    """The bound is tight enough to catch a wrong scale: quantizing with twice the step breaks it."""
    fmt = kv_format("int8")
    x = torch.linspace(-1, 1, 64)[None]
    codes = torch.round(x / (2 / 127)).to(torch.int8)
    back = fmt.dequantize(codes, torch.tensor([2 / 127], dtype=torch.bfloat16), torch.float32)
    assert (back - x).abs().max() > fmt.round_trip_bound(x).max()


def test_bytes_per_token_against_bfloat16_and_float32_pages():
    def shape(kv_dtype, dtype):  # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64
        return KVShape(30, 3, 64, dtype, kv_dtype=kv_dtype).bytes_per_token

    bf16, fp32 = shape("auto", torch.bfloat16), shape("auto", torch.float32)
    assert bf16 == 2 * 30 * 3 * 64 * 2
    assert shape("int8", torch.float32) == shape("int8", torch.bfloat16) == 2 * 30 * 3 * (64 + 2)
    assert shape("int8", torch.float32) / bf16 <= 0.53 and shape("int4", torch.float32) / bf16 <= 0.28
    assert fp32 / shape("int8", torch.float32) >= 3.8 and fp32 / shape("int4", torch.float32) >= 7


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_the_pool_counts_the_bytes_it_holds(kv_dtype):
    model = tiny_model("llama")
    hf_paged.release_pool(model)
    out = _paged(model, kv_dtype, torch.tensor([[5, 6, 7, 8, 9]]), **GREEDY)
    pool = hf_paged.get_pool(model)
    stats = pool.stats()
    assert pool.kv_dtype == stats.kv_dtype == kv_dtype and out.sequences.shape[1] == 17
    assert pool.storage.nbytes == stats.kv_bytes_total == stats.num_blocks * stats.block_bytes
    codes = pool.storage.keys[0]
    assert codes.dtype == FORMATS[kv_dtype].code_dtype and pool.storage.key_scales[0].dtype == torch.bfloat16
    assert "kv_dtype='" + kv_dtype in repr(pool)
    from hf_paged.visual import render_pool_text

    summary = render_pool_text(pool).splitlines()[0]  # the pictures count the same bytes
    assert summary.endswith(f"0 B of {stats.kv_bytes_total / 2**10:.1f} KiB of {kv_dtype} K/V; blocks 0-63 shown")


# ---------------------------------------------------------------------------------------------- kernels
@pytest.mark.skipif(not CPU_KERNEL, reason="the CPU kernel cannot be built here")
@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(QUANTIZED),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    gqa=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([8, 64]),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    new=st.integers(1, 3),
    window=st.sampled_from([None, 5]),
    softcap=st.sampled_from([None, 4.0]),
    seed=st.integers(0, 2**16),
)
@example(name="int4", dtype=torch.bfloat16, gqa=1, head_dim=8, lengths=[16, 17], new=1, window=5, softcap=4.0, seed=19)
def test_cpu_kernel_reads_quantized_pages_as_dequantize_then_reference(
    name, dtype, gqa, head_dim, lengths, new, window, softcap, seed
):
    fmt, block_size, kv_heads = kv_format(name), 4, 2
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lengths) + 2
    keys = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    values = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    key_pages = QuantizedPages(fmt, *fmt.quantize(keys), dtype)
    value_pages = QuantizedPages(fmt, *fmt.quantize(values), dtype)
    order = torch.randperm(num_blocks, generator=generator).to(torch.int32)  # blocks lie anywhere
    width = max(-(-n // block_size) for n in lengths)
    tables, start = torch.zeros(len(lengths), width, dtype=torch.int32), 0
    for row, n in enumerate(lengths):
        used = -(-n // block_size)
        tables[row, :used] = order[start : start + used]
        start += used
    counts = [min(new, n) for n in lengths]
    query_start = torch.tensor([0] + counts).cumsum(0).to(torch.int32)
    query = torch.randn(int(query_start[-1]), kv_heads * gqa, head_dim, generator=generator).to(dtype)
    args = (query, tables, torch.tensor(lengths, dtype=torch.int32), query_start)
    options = {"scale": head_dim**-0.5, "window": window, "softcap": softcap}
    got = paged_attention(args[0], key_pages, value_pages, *args[1:], kernel="cpu", **options)
    dense_keys, dense_values = key_pages.dequantize(), value_pages.dequantize()
    expected = paged_attention(args[0], dense_keys, dense_values, *args[1:], kernel="gather", **options)
    # half precision: the reference attends in the storage dtype, the kernel in fp32, so outputs of magnitude 2-4 can
    # differ by 2 of their ulps (found by hypothesis: 0.0234 at 1.72, bf16, with a soft cap)
    tolerance, relative = (2e-5, 0.0) if dtype == torch.float32 else (2e-2, 2.0**-6)
    torch.testing.assert_close(got.float(), expected.float(), rtol=relative, atol=tolerance)
    # the gather reference reads the pages themselves the same way
    gathered = paged_attention(args[0], key_pages, value_pages, *args[1:], kernel="gather", **options)
    assert torch.equal(gathered, expected)


@pytest.mark.kernel_matrix
# ---------------------------------------------------------------------------------------------- generation
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3"])  # full; sliding + softcap; hybrid layer groups
def test_greedy_generation_equals_stock_over_the_same_quantized_values(family, kv_dtype):
    model = tiny_model(family)
    input_ids = torch.randint(3, 100, (3, 11), generator=torch.Generator().manual_seed(1))
    options = {**GREEDY, "output_logits": True, "return_dict_in_generate": True}
    reference = generate_round_trip(model, kv_dtype, input_ids, **options)
    paged = _paged(model, kv_dtype, input_ids, **{k: v for k, v in options.items() if k != "return_dict_in_generate"})
    _assert_same_generation(reference, paged)


def test_a_negative_control_unquantized_pages_differ():
    """The comparison above can fail: pages of another format give other logits (int4 vs int8)."""
    model = tiny_model("llama")
    input_ids = torch.randint(3, 100, (2, 11), generator=torch.Generator().manual_seed(1))
    reference = generate_round_trip(
        model, "int4", input_ids, **GREEDY, output_logits=True, return_dict_in_generate=True
    )
    paged = _paged(model, "int8", input_ids, **GREEDY, output_logits=True)
    assert not torch.allclose(reference.logits[0], paged.logits[0], atol=1e-3)


@pytest.mark.kernel_matrix
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_beam_search_and_sampling_with_n_equal_stock(kv_dtype):
    model = tiny_model("llama")
    input_ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    beams = {"num_beams": 3, "num_return_sequences": 2, "do_sample": False, "max_new_tokens": 8, "pad_token_id": 0}
    reference = generate_round_trip(model, kv_dtype, input_ids, **beams, return_dict_in_generate=True)
    _assert_same_generation(reference, _paged(model, kv_dtype, input_ids, **beams))
    sampling = {"do_sample": True, "num_return_sequences": 3, "max_new_tokens": 8, "pad_token_id": 0, "top_k": 20}
    torch.manual_seed(7)
    reference = generate_round_trip(model, kv_dtype, input_ids, **sampling, return_dict_in_generate=True)
    torch.manual_seed(7)
    _assert_same_generation(reference, _paged(model, kv_dtype, input_ids, **sampling))


@pytest.mark.kernel_matrix
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_prefix_sharing_and_copy_on_write_keep_the_quantized_blocks(kv_dtype):
    """A cached prefix's quantized blocks (codes and scales) are reused, and n > 1 copies a shared partial block on
    write: outputs equal the same format without any sharing."""
    model = tiny_model("llama")
    hf_paged.release_pool(model)
    prefix = torch.randint(3, 100, (1, 14), generator=torch.Generator().manual_seed(3))
    input_ids = torch.cat([prefix, torch.tensor([[41, 42]])], dim=1)
    options = {**GREEDY, "num_beams": 2, "num_return_sequences": 2, "output_logits": True}
    unshared = _paged(model, kv_dtype, input_ids, cache_config={"prefix_caching": False}, **options)
    _paged(model, kv_dtype, prefix, max_new_tokens=1, do_sample=False, pad_token_id=0)  # caches the prefix blocks
    pool = hf_paged.get_pool(model)
    reused_before = pool.stats().prefix_tokens_reused
    shared = _paged(model, kv_dtype, input_ids, **options)
    assert pool.stats().prefix_tokens_reused - reused_before == 12  # three full blocks of 4
    assert shared.past_key_values.stats().cow_copies > 0
    _assert_same_generation(unshared, shared)


def test_different_formats_never_share_blocks():
    model = tiny_model("llama")
    hf_paged.release_pool(model)
    prompt = torch.randint(3, 100, (1, 16), generator=torch.Generator().manual_seed(4))
    _paged(model, "int8", prompt, **GREEDY)
    reference = model.generate(prompt, **GREEDY, output_logits=True, return_dict_in_generate=True)
    plain = _paged(model, "auto", prompt, **GREEDY, output_logits=True)
    pool = hf_paged.get_pool(model)
    assert pool.kv_dtype == "auto" and pool.stats().prefix_tokens_reused == 0
    _assert_same_generation(reference, plain)
    # and the prefix key itself differs by format
    from hf_paged.planner import pool_root

    shape = KVShape(2, 2, 16, torch.float32)
    int8_shape = KVShape(2, 2, 16, torch.float32, kv_dtype="int8")
    assert pool_root(BlockPool(8, 4, shape), model) != pool_root(BlockPool(8, 4, int8_shape), model)


def test_a_call_without_kv_dtype_gets_unquantized_pages():
    """The format is not inherited from an earlier call (unlike the pool's size): quantization changes outputs."""
    model = tiny_model("llama")
    prompt = torch.tensor([[5, 6, 7, 8]])
    _paged(model, "int4", prompt, **GREEDY)
    out = model.generate(prompt, cache_implementation="paged", **GREEDY)
    assert hf_paged.get_pool(model).kv_dtype == "auto"
    assert torch.equal(out, model.generate(prompt, **GREEDY))


def test_a_pool_in_use_refuses_another_format_and_stays_consistent():
    model = tiny_model("llama")
    hf_paged.release_pool(model)
    cache = hf_paged.PagedCache(model, kv_dtype="int8", block_size=4, num_blocks=64)
    model.generate(torch.tensor([[5, 6, 7]]), past_key_values=cache, **GREEDY)
    with pytest.raises(ValueError, match="kv_dtype='int8' and .* blocks in use.*kv_dtype='int4'"):
        _paged(model, "int4", torch.tensor([[5, 6, 7]]), **GREEDY)
    pool = hf_paged.get_pool(model)
    pool.check_invariants()
    cache.release()
    assert pool.stats().num_used == 0


def test_bad_kv_dtype_names_the_value_and_the_choices():
    model = tiny_model("llama")
    choices = r"\['auto', 'int8', 'int4', 'int4-channel'\]"
    with pytest.raises(ValueError, match=rf"kv_dtype must be one of {choices}, got 'fp4'"):
        model.generate(torch.tensor([[5, 6]]), cache_implementation="paged", cache_config={"kv_dtype": "fp4"})
    assert KV_DTYPES == ("auto", "int8", "int4", "int4-channel")


def test_an_odd_head_dim_cannot_take_int4():
    model = tiny_model("gpt2", n_embd=36, n_head=4)  # learned positions: an odd head dim (9) is possible
    with pytest.raises(ValueError, match="kv_dtype='int4' packs 2 values a byte and needs an even head_dim, but "
                                         "GPT2LMHeadModel has head_dim=9"):  # fmt: skip
        _paged(model, "int4", torch.tensor([[5, 6, 7]]), **GREEDY)
    assert _paged(model, "int8", torch.tensor([[5, 6, 7]]), **GREEDY).sequences.shape == (1, 15)


@pytest.mark.kernel_matrix
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_engine_packed_steps_equal_stock_per_prompt(kv_dtype):
    model = tiny_model("llama")
    hf_paged.release_pool(model)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 100, (n,), generator=generator).tolist() for n in (3, 17, 9, 30, 6)]
    engine = Engine(
        model,
        kv_dtype=kv_dtype,
        block_size=4,
        num_blocks=256,
        max_batch_size=4,
        max_prefill_tokens=8,
        max_num_batched_tokens=8,
        exact=True,
    )
    outputs = engine.generate(prompts, max_new_tokens=10)
    assert engine.pool.kv_dtype == kv_dtype and engine.step_counts["mixed"] > 0
    for prompt, output in zip(prompts, outputs):
        expected = generate_round_trip(model, kv_dtype, torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
        assert output.token_ids == expected[0, len(prompt) :].tolist()
    assert engine.pool.stats().num_used == 0
    from hf_paged.serve.metrics import MetricsSnapshot, render_metrics

    totals = {"requests": 5, "prompt_tokens": 65, "generation_tokens": 50}
    text = render_metrics(MetricsSnapshot.take(engine, totals, 0.0)).splitlines()
    assert f'hf_paged_kv_dtype_info{{kv_dtype="{kv_dtype}"}} 1' in text
    total = engine.pool.stats().kv_bytes_total  # codes and scales: the real bytes
    assert total == engine.pool.storage.nbytes
    reported = [line.split()[-1] for line in text if line.startswith('hf_paged_rank_kv_bytes_total{rank="0"}')]
    assert [float(value) for value in reported] == [total]


@pytest.mark.kernel_matrix
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_smollm2_greedy_equals_stock_over_the_same_quantized_values(smollm2, kv_dtype):
    model, tokenizer = smollm2
    prompts = ["The capital of France is", "def fibonacci(n):"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    options = {"max_new_tokens": 16, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    reference = model.generate(**batch, past_key_values=round_trip_cache(model, kv_dtype), **options)
    paged = model.generate(**batch, cache_implementation="paged", cache_config={"kv_dtype": kv_dtype}, **options)
    assert torch.equal(reference, paged)
    assert hf_paged.get_pool(model).kv_dtype == kv_dtype
