"""The Triton paged-attention kernel, run on the CPU under Triton's interpreter: against the gather reference on
random block tables, and end to end (generate, beam search, the Engine's packed steps) token-identical to
`DynamicCache`. Shapes stay small: the interpreter runs every program in numpy. `TRITON_INTERPRET=1` is set by
tests/conftest.py before anything imports triton (where there is no CUDA device)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hf_paged
from hf_paged import kernels
from hf_paged.kernels import triton as triton_backend
from hf_paged.kernels.reference import gather_paged_attention
from hf_paged.kv_format import QuantizedPages, kv_format
from hf_paged.reference_models import tiny_model

from .conftest import left_padded_batch
from .quant_helpers import generate_round_trip
from .test_kernels import random_call

pytest.importorskip("triton")
if not triton_backend.interpreted():
    pytest.skip(
        "these tests run the kernel on CPU tensors under Triton's interpreter: TRITON_INTERPRET=1 before triton is "
        "imported (tests/conftest.py sets it where there is no CUDA device)",
        allow_module_level=True,
    )
TOLERANCE = 1e-5  # fp32, max abs error


def triton_error(call, window=None, softcap=None, sinks=None) -> float:
    query, key_cache, value_cache, tables, lengths, starts = call
    scale = query.shape[-1] ** -0.5
    got = kernels.paged_attention(
        query, key_cache, value_cache, tables, lengths, starts, scale=scale, window=window, softcap=softcap,
        sinks=sinks, kernel="triton",
    )  # fmt: skip
    want = gather_paged_attention(query, key_cache, value_cache, tables, lengths, starts, scale, window, softcap, sinks)
    assert got.shape == query.shape and got.dtype == query.dtype
    return (got - want).abs().max().item()


@st.composite
def calls(draw):
    """Rows of mixed query counts (decode, chunks, whole prompts) over blocks of 16, 32, 256 tokens (and a few
    smaller sizes); lengths stay short (one to a few blocks) so that each case runs in a fraction of a second."""
    block_size = draw(st.sampled_from([16, 16, 32, 32, 256, 8, 5]))
    max_length = 300 if block_size == 256 else 3 * block_size + 7
    num_rows = draw(st.integers(1, 4))
    lengths, counts = [], []
    for _ in range(num_rows):
        length = draw(st.integers(1, max_length))
        count = draw(st.sampled_from([1, 1, 2, 5, 17, length]))
        lengths.append(length)
        counts.append(min(count, length, 40))
    return block_size, lengths, counts


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(
    shape=calls(),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3, 4, 8]),
    head_dim=st.sampled_from([64, 128]),
    window=st.sampled_from([None, None, 1, 7, 15, 16, 17, 33, 100]),
    softcap=st.sampled_from([None, None, 5.0]),
    sinks=st.booleans(),
    shared_prefix=st.sampled_from([0, 0, 16, 40, 256]),
    seed=st.integers(0, 2**16),
)
def test_triton_kernel_matches_the_reference(
    shape, kv_heads, group, head_dim, window, softcap, sinks, shared_prefix, seed
):
    block_size, lengths, counts = shape
    call = random_call(
        seed, lengths, counts, kv_heads=kv_heads, group=group, head_dim=head_dim, block_size=block_size,
        shared_prefix=shared_prefix,
    )  # fmt: skip
    sink_logits = torch.randn(kv_heads * group, generator=torch.Generator().manual_seed(seed)) if sinks else None
    assert triton_error(call, window, softcap, sink_logits) <= TOLERANCE


@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_half_precision_storage(dtype, tolerance):
    query, key_cache, value_cache, tables, lengths, starts = random_call(3, [40, 5, 70], [1, 5, 9], dtype=dtype)
    got = kernels.paged_attention(
        query, key_cache, value_cache, tables, lengths, starts, scale=0.125, window=24, kernel="triton"
    )
    want = gather_paged_attention(
        query.float(), key_cache.float(), value_cache.float(), tables, lengths, starts, 0.125, 24
    )
    assert got.dtype == dtype and (got.float() - want).abs().max() <= tolerance


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(
    shape=calls(),
    kv_dtype=st.sampled_from(["int8", "int4"]),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([64, 24]),  # 24: padded to 32 lanes, the rotation block-diagonal
    window=st.sampled_from([None, 7, 33]),
    softcap=st.sampled_from([None, 5.0]),
    seed=st.integers(0, 2**16),
)
def test_quantized_pages_match_dequantize_then_reference(shape, kv_dtype, group, head_dim, window, softcap, seed):
    block_size, lengths, counts = shape
    query, key_cache, value_cache, tables, lengths, starts = random_call(
        seed, lengths, counts, kv_heads=2, group=group, head_dim=head_dim, block_size=block_size
    )
    fmt = kv_format(kv_dtype)
    key_pages = QuantizedPages(fmt, *fmt.quantize(key_cache), query.dtype)
    value_pages = QuantizedPages(fmt, *fmt.quantize(value_cache), query.dtype)
    options = {"scale": head_dim**-0.5, "window": window, "softcap": softcap}
    got = kernels.paged_attention(query, key_pages, value_pages, tables, lengths, starts, kernel="triton", **options)
    dense = (key_pages.dequantize(), value_pages.dequantize())
    want = kernels.paged_attention(query, *dense, tables, lengths, starts, kernel="gather", **options)
    assert (got - want).abs().max().item() <= TOLERANCE


def test_generate_on_quantized_pages_through_the_triton_kernel_matches_stock_over_the_same_values():
    model = tiny_model("llama")
    input_ids = torch.randint(3, 128, (2, 13), generator=torch.Generator().manual_seed(1))
    for kv_dtype in ("int8", "int4"):
        expected = generate_round_trip(model, kv_dtype, input_ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        out = model.generate(
            input_ids,
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
            cache_implementation="paged",
            cache_config={"kernel": "triton", "block_size": 16, "kv_dtype": kv_dtype},
        )
        assert torch.equal(out.sequences, expected)
        assert set(out.past_key_values.attention_calls) == {"triton"}
        out.past_key_values.release()


def test_tiles_outside_the_window_are_not_read():
    # poison every key before the window's first tile: a kernel that read them would return NaN
    query, key_cache, value_cache, tables, lengths, starts = random_call(7, [100], [1], block_size=16)
    window = 21  # the query at 99 sees keys 79 .. 99; its first tile of 16 keys starts at 64
    poisoned_keys, poisoned_values = key_cache.clone(), value_cache.clone()
    for position in range(64):
        block, offset = tables[0, position // 16], position % 16
        poisoned_keys[block, offset] = float("nan")
        poisoned_values[block, offset] = float("nan")
    args = (tables, lengths, starts)
    clean = kernels.paged_attention(query, key_cache, value_cache, *args, scale=0.125, window=window, kernel="triton")
    poisoned = kernels.paged_attention(
        query, poisoned_keys, poisoned_values, *args, scale=0.125, window=window, kernel="triton"
    )
    assert torch.equal(clean, poisoned)
    # negative control: without the window the poisoned keys are read
    unwindowed = kernels.paged_attention(query, poisoned_keys, poisoned_values, *args, scale=0.125, kernel="triton")
    assert torch.isnan(unwindowed).any()


def test_resolve_kernel_on_the_cpu_under_the_interpreter():
    assert kernels.resolve_kernel("triton", "cpu") == kernels.KernelChoice("triton", "triton")
    assert kernels.resolve_kernel("auto", "cpu").backend == "cpu"  # auto never picks the interpreter


# ---------------------------------------------------------------------- end to end, in the interpreter
def generate_both(model, input_ids, attention_mask=None, **options):
    """Stock `generate` (`DynamicCache`) and paged `generate` through the Triton kernel, with the same options."""
    options = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0, **options}
    stock = model.generate(input_ids=input_ids, attention_mask=attention_mask, **options)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        return_dict_in_generate=True,
        cache_implementation="paged",
        cache_config={"kernel": "triton", "block_size": 16, "attn_implementation": "hf_paged"},
        **options,
    )
    cache = out.past_key_values
    calls = dict(cache.attention_calls)
    cache.release()
    return stock, out.sequences, calls


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_greedy_generate_through_the_triton_kernel_matches_dynamic_cache(family):
    model = tiny_model(family)  # gemma2: sliding window 6 on every other layer, logit soft-capping
    input_ids = torch.randint(3, 128, (2, 13), generator=torch.Generator().manual_seed(1))
    stock, paged, calls = generate_both(model, input_ids, torch.ones_like(input_ids))
    assert torch.equal(paged, stock)
    layers = model.config.num_hidden_layers
    assert calls == {"triton": 8 * layers}  # the prefill and 7 decode steps, every layer in place


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_left_padded_beam_search_through_the_triton_kernel_matches_dynamic_cache(family):
    model = tiny_model(family)
    input_ids, attention_mask = left_padded_batch([5, 11], seed=4)
    stock, paged, calls = generate_both(
        model, input_ids, attention_mask, num_beams=3, num_return_sequences=2, max_new_tokens=6
    )
    assert torch.equal(paged, stock)
    assert calls.get("triton", 0) >= 5 * model.config.num_hidden_layers  # the decode steps in place


def test_engine_packed_steps_run_through_the_triton_kernel():
    model = tiny_model("llama")  # an SDPA model: the Engine of an eager one computes in eager math (gathers)
    engine = hf_paged.Engine(
        model, block_size=16, num_blocks=64, progress=False, max_prefill_tokens=24, kernel="triton", exact=True
    )
    prompts = [[5 + i] * length for i, length in enumerate([3, 30, 7, 2, 19])]
    outputs = engine.generate(prompts, [hf_paged.SamplingParams(max_new_tokens=5, eos_token_id=())] * 5)
    calls = engine.cache.attention_calls
    assert engine.cache.kernel.backend == "triton" and set(calls) == {"triton"}  # chunks and decodes, packed
    for prompt, output in zip(prompts, outputs):
        stock = model.generate(
            torch.tensor([prompt]), max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None
        )
        assert output.token_ids == stock[0, len(prompt) :].tolist()
    engine.close()


# ---------------------------------------------------------------------- without triton
def test_without_triton_the_package_works_and_asking_for_triton_names_the_extra():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # import triton raises ImportError
        import torch, hf_paged
        from hf_paged import kernels
        from hf_paged.reference_models import tiny_model
        try:
            kernels.resolve_kernel("triton", "cpu")
        except kernels.KernelUnavailableError as error:
            print(error)
        model = tiny_model("llama", num_hidden_layers=1)
        ids = torch.tensor([[5, 6, 7, 8]])
        out = model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="paged")
        print(torch.equal(out, model.generate(ids, max_new_tokens=3, do_sample=False)))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    message, same = result.stdout.strip().splitlines()[-2:]
    assert message == (
        "cache_config kernel='triton' cannot run here: it needs the triton package, which is not installed: "
        "pip install 'hf_paged[triton]'. Kernels available on cpu: ['auto', 'gather', 'cpu']"
    )
    assert same == "True"


def test_triton_backend_refuses_the_cpu_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")  # as if it were: the backend checks it at every call
    query, key_cache, *_ = random_call(0, [9], [1])
    assert not triton_backend.supports(query, key_cache)
    with pytest.raises(kernels.KernelUnavailableError, match="TRITON_INTERPRET=1") as refused:
        kernels.resolve_kernel("triton", "cpu")
    assert "Kernels available on cpu: ['auto', 'gather', 'cpu']" in str(refused.value)
    assert kernels.resolve_kernel("auto", "cpu").backend == "cpu"  # auto chooses without a word
