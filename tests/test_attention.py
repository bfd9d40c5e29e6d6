"""The hf_paged attention math: GQA from shapes, soft-capping, sinks and masks, against plain references."""

from __future__ import annotations

import pytest
import torch

from hf_paged.attention import eager_paged_attention, paged_attention_forward
from hf_paged.kernels.reference import causal_mask as _causal_mask


class BareModule(torch.nn.Module):
    """An attention module with no `num_key_value_groups` (like GPT-2 or OPT)."""

    is_causal = True


def reference_attention(query, key, value, mask, scaling, softcap=None, sinks=None):
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    logits = (query @ key.transpose(-1, -2)) * scaling
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.view(1, -1, 1, 1).expand(*logits.shape[:3], 1)
        probs = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(logits, -1)
    return (probs @ value).transpose(1, 2)


def inputs(q_len=3, kv_len=7, heads=6, kv_heads=2):
    torch.manual_seed(0)
    query = torch.randn(2, heads, q_len, 8)
    key, value = torch.randn(2, kv_heads, kv_len, 8), torch.randn(2, kv_heads, kv_len, 8)
    mask = _causal_mask(q_len, kv_len, "cpu").expand(2, 1, q_len, kv_len).clone()
    mask[1, :, :, :2] = False  # row 1 is left-padded by two positions
    return query, key, value, mask


def test_gqa_factor_comes_from_shapes_without_num_key_value_groups():
    query, key, value, mask = inputs()
    out, _ = paged_attention_forward(BareModule(), query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(out, reference_attention(query, key, value, mask, 0.3), rtol=1e-5, atol=1e-6)


def test_softcap_and_sinks_use_the_eager_path():
    query, key, value, mask = inputs()
    sinks = torch.randn(6)
    out, probs = paged_attention_forward(BareModule(), query, key, value, mask, scaling=0.5, softcap=2.0, s_aux=sinks)
    expected = reference_attention(query, key, value, mask, 0.5, softcap=2.0, sinks=sinks)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert probs.shape == (2, 6, 3, 7) and (probs.sum(-1) < 1).all()  # the sink takes some mass


def test_missing_mask_means_causal_in_the_eager_path():
    query, key, value, _ = inputs(q_len=4, kv_len=4)
    out, _ = eager_paged_attention(query, key, value, None, scaling=0.25, softcap=50.0)
    causal = _causal_mask(4, 4, "cpu").expand(2, 1, 4, 4)
    torch.testing.assert_close(
        out, reference_attention(query, key, value, causal, 0.25, softcap=50.0), rtol=1e-5, atol=1e-6
    )


def test_additive_float_mask_is_accepted():
    query, key, value, mask = inputs()
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    out, _ = eager_paged_attention(query, key, value, additive, scaling=0.3, softcap=30.0)
    torch.testing.assert_close(
        out, reference_attention(query, key, value, mask, 0.3, softcap=30.0), rtol=1e-5, atol=1e-6
    )


def test_query_heads_must_be_a_multiple_of_kv_heads():
    query, key, value, mask = inputs(heads=5, kv_heads=2)
    with pytest.raises(ValueError, match="5 query heads are not a multiple of 2 KV heads"):
        paged_attention_forward(BareModule(), query, key, value, mask)


def test_an_attention_whose_layer_wrote_nothing_attends_over_what_it_is_given(llama):
    """Inside a paged forward, an attention that is not one of the cache's layers (a vision encoder's, dispatched
    through the same switched implementation) attends over the K/V it is given; it used to read the block tables
    and fail (`read_layer called before any update`)."""
    checked = []

    def encoder_attention(module, args):
        query, key, value = torch.randn(3, 1, 2, 5, 8, generator=torch.Generator().manual_seed(len(checked))).unbind(0)
        encoder = torch.nn.Module()
        encoder.is_causal = False  # bidirectional, as a vision encoder
        output, _ = paged_attention_forward(encoder.eval(), query, key, value, attention_mask=None)
        expected = torch.nn.functional.scaled_dot_product_attention(query, key, value).transpose(1, 2)
        checked.append(torch.allclose(output, expected, atol=1e-6))

    hook = llama.model.layers[0].register_forward_pre_hook(encoder_attention)  # before any layer writes
    try:
        llama.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False, cache_implementation="paged")
    finally:
        hook.remove()
    assert checked == [True] * 3


# ---------------------------------------------------------------------- reading the blocks in place
def paged_generate(model, input_ids, attention_mask, kernel, **options):
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
        cache_implementation="paged",
        cache_config={"kernel": kernel, "block_size": 4, **options},
    )
    cache = out.past_key_values
    calls = dict(cache.attention_calls)
    cache.release()
    return out, calls


def test_decode_steps_read_the_blocks_in_place_and_match_stock():
    import hf_paged  # noqa: F401
    from hf_paged.reference_models import tiny_model

    from .conftest import left_padded_batch

    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch([5, 11, 8], seed=4)
    stock = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False, pad_token_id=0
    )
    out, calls = paged_generate(model, input_ids, attention_mask, "cpu")
    assert torch.equal(out.sequences, stock)
    assert calls == {"gather": 2, "cpu": 14}  # the left-padded prefill gathers; 7 decode steps x 2 layers in place


def test_auto_reads_a_prompt_chunk_over_a_cached_prefix_in_place():
    """Under kernel="auto" a chunk of dozens of new tokens over blocks prefix caching found reads them in place
    (`AUTO_CPU_MAX_QUERIES`, measured: benchmarks/in_place_queries.py), token-identical to stock."""
    import hf_paged  # noqa: F401
    from hf_paged.kernels import AUTO_CPU_MAX_QUERIES
    from hf_paged.reference_models import tiny_model

    model = tiny_model("llama")
    generator = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, 120, (1, 32), generator=generator)
    paged_generate(model, prefix, torch.ones_like(prefix), "auto")  # its full blocks stay cached
    input_ids = torch.cat([prefix, torch.randint(3, 120, (1, 40), generator=generator)], dim=1)
    stock = model.generate(
        input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=8, do_sample=False
    )
    out, calls = paged_generate(model, input_ids, torch.ones_like(input_ids), "auto")
    assert 40 <= AUTO_CPU_MAX_QUERIES
    assert torch.equal(out.sequences, stock)
    assert calls == {"cpu": 16}  # the 40-token chunk over 32 cached tokens and 7 decode steps, x 2 layers


def test_block_tables_are_built_once_per_forward_not_per_layer(monkeypatch):
    """A kernel's int32 block tables and lengths are made (and copied to the device) once per forward and layer
    group, however many layers read them."""
    import hf_paged
    from hf_paged import batch
    from hf_paged.reference_models import tiny_model

    from .conftest import left_padded_batch

    built = []
    live_blocks = batch._live_blocks

    def counting(tables, device, dtype=torch.long):
        built.append(dtype)
        return live_blocks(tables, device, dtype)

    monkeypatch.setattr(batch, "_live_blocks", counting)
    model = tiny_model("llama", num_hidden_layers=4)
    input_ids, attention_mask = left_padded_batch([5, 11, 8], seed=4)
    _, calls = paged_generate(model, input_ids, attention_mask, "cpu")
    assert calls["cpu"] == 7 * 4  # 7 decode steps x 4 layers read in place
    assert built.count(torch.int32) == 7, built
    assert hf_paged.get_pool(model).stats().num_used == 0


def test_a_mask_with_a_hole_is_not_read_in_place():
    # a zero inside a row's mask: stock never attends to that position; a kernel reading "every token of the row"
    # would. The mask check sends those decode steps to the gather path, which follows the mask.
    import hf_paged.batch
    from hf_paged.reference_models import tiny_model

    model = tiny_model("llama")
    input_ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 4] = 0
    stock = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    out, calls = paged_generate(model, input_ids, attention_mask, "cpu")
    assert torch.equal(out.sequences, stock.sequences) and "cpu" not in calls
    # negative control: trusting such a mask reads the hidden position, and the scores move
    original = hf_paged.batch.ForwardBatch.in_place_readable
    hf_paged.batch.ForwardBatch.in_place_readable = lambda self, mask, window: True
    try:
        trusted, calls = paged_generate(model, input_ids, attention_mask, "cpu")
    finally:
        hf_paged.batch.ForwardBatch.in_place_readable = original
    assert calls.get("cpu")
    gap = max((a[1] - b[1]).abs().max().item() for a, b in zip(stock.scores[1:], trusted.scores[1:]))
    assert gap > 1e-3


def test_softcap_and_sliding_layers_read_in_place_match_eager_stock():
    # Gemma2: alternating sliding (window 6) and full layers, logit soft-capping; stock runs it in eager attention
    from hf_paged.reference_models import tiny_model

    from .conftest import left_padded_batch

    model = tiny_model("gemma2")
    input_ids, attention_mask = left_padded_batch([5, 11, 8], seed=2)
    stock = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    out, calls = paged_generate(model, input_ids, attention_mask, "cpu", attn_implementation="hf_paged")
    assert torch.equal(out.sequences, stock.sequences) and calls["cpu"] == 14
    gap = max((a - b).abs().max().item() for a, b in zip(stock.scores, out.scores))
    assert gap <= 1e-5


def test_attention_sinks_read_in_place_match_stock():
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0,
        eos_token_id=1,
    )
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()  # sinks that matter
    input_ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    stock = model.generate(
        input_ids=input_ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_scores=True
    )
    out, calls = paged_generate(model, input_ids, torch.ones_like(input_ids), "cpu", attn_implementation="hf_paged")
    assert torch.equal(out.sequences, stock.sequences) and calls.get("cpu")
    assert max((a - b).abs().max().item() for a, b in zip(stock.scores, out.scores)) <= 1e-5


def test_engine_packed_steps_split_between_the_kernel_and_gather():
    import hf_paged
    from hf_paged.kernels import AUTO_CPU_MAX_QUERIES
    from hf_paged.reference_models import tiny_model

    model = tiny_model("llama")
    long = AUTO_CPU_MAX_QUERIES + 40  # its prompt chunk is wider than the kernel takes under "auto"
    engine = hf_paged.Engine(
        model, block_size=4, num_blocks=512, progress=False, max_prefill_tokens=long + 64, exact=True
    )
    prompts = [[5 + i] * length for i, length in enumerate([3, long, 7, 2, 25])]
    outputs = engine.generate(prompts, [hf_paged.SamplingParams(max_new_tokens=6, eos_token_id=())] * 5)
    calls = engine.cache.attention_calls
    assert engine.cache.kernel.max_queries == AUTO_CPU_MAX_QUERIES
    # decoding rows and short chunks in place; the long prompt's chunk gathers
    assert calls["cpu"] > 0 and calls["gather"] > 0
    assert engine.stats().attention_kernel == "cpu" and engine.stats().attention_calls == calls
    from hf_paged.serve.metrics import MetricsSnapshot, render_metrics

    totals = {"requests": 5, "prompt_tokens": sum(map(len, prompts)), "generation_tokens": 30}
    text = render_metrics(MetricsSnapshot.take(engine, totals, 0.0)).splitlines()
    assert 'hf_paged_attention_kernel_info{kernel="cpu"} 1' in text
    assert f'hf_paged_attention_calls_total{{kernel="gather"}} {calls["gather"]}' in text
    for prompt, output in zip(prompts, outputs):
        stock = model.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None
        )
        assert output.token_ids == stock[0, len(prompt) :].tolist()
    engine.close()


def test_stats_and_repr_name_the_kernel():
    import hf_paged
    from hf_paged.reference_models import tiny_model

    model = tiny_model("llama")
    cache = hf_paged.PagedCache(model, kernel="gather")
    assert "kernel='gather'" in repr(cache) and cache.stats().attention_kernel == "gather"
    cache.release()
    with pytest.raises(ValueError, match=r"kernel must be one of \[.*'flash'\], got 'vllm'"):
        hf_paged.PagedCache(model, kernel="vllm")
