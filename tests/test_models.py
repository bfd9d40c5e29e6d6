"""Model families: each supported family, as a tiny random fp32 model, generates on the paged cache exactly what it
generates on `DynamicCache` (greedy, sampling, beam search, several returned sequences, assisted decoding), under the
"hf_paged" attention and under stock attentions reading the paged cache; families the paged cache cannot serve are
refused with an error naming the model and the reason."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import pytest
import torch
import transformers

import hf_paged
from hf_paged import PagedCache, get_pool
from hf_paged.reference_models import TINY_FAMILIES, tiny_model

from .conftest import left_padded_batch

pytestmark = pytest.mark.kernel_matrix  # every test runs on the in-place kernel and on gather

CACHE = {"block_size": 4, "num_blocks": 256}  # small blocks: every row spans several; a small pool checks fast
TOLERANCE = 1e-5
MAX_NEW_TOKENS = 10

# case -> (tiny family, config overrides)
CASES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {"sliding_window": 6}),
    "mixtral": ("mixtral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    "gemma4": ("gemma4", {}),
    "phi3": ("phi3", {}),
    "gpt2": ("gpt2", {}),
    "opt": ("opt", {}),
    "falcon": ("falcon", {}),
    "falcon-alibi": ("falcon", {"alibi": True, "new_decoder_architecture": False, "multi_query": True}),
    "gpt_neox": ("gpt_neox", {}),
    "stablelm": ("stablelm", {}),
    "starcoder2": ("starcoder2", {}),
    "olmo2": ("olmo2", {}),
}
# stock attentions each case is checked with (transformers itself refuses SDPA for Gemma2's soft-capped logits)
STOCK_ATTENTIONS = {case: ("eager",) if case == "gemma2" else ("sdpa", "eager") for case in CASES}

MODES = {  # prompt lengths of a left-padded batch, and the decoding options
    "greedy": ((5, 11, 8), {"do_sample": False}),
    "sample": ((5, 11, 8), {"do_sample": True}),
    "beams": ((5, 9), {"num_beams": 4, "do_sample": False}),
    "return_sequences": ((5, 9), {"do_sample": True, "num_return_sequences": 2}),
}
STOCK_CASES = [(case, implementation) for case in CASES for implementation in STOCK_ATTENTIONS[case]]


@pytest.fixture(scope="module")
def models():
    """`models(case, attn_implementation=None, seed=0)`: the case's tiny model, built once per module."""
    built = {}

    def get(case: str, attn_implementation: str | None = None, seed: int = 0):
        key = (case, attn_implementation, seed)
        if key not in built:
            family, overrides = CASES[case]
            if attn_implementation is not None:
                overrides = {**overrides, "attn_implementation": attn_implementation}
            built[key] = tiny_model(family, seed=seed, **overrides)
        return built[key]

    yield get
    built.clear()


def assert_equivalent(reference, paged) -> None:
    """Token-identical sequences; logits of every step (and beam scores) within `TOLERANCE`."""
    assert torch.equal(reference.sequences, paged.sequences)
    assert len(reference.logits) == len(paged.logits)
    gap = max((a - b).abs().max().item() for a, b in zip(reference.logits, paged.logits))
    assert gap <= TOLERANCE, f"logits differ by {gap:.2e}"
    if getattr(reference, "sequences_scores", None) is not None:
        assert torch.allclose(reference.sequences_scores, paged.sequences_scores, atol=TOLERANCE, rtol=0)
        assert torch.equal(reference.beam_indices, paged.beam_indices)


def generate_both(model, paged_options: dict, paged_context=None, **kwargs):
    """The same seeded `generate` call on `DynamicCache` and on the paged cache (run inside `paged_context`); the
    paged cache is released."""
    kwargs = {
        "max_new_tokens": MAX_NEW_TOKENS,
        "pad_token_id": 0,
        "return_dict_in_generate": True,
        "output_logits": True,
        **kwargs,
    }
    torch.manual_seed(1234)
    reference = model.generate(**kwargs)
    torch.manual_seed(1234)
    with paged_context or nullcontext():
        paged = model.generate(**kwargs, cache_implementation="paged", cache_config=paged_options)
    assert isinstance(paged.past_key_values, PagedCache)
    paged.past_key_values.release()
    assert get_pool(model).stats().num_used == 0
    return reference, paged


def check_mode(model, paged_options: dict, mode: str) -> None:
    lengths, options = MODES[mode]
    input_ids, attention_mask = left_padded_batch(list(lengths), seed=len(mode))
    reference, paged = generate_both(
        model, paged_options, input_ids=input_ids, attention_mask=attention_mask, **options
    )
    assert_equivalent(reference, paged)


def test_every_tiny_family_is_in_the_matrix():
    assert sorted({family for family, _ in CASES.values()}) == sorted(TINY_FAMILIES)


# ---------------------------------------------------------------------- the equivalence matrix
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_hf_paged_attention_matches_dynamic_cache(models, case, mode):
    model = models(case)  # asked for by name: an eager model (Gemma2) would otherwise keep its own attention
    options = {**CACHE, "attn_implementation": "hf_paged"} if model._can_set_attn_implementation() else CACHE
    check_mode(model, options, mode)


@pytest.mark.parametrize("mode", ["greedy", "beams"])
@pytest.mark.parametrize("case,implementation", STOCK_CASES)
def test_stock_attention_reading_a_paged_cache_matches_dynamic_cache(models, case, implementation, mode):
    check_mode(models(case, implementation), {**CACHE, "attn_implementation": implementation}, mode)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sample", "return_sequences"])
@pytest.mark.parametrize("case,implementation", STOCK_CASES)
def test_stock_attention_sampling_matches_dynamic_cache(models, case, implementation, mode):
    check_mode(models(case, implementation), {**CACHE, "attn_implementation": implementation}, mode)


@contextmanager
def paged_assistant(assistant):
    """The assistant model generates on a paged cache of its own while the block runs (through its generation
    config, as transformers' assisted decoding passes it no cache options)."""
    config = assistant.generation_config
    saved = config.cache_implementation, config.cache_config
    config.cache_implementation, config.cache_config = "paged", dict(CACHE)
    try:
        yield
    finally:
        config.cache_implementation, config.cache_config = saved


@pytest.mark.parametrize("method", ["prompt_lookup", "assistant_model"])
@pytest.mark.parametrize("case", CASES)
def test_assisted_decoding_matches_dynamic_cache(models, case, method):
    """Assisted greedy decoding of one repetitive prompt: prompt lookup, or an assistant of the same family (other
    weights) whose own cache is paged in the paged run."""
    model = models(case)
    prompt = torch.randint(3, 12, (1, 24), generator=torch.Generator().manual_seed(5))  # repeats: lookup hits
    kwargs = {"input_ids": prompt, "do_sample": False, "max_new_tokens": 12}
    assistant = None
    if method == "prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = 3
    else:
        assistant = models(case, seed=3)
        kwargs["assistant_model"] = assistant
    context = paged_assistant(assistant) if assistant is not None else nullcontext()
    reference, paged = generate_both(model, CACHE, paged_context=context, **kwargs)
    assert_equivalent(reference, paged)
    if assistant is not None:
        pool = get_pool(assistant)
        assert pool.last_cache_stats is not None and pool.stats().num_used == 0


# ---------------------------------------------------------------------- families with their own attention
def test_falcon_keeps_its_own_attention_and_refuses_another(models):
    """Falcon picks its attention classes when it is built, so transformers cannot switch them: paged generation
    runs Falcon's own attention on dense K/V read from the pool (exact, above), and refuses to pretend otherwise."""
    model = models("falcon")
    input_ids = torch.randint(3, 128, (1, 6))
    refusal = "FalconForCausalLM hard-codes its attention classes .* attn_implementation='eager' cannot be honoured"
    with pytest.raises(ValueError, match=refusal):
        model.generate(
            input_ids=input_ids,
            max_new_tokens=2,
            pad_token_id=0,
            cache_implementation="paged",
            cache_config={**CACHE, "attn_implementation": "eager"},
        )
    assert model.config._attn_implementation == "sdpa"
    assert get_pool(model).stats().num_used == 0


def test_attention_that_bypasses_the_block_tables_is_refused_not_silently_wrong():
    """Negative control: a Falcon forced onto the "hf_paged" name still runs its own attention, which would see only
    each step's new tokens; the cache notices that the layer never read its K/V back and raises."""
    model = tiny_model("falcon")
    model.config._attn_implementation_internal = "hf_paged"
    with pytest.raises(NotImplementedError, match="FalconForCausalLM: layer 0 .* did not read them back"):
        model.generate(
            input_ids=torch.randint(3, 128, (1, 6)),
            max_new_tokens=3,
            pad_token_id=0,
            cache_implementation="paged",
            cache_config=CACHE,
        )
    assert get_pool(model).stats().num_used == 0


def test_layers_that_do_not_pass_kwargs_to_their_attention_still_read_the_tables(models):
    """StableLM's decoder layers call their attention without the forward's keyword arguments; the "hf_paged"
    attention finds the cache through hf_paged's per-thread binding. An unpadded single prompt is the case where
    the mask is skipped, so only reading the tables keeps decoding exact."""
    model = models("stablelm")
    input_ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    reference, paged = generate_both(model, CACHE, input_ids=input_ids, do_sample=False)
    assert_equivalent(reference, paged)
    assert hf_paged.attention.bound_paged_cache() is None  # unbound once the forwards are over


# ---------------------------------------------------------------------- attention that transforms K/V after the update
LLAMA_LIKE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
TRANSFORMING = {  # model types whose attention changes the K/V the cache update returns before attending
    "diffllama": ("DiffLlamaConfig", "DiffLlamaForCausalLM", {}),
    "doge": ("DogeConfig", "DogeForCausalLM", {"keep_window_size": 2048}),
    "jetmoe": (
        "JetMoeConfig",
        "JetMoeForCausalLM",
        {"kv_channels": 16, "num_experts_per_tok": 2, "num_local_experts": 4},
    ),
}


def transforming(model_type: str) -> torch.nn.Module:
    config_name, model_name, options = TRANSFORMING[model_type]
    return tiny(config_name, model_name, **LLAMA_LIKE, max_position_embeddings=512, **options)


def assert_refused_mid_forward(model, message: str) -> None:
    """A paged `generate` raises `NotImplementedError` matching `message` during its first forward, and leaves the
    pool consistent with every block back."""
    with pytest.raises(NotImplementedError, match=message):
        model.generate(
            input_ids=torch.randint(3, 128, (1, 6)), max_new_tokens=3, cache_implementation="paged", cache_config=CACHE
        )
    pool = get_pool(model)
    pool.check_invariants()
    assert pool.stats().num_used == 0


@pytest.mark.parametrize("mode", ["greedy", "beams"])
@pytest.mark.parametrize("model_type", TRANSFORMING)
def test_attention_transforming_its_kv_reads_the_paged_cache_densely(model_type, mode):
    """DiffLlama splits and repeats its values, Doge computes its mask from them, JetMoe repeats K/V per expert,
    all after the cache update: they keep their own attention, which reads the paged cache as dense K/V (the
    "hf_paged" attention, handed the new tokens only, gave other tokens with no error, or crashed)."""
    model = transforming(model_type)
    assert hf_paged.support.kv_transformed_after_update(model) is not None
    check_mode(model, CACHE, mode)
    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9)]
    engine = hf_paged.Engine(model, block_size=4, num_blocks=64, exact=True)
    outputs = engine.generate(prompts, max_new_tokens=6, min_new_tokens=6)
    engine.close()
    for prompt, output in zip(prompts, outputs):
        stock = model.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert output.token_ids == stock[0, len(prompt) :].tolist()
    with pytest.raises(NotImplementedError, match="after the cache update, so it must read the cached K/V as dense"):
        model.generate(
            input_ids=torch.tensor([prompts[0]]),
            max_new_tokens=2,
            cache_implementation="paged",
            cache_config={**CACHE, "attn_implementation": "hf_paged"},
        )
    assert get_pool(model).stats().num_used == 0


@pytest.mark.parametrize("model_type", ["diffllama", "jetmoe"])
def test_kv_of_another_shape_than_stored_is_refused_mid_forward(model_type, monkeypatch):
    """The safety net for a model not in the list: the "hf_paged" attention refuses K/V other than its layer's
    update returned (DiffLlama's keep their shape, JetMoe's do not), instead of attending to untransformed K/V."""
    monkeypatch.delitem(hf_paged.support.KV_TRANSFORMED_AFTER_UPDATE, model_type)
    refusal = r"layer 0's attention got other K/V than its cache update returned"
    assert_refused_mid_forward(transforming(model_type), refusal)


def test_an_update_into_another_cache_slot_than_the_module_layer_is_read_from_that_slot():
    """HRM-text runs its two layers of each stack several times per forward, each pass writing cache slot
    `layer_idx + cycle_offset`; the "hf_paged" attention reads the slot the update named (it read the module's
    `layer_idx` and was refused: that slot's K/V were never read back)."""
    model = tiny(
        "HrmTextConfig",
        "HrmTextForCausalLM",
        **LLAMA_LIKE | {"num_hidden_layers": 16},
        num_layers_per_stack=2,
        H_cycles=2,
        L_cycles=3,
        max_position_embeddings=512,
    )
    for mode in ("greedy", "beams"):
        check_mode(model, {**CACHE, "attn_implementation": "hf_paged"}, mode)
    prompt = torch.randint(3, 128, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    engine = hf_paged.Engine(model, block_size=4, num_blocks=256, exact=True)
    (output,) = engine.generate([prompt], max_new_tokens=6, min_new_tokens=6)
    engine.close()
    stock = model.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert output.token_ids == stock[0, len(prompt) :].tolist()


# ---------------------------------------------------------------------- refused families
def tiny(config_name: str, model_name: str, **options) -> torch.nn.Module:
    config = getattr(transformers, config_name)(
        vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, **options
    )
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).eval()


def assert_refused(model, message: str) -> None:
    """Both `generate(cache_implementation="paged")` and `PagedCache(model)` raise, before any pool is made."""
    pools = len(hf_paged.live_pools())
    with pytest.raises(NotImplementedError, match=message):
        model.generate(input_ids=torch.randint(3, 128, (1, 5)), max_new_tokens=2, cache_implementation="paged")
    with pytest.raises(NotImplementedError, match=message):
        PagedCache(model)
    assert len(hf_paged.live_pools()) == pools


def test_encoder_decoder_t5_is_refused():
    model = tiny(
        "T5Config",
        "T5ForConditionalGeneration",
        d_model=32,
        d_ff=64,
        num_layers=1,
        num_heads=2,
        d_kv=16,
        decoder_start_token_id=0,
    )
    assert_refused(model, "T5ForConditionalGeneration is an encoder-decoder model .* cross-attention")


def test_encoder_decoder_bart_is_refused():
    model = tiny(
        "BartConfig",
        "BartForConditionalGeneration",
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
    )
    assert_refused(model, "BartForConditionalGeneration is an encoder-decoder model")


def test_linear_attention_hybrid_qwen3_next_is_refused():
    model = tiny(
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"],
    )
    assert_refused(model, r"Qwen3NextForCausalLM has \['linear_attention'\] layers \(layers \[0\]\)")


def test_mamba_hybrid_jamba_is_refused():
    model = tiny(
        "JambaConfig",
        "JambaForCausalLM",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
    )
    assert_refused(model, r"JambaForCausalLM has \['linear_attention'\] layers .*not a recurrent")


def test_recurrent_mamba_is_refused():
    model = tiny("MambaConfig", "MambaForCausalLM", hidden_size=64, num_hidden_layers=2, state_size=8)
    assert_refused(model, "MambaForCausalLM has no attention heads")


def test_multi_head_latent_attention_deepseek_v3_is_refused():
    model = tiny(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    )
    assert_refused(model, r"DeepseekV3ForCausalLM uses multi-head latent attention \(kv_lora_rank=16\)")


def test_minimax_with_only_full_attention_layers_is_refused_by_generate_and_the_engine():
    """transformers builds no DynamicCache for MiniMax (a cache of its own); the Engine used to be built and fail
    at its first step from inside the model."""
    options = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    options |= {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2}
    model = tiny("MiniMaxConfig", "MiniMaxForCausalLM", layer_types=["full_attention"] * 2, **options)
    refusal = r"MiniMaxForCausalLM keeps a cache of its own \(transformers builds no DynamicCache for it\)"
    assert_refused(model, refusal)
    with pytest.raises(NotImplementedError, match=refusal):
        hf_paged.Engine(model, exact=True)


def test_cross_attention_layers_mllama_are_refused():
    """Mllama's cross-attention layers keep the image features' K/V in the cache (images crashed deep inside)."""
    model = tiny("MllamaTextConfig", "MllamaForCausalLM", **LLAMA_LIKE, cross_attention_layers=[1])
    assert_refused(model, r"MllamaForCausalLM has cross-attention layers \(layers \[1\]\)")


def tiny_mimo(**options) -> torch.nn.Module:
    return tiny(
        "MiMoV2FlashConfig",
        "MiMoV2FlashForCausalLM",
        **LLAMA_LIKE,
        head_dim=16,
        mlp_layer_types=["dense"] * 2,
        **options,
    )


def test_values_wider_than_keys_are_refused():
    model = tiny_mimo(v_head_dim=24, layer_types=["full_attention"] * 2)
    assert_refused(model, "MiMoV2FlashForCausalLM has values of v_head_dim=24 dims and keys of head_dim=16")


def test_layer_groups_with_k_v_of_different_shapes_are_refused_at_the_first_write():
    """MiMo-V2-Flash's sliding layers have twice the KV heads of its full layers; the layer groups share lanes, so
    the first write of the second shape is refused clearly (it was a dtype/device message) and nothing is kept."""
    model = tiny_mimo(v_head_dim=16, sliding_window=6, layer_types=["full_attention", "sliding_attention"])
    refusal = r"layer 1 produced K/V of 4 heads x 16 dims, but lane 0, which it shares with a layer of another layer"
    assert_refused_mid_forward(model, refusal)


def test_chunked_attention_llama4_is_refused():
    model = tiny(
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        hidden_size=64,
        intermediate_size=128,
        intermediate_size_mlp=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        attention_chunk_size=8,
    )
    assert_refused(model, r"Llama4ForCausalLM has \['chunked_attention'\] layers")


def test_kv_sharing_gemma3n_is_refused():
    model = tiny(
        "Gemma3nTextConfig",
        "Gemma3nForCausalLM",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_kv_shared_layers=2,
        sliding_window=6,
        laurel_rank=8,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=128,
        altup_num_inputs=2,
        activation_sparsity_pattern=[0.0] * 4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )
    assert_refused(model, "Gemma3nForCausalLM shares K/V between layers")


def test_kv_sharing_gemma4_is_refused():
    layer_types = ["sliding_attention", "full_attention"] * 2
    model = tiny_model("gemma4", num_hidden_layers=4, layer_types=layer_types, num_kv_shared_layers=2)
    assert_refused(model, "Gemma4ForCausalLM shares K/V between layers")


@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_generate_alone(models, case):
    """The continuous-batching Engine (rows of different lengths in one forward) on every family."""
    model = models(case)
    prompts = [[3 + (7 * i + j) % 100 for j in range(length)] for i, length in enumerate((3, 11, 6, 9))]
    options = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False}
    expected = [model.generate(torch.tensor([p]), pad_token_id=0, **options)[0, len(p) :].tolist() for p in prompts]
    with hf_paged.Engine(model, **CACHE, exact=True) as engine:
        outputs = engine.generate(prompts, **options)
        assert [o.token_ids for o in outputs] == expected
        stats = engine.last_stats
    if model._can_set_attn_implementation():  # packed steps (Gemma2, an eager model, too): no pad position
        assert stats.pad_positions == 0 and stats.mixed_steps + stats.prefill_steps >= 1
    else:  # Falcon hard-codes its attention, which cannot read the tables: right-aligned steps with left pads
        assert stats.pad_positions > 0
    assert model.config._attn_implementation == ("eager" if case == "gemma2" else "sdpa")  # restored
    assert get_pool(model).stats().num_used == 0


def tiny_step3p7(sliding_heads: int) -> torch.nn.Module:
    """Step-3.7 (text and a 1-layer vision tower) whose sliding layers have `sliding_heads` query heads where its
    full layers have 4: a heterogeneous config (transformers' `per_layer_config`) when they differ."""
    text = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "share_expert_dim": 32,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "layer_types": ["full_attention", "sliding_attention"] * 2,
        "sliding_window": 4,
        "num_sliding_attention_heads": sliding_heads,
    }
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = transformers.Step3p7Config(text_config=text, vision_config={**vision, "image_size": 28, "patch_size": 14})
    torch.manual_seed(0)
    return transformers.Step3p7ForConditionalGeneration(config).eval()


@pytest.mark.parametrize("mode", ["greedy", "beams"])
def test_layers_with_their_own_head_counts_heterogeneous_step3p7(mode):
    """A config that sets attributes layer by layer (reading them globally raises in transformers) is read layer
    by layer: Step-3.7 with 8 query heads in its sliding layers and 4 in its full layers is exact."""
    model = tiny_step3p7(sliding_heads=8)
    assert model.config.text_config.is_heterogeneous
    with pytest.raises(Exception, match="per-layer attribute"):
        model.config.text_config.num_attention_heads  # noqa: B018  (what a global read would do)
    check_mode(model, CACHE, mode)


def test_engine_on_layers_with_their_own_head_counts_heterogeneous_step3p7():
    model = tiny_step3p7(sliding_heads=8)
    prompts = [[3 + (5 * i + j) % 100 for j in range(length)] for i, length in enumerate((4, 9, 6))]
    options = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False}
    expected = [model.generate(input_ids=torch.tensor([p]), pad_token_id=0, **options)[0, len(p) :] for p in prompts]
    with hf_paged.Engine(model, **CACHE, exact=True) as engine:
        outputs = engine.generate(prompts, **options)
    assert [o.token_ids for o in outputs] == [e.tolist() for e in expected]
    assert get_pool(model).stats().num_used == 0


def test_heterogeneous_config_with_indexed_attention_layers_dots3_note_is_refused_by_its_layer_kinds():
    """dots.3 note sets its head counts layer by layer and has DeepSeek-style indexed attention layers: refused for
    those layers, by name, rather than failing on a global read of a per-layer attribute."""
    from hf_paged.support import check_supported

    config = transformers.AutoConfig.for_model("dots3_note")
    assert config.get_text_config(decoder=True).is_heterogeneous
    model = torch.nn.Module()  # check_supported reads the model's config and its class name only
    model.config = config
    with pytest.raises(NotImplementedError, match=r"\['indexed_attention'\] layers"):
        check_supported(model)


def test_a_forward_that_takes_no_cache_runs_as_stock_in_generate_and_is_refused_by_the_engine():
    """GPT-1 takes no `past_key_values`: generate recomputes every position, as stock does with any cache; the
    Engine, whose steps feed only the tokens its cache does not hold, refuses it before making a pool (it failed
    with a shape error in the model's attention at the first decode step)."""
    model = tiny("OpenAIGPTConfig", "OpenAIGPTLMHeadModel", n_embd=64, n_layer=2, n_head=4, n_positions=64)
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    expected = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    paged = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="paged")
    assert torch.equal(paged, expected)
    pools = len(hf_paged.live_pools())
    with pytest.raises(NotImplementedError, match="OpenAIGPTLMHeadModel's forward takes no past_key_values"):
        hf_paged.Engine(model, **CACHE, exact=True)
    assert len(hf_paged.live_pools()) == pools


def test_a_model_that_adds_positions_of_its_own_cpmant_is_refused_by_the_engine_at_its_first_step():
    """CPM-Ant puts prompt positions of its own before the input, so its layers write more K/V than the step's
    tokens: generate (which plans from what the layers write) is exact; the Engine, which plans each step's slots
    from its input tokens, refuses at the first write (it failed with a shape error) and keeps its pool intact."""
    model = tiny("CpmAntConfig", "CpmAntForCausalLM", hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    expected = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    paged = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="paged")
    assert torch.equal(paged, expected)
    with hf_paged.Engine(model, **CACHE, exact=True) as engine:
        with pytest.raises(NotImplementedError, match=r"CpmAntForCausalLM: layer 0 wrote K/V of 2 x 3\d positions"):
            engine.generate([[3, 4, 5, 6], [7, 8, 9, 10, 11, 12]], max_new_tokens=4)
        assert engine.pool.stats().num_used == 0
        engine.pool.check_invariants()


@pytest.mark.parametrize("mode", ["greedy", "beams"])
def test_sub_configs_without_a_sub_model_moshi_keep_their_unset_attention(mode):
    """MoshiForCausalLM's config has sub-configs (audio encoder, depth decoder) with no attention implementation set
    (`None`), which `set_attn_implementation` refuses when putting them back: the paged call failed on the way out.
    Now exact, and every implementation is back as it was."""
    from hf_paged.forward import _implementations

    options = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    model = tiny("MoshiConfig", "MoshiForCausalLM", head_dim=16, max_position_embeddings=256, **options)
    before = _implementations(model.config)
    assert before["audio_encoder_config"] == {"": None}
    for _ in range(2):  # the second call replays the first one's recorded switch
        check_mode(model, CACHE, mode)
        assert _implementations(model.config) == before


def test_git_without_an_image_is_refused_for_left_padded_rows_whose_pads_stock_attends():
    """Stock GIT widens the padding mask by its image-patch count at every decode step even without an image, so a
    left-padded row attends to its pads, which a paged cache never stores (the outputs differed, silently). Refused
    then; unpadded rows are exact."""
    options = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    model = tiny("GitConfig", "GitForCausalLM", max_position_embeddings=256, **options)
    ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(22))
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    mask = torch.ones_like(ids)
    assert torch.equal(
        model.generate(ids, attention_mask=mask, **kwargs, cache_implementation="paged"),
        model.generate(ids, attention_mask=mask, **kwargs),
    )
    mask[0, :5] = 0
    pools = len(hf_paged.live_pools())
    with pytest.raises(NotImplementedError, match="GitForCausalLM without an image widens the padding mask"):
        model.generate(ids, attention_mask=mask, **kwargs, cache_implementation="paged")
    assert get_pool(model).stats().num_used == 0 and len(hf_paged.live_pools()) == pools
