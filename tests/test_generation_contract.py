"""The edges of the `generate()` contract under `cache_implementation="paged"`: `use_cache=False`, the caller's
attention implementation and `output_attentions`, prompts whose K/V depend on more than token ids (images,
`inputs_embeds`), the dense `layers[i].keys/.values` view, and weights changed in place behind the prefix cache.
Every paged call is compared with the same stock call made in the same test."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import DynamicCache, GenerationConfig

import hf_paged
from hf_paged import PagedCache, get_pool
from hf_paged.reference_models import IMAGE_TOKEN_ID, TOKENS_PER_IMAGE, tiny_model, tiny_vision_language_model

from .conftest import left_padded_batch
from .exactness import SCORE_TOLERANCE, assert_scores_match, reads_in_place

CACHE = {"block_size": 4, "num_blocks": 256}
TOLERANCE = 1e-5
MODES = {
    "greedy": {"do_sample": False},
    "sample": {"do_sample": True, "num_return_sequences": 2},
    "beams": {"num_beams": 3, "do_sample": False},
}


def seeded(model, **kwargs):
    torch.manual_seed(1234)
    return model.generate(pad_token_id=0, return_dict_in_generate=True, output_scores=True, **kwargs)


def assert_same_scores(reference, paged) -> None:
    assert torch.equal(reference.sequences, paged.sequences)
    assert len(reference.scores) == len(paged.scores)
    gap = max((a - b).abs().where(a != b, 0).max().item() for a, b in zip(reference.scores, paged.scores))
    assert gap <= TOLERANCE, f"scores differ by {gap:.2e}"


# ---------------------------------------------------------------------- prefill_chunk_size
@pytest.mark.parametrize("lengths", [[9, 9], [7, 9, 6], [2, 9]], ids=["equal", "padded", "pads-up-to-the-chunk"])
def test_chunked_prefill_equals_stock(lengths):
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch(lengths, seed=5)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=6, output_logits=True)
    reference = seeded(model, **kwargs)  # one forward over the whole prompt
    pool = get_pool(model, **CACHE)
    paged = seeded(model, **kwargs, prefill_chunk_size=4 if lengths != [2, 9] else 8, cache_implementation="paged",
                   cache_config=CACHE)  # fmt: skip
    assert_same_scores(reference, paged)
    gap = max((a - b).abs().max().item() for a, b in zip(reference.logits, paged.logits))
    assert gap <= TOLERANCE
    paged.past_key_values.release()  # returned by `return_dict_in_generate`: held until released
    pool.check_invariants()
    assert pool.stats().num_used == 0


def test_a_first_prefill_chunk_of_only_pads_is_refused_naming_the_chunk_size():
    """Stock runs it (the row attends to its pad K/V); a paged cache stores no pad, so the row has nothing to attend
    to in that chunk. Before the check the refusal spoke of an empty prompt."""
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch([5, 9, 3], seed=5)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=4, prefill_chunk_size=4)
    assert seeded(model, **kwargs).sequences.shape == (3, 13)  # stock
    pool = get_pool(model, **CACHE)
    with pytest.raises(ValueError, match=r"prefill_chunk_size=4 leaves row 2 .* 6 left-pad .* above 6"):
        seeded(model, **kwargs, cache_implementation="paged", cache_config=CACHE)
    pool.check_invariants()
    assert pool.stats().num_used == 0
    attention_mask[0] = 0  # an empty row beside it: the padded row is still the one named
    with pytest.raises(ValueError, match=r"leaves row 2 "):
        seeded(model, **{**kwargs, "attention_mask": attention_mask}, cache_implementation="paged", cache_config=CACHE)
    assert pool.stats().num_used == 0


# ---------------------------------------------------------------------- use_cache=False
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3"])
def test_use_cache_false_runs_exactly_like_stock_and_takes_no_block(family, mode):
    """Stock `use_cache=False` builds no cache and recomputes the whole sequence every step. Before the fix the
    paged path appended the whole sequence to a `PagedCache` at every step (duplicates attended to: other tokens)."""
    model = tiny_model(family)
    input_ids, attention_mask = left_padded_batch([5, 9], seed=3)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=12, use_cache=False)
    pool = get_pool(model, **CACHE)
    before = pool.stats()
    reference = seeded(model, **kwargs, **MODES[mode])
    paged = seeded(model, **kwargs, **MODES[mode], cache_implementation="paged", cache_config=CACHE)
    assert_same_scores(reference, paged)
    assert reference.past_key_values is None and paged.past_key_values is None
    assert pool.stats() == before  # no block taken, none cached


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_checkpointing_in_training_mode_runs_like_stock_or_is_refused_clearly():
    """Under activation checkpointing in training mode transformers' layers drop the cache (stock then generates
    without one): a fresh paged call runs as stock does; a caller's cache and a plain forward are refused before
    anything is taken (it was `RuntimeError: read_layer called before any update` from inside the attention)."""
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch([5, 9], seed=3)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=6)
    pool = get_pool(model, **CACHE)
    model.activation_checkpointing_enable()
    model.train()
    before = pool.stats()
    reference = seeded(model, **kwargs, do_sample=False)
    paged = seeded(model, **kwargs, do_sample=False, cache_implementation="paged", cache_config=CACHE)
    assert_same_scores(reference, paged)
    assert pool.stats() == before
    cache = PagedCache(model, **CACHE)
    with pytest.raises(ValueError, match="training mode with activation .* drop the KV cache"):
        model.generate(**kwargs, past_key_values=cache)
    with pytest.raises(ValueError, match=r"Call model.eval\(\)"):
        model(input_ids, past_key_values=cache)
    assert cache.batch_size == 0 and pool.stats() == before
    model.eval()
    assert torch.equal(model.generate(**kwargs, past_key_values=cache), model.generate(**kwargs))
    cache.release()


def test_use_cache_false_from_generation_configs_is_honoured(llama):
    """`use_cache=False` in the generation config passed, and `cache_implementation="paged"` in the model's own."""
    input_ids, attention_mask = left_padded_batch([6, 4], seed=4)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False)
    reference = seeded(llama, **kwargs, use_cache=False)
    saved = llama.generation_config.cache_implementation
    llama.generation_config.cache_implementation = "paged"
    try:
        paged = seeded(llama, **kwargs, generation_config=GenerationConfig(use_cache=False))
        cached = seeded(llama, **kwargs)  # the model's config asks for paged and use_cache stays on: a PagedCache
    finally:
        llama.generation_config.cache_implementation = saved
    assert_same_scores(reference, paged)
    assert paged.past_key_values is None
    assert isinstance(cached.past_key_values, PagedCache)  # control: the model's config does route to paged
    assert torch.equal(cached.sequences, reference.sequences)
    cached.past_key_values.release()


# ---------------------------------------------------------------------- attention weights
def attentions_gap(reference, paged) -> float:
    assert len(reference.attentions) == len(paged.attentions)
    gaps = [0.0]
    for step_reference, step_paged in zip(reference.attentions, paged.attentions):
        assert len(step_reference) == len(step_paged) > 0
        for a, b in zip(step_reference, step_paged):
            assert a.shape == b.shape
            gaps.append((a - b).abs().max().item())
    return max(gaps)


@pytest.mark.parametrize("method", ["greedy", "prompt_lookup"])
def test_eager_model_keeps_its_attention_and_returns_the_stock_attention_weights(method):
    """A model loaded with eager attention keeps it on the paged path: `output_attentions=True` returns every
    layer's weights as stock does (before: none, and an IndexError inside prompt-lookup decoding)."""
    model = tiny_model("llama", attn_implementation="eager")
    prompt = torch.randint(3, 12, (1, 20), generator=torch.Generator().manual_seed(5))  # repeats: lookup hits
    kwargs = dict(input_ids=prompt, max_new_tokens=8, do_sample=False, output_attentions=True)
    if method == "prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = 3
    reference = seeded(model, **kwargs)
    model.generate(input_ids=prompt, max_new_tokens=1, cache_implementation="paged", cache_config=CACHE)
    assert get_pool(model).stats().num_cached > 0  # the prompt's blocks are cached, but must not stand in
    paged = seeded(model, **kwargs, cache_implementation="paged", cache_config=CACHE)
    assert_same_scores(reference, paged)
    assert attentions_gap(reference, paged) <= TOLERANCE
    assert model.config._attn_implementation == "eager"
    paged.past_key_values.release()


def test_hidden_states_cover_every_prompt_position_despite_a_cached_prefix(llama):
    """A cached prompt prefix would skip its positions' prefill, and with it their hidden states: a call asking
    for hidden states computes the whole prompt, as stock does."""
    prompt = torch.randint(3, 128, (2, 18), generator=torch.Generator().manual_seed(11))
    kwargs = dict(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False)
    llama.generate(**kwargs, pad_token_id=0, cache_implementation="paged", cache_config=CACHE)  # caches 16 tokens
    reference = seeded(llama, **kwargs, output_hidden_states=True)
    paged = seeded(llama, **kwargs, output_hidden_states=True, cache_implementation="paged", cache_config=CACHE)
    assert_same_scores(reference, paged)
    assert paged.past_key_values.stats().prefix_tokens_reused == 0
    for step_reference, step_paged in zip(reference.hidden_states, paged.hidden_states):
        for a, b in zip(step_reference, step_paged):
            assert a.shape == b.shape and (a - b).abs().max() <= TOLERANCE
    paged.past_key_values.release()


@pytest.mark.parametrize("attention", ["eager", "hf_paged"])
def test_hidden_states_at_left_pads_are_stock_under_eager_math(attention):
    """Eager attention spreads a pad query's weight over every key, pads included: the pad positions' hidden states
    depend on the pads' K/V, which a paged cache never stores. The new positions attend to the forward's own K/V,
    so every position, pads too, equals stock (before: the pad positions differed by up to ~3)."""
    model = tiny_model("llama", attn_implementation="eager")
    input_ids, attention_mask = left_padded_batch([5, 9, 3], seed=6)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=3, do_sample=False,
                  output_hidden_states=True, output_attentions=True)  # fmt: skip
    reference = seeded(model, **kwargs)
    options = {**CACHE, "attn_implementation": attention} if attention == "hf_paged" else CACHE
    paged = seeded(model, **kwargs, cache_implementation="paged", cache_config=options)
    assert_same_scores(reference, paged)
    for step_reference, step_paged in zip(reference.hidden_states, paged.hidden_states, strict=True):
        for a, b in zip(step_reference, step_paged, strict=True):
            assert a.shape == b.shape and (a - b).abs().max() <= TOLERANCE
    assert attentions_gap(reference, paged) <= TOLERANCE
    paged.past_key_values.release()


def test_hf_paged_attention_returns_weights_when_asked():
    """Asked for by name, the "hf_paged" attention computes the weights itself (reading K/V through the block
    tables) and they equal stock eager attention's, on a left-padded batch."""
    model = tiny_model("qwen2", attn_implementation="eager")
    input_ids, attention_mask = left_padded_batch([7, 3], seed=6)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
    reference = seeded(model, **kwargs, output_attentions=True)
    options = {**CACHE, "attn_implementation": "hf_paged"}
    paged = seeded(model, **kwargs, output_attentions=True, cache_implementation="paged", cache_config=options)
    assert_same_scores(reference, paged)
    # the padded positions are hidden in both; compare every position
    assert attentions_gap(reference, paged) <= TOLERANCE
    paged.past_key_values.release()


def test_sdpa_model_asked_for_attentions_behaves_as_stock(llama):
    """A model on SDPA cannot return weights; stock returns none (with transformers' warning), and so does the
    paged path, which keeps the model's attention for such a call."""
    prompt = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(7))
    kwargs = dict(input_ids=prompt, max_new_tokens=4, do_sample=False, output_attentions=True)
    reference = seeded(llama, **kwargs)
    paged = seeded(llama, **kwargs, cache_implementation="paged", cache_config=CACHE)
    assert_same_scores(reference, paged)
    assert [len(step) for step in paged.attentions] == [len(step) for step in reference.attentions]
    paged.past_key_values.release()


# ---------------------------------------------------------------------- images and embeddings
@pytest.fixture(scope="module")
def vision_model():
    return tiny_vision_language_model()


def image_prompt(length_before: int = 15) -> torch.Tensor:
    """A prompt whose image sits after several full blocks of text, as a chat template places it."""
    text = torch.randint(3, IMAGE_TOKEN_ID, (length_before,), generator=torch.Generator().manual_seed(8)).tolist()
    image = [IMAGE_TOKEN_ID + 1] + [IMAGE_TOKEN_ID] * TOKENS_PER_IMAGE + [IMAGE_TOKEN_ID + 2]
    return torch.tensor([[1, *text, *image, 20, 21, 22]])


def test_the_same_image_prompt_twice_runs_like_stock(vision_model):
    """Before the fix the second call crashed: the prefix cache served the image tokens' blocks, the prompt was
    sliced past them, and the model still received the pixels (`tokens: 0, features: 4`)."""
    input_ids = image_prompt()
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    kwargs = dict(input_ids=input_ids, pixel_values=pixels, max_new_tokens=8, do_sample=False)
    reference = seeded(vision_model, **kwargs)
    pool = get_pool(vision_model, **CACHE)
    for _ in range(2):
        paged = seeded(vision_model, **kwargs, cache_implementation="paged", cache_config=CACHE)
        assert_same_scores(reference, paged)
        assert paged.past_key_values.stats().prefix_tokens_reused == 0
        paged.past_key_values.release()
    assert pool.stats().num_cached == 0  # blocks holding image K/V are never indexed by token ids


def test_two_images_behind_the_same_token_ids_never_share_blocks(vision_model):
    """Two different images behind the same placeholder ids give what two stock calls give. The images do change
    the answer (the first assertion), so a block of one image served to the other would show."""
    input_ids = image_prompt()
    kwargs = dict(input_ids=input_ids, max_new_tokens=8, do_sample=False)
    images = [torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(seed)) for seed in (2, 3)]
    references = [seeded(vision_model, **kwargs, pixel_values=image) for image in images]
    assert not torch.equal(references[0].sequences, references[1].sequences)
    text_only = seeded(vision_model, **kwargs, cache_implementation="paged", cache_config=CACHE)
    text_only.past_key_values.release()  # its blocks are indexed by token ids (it saw no image)
    for image, reference in [*zip(images, references), (images[0], references[0])]:
        paged = seeded(vision_model, **kwargs, pixel_values=image, cache_implementation="paged", cache_config=CACHE)
        assert_same_scores(reference, paged)
        assert paged.past_key_values.stats().prefix_tokens_reused == 0
        paged.past_key_values.release()


def test_an_image_prompt_continued_on_a_user_cache_indexes_no_block(vision_model):
    """A `PagedCache` passed in and prompted with an image stops addressing its blocks by token ids."""
    input_ids = image_prompt()
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    kwargs = dict(input_ids=input_ids, pixel_values=pixels, max_new_tokens=6, do_sample=False)
    reference = seeded(vision_model, **kwargs)
    get_pool(vision_model, **CACHE).clear_prefix_cache()  # forget the blocks earlier tests indexed
    cache = PagedCache(vision_model, **CACHE)
    paged = seeded(vision_model, **kwargs, past_key_values=cache)
    assert_same_scores(reference, paged)
    assert not cache.prefix_caching
    assert get_pool(vision_model).stats().num_cached == 0
    cache.release()


PALIGEMMA_IMAGE_TOKEN = 200


def tiny_paligemma(text_model_type: str = "gemma"):
    """A random PaliGemma (`"gemma"`), or PaliGemma 2 (`"gemma2"`: its text model runs on eager attention), with a
    1-layer SigLIP tower on 16x16 images (4 image tokens)."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    config = PaliGemmaConfig(
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 16,
            "patch_size": 8,
        },
        text_config={
            "model_type": text_model_type,
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "pad_token_id": 0,
            "initializer_range": 0.2,  # weights large enough for the prefix's attention to change tokens
        },
        image_token_index=PALIGEMMA_IMAGE_TOKEN,
        projection_dim=64,
        hidden_size=64,
        vocab_size=256,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return PaliGemmaForConditionalGeneration(config).eval()


def test_paligemma_padded_image_prompts_keep_their_bidirectional_prefix():
    """PaliGemma attends bidirectionally over image and prefix only in its first forward, which it tells by
    `past_key_values.is_initialized`: a left-padded batch's cache holds rows (aligned before the first forward) but
    no token, so it is not initialized yet (it was: the prefix became causal, other tokens with no error)."""
    model = tiny_paligemma()
    image_token = PALIGEMMA_IMAGE_TOKEN
    generator = torch.Generator().manual_seed(0)
    rows = [
        [image_token] * 4 + [1] + torch.randint(10, 190, (n,), generator=generator).tolist() + [108] for n in (10, 4)
    ]
    width = max(map(len, rows))
    input_ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=(torch.arange(width)[None] >= torch.tensor([width - len(r) for r in rows])[:, None]).long(),
        token_type_ids=torch.zeros_like(input_ids),
        pixel_values=torch.randn(2, 3, 16, 16, generator=generator),
        max_new_tokens=6,
        do_sample=False,
    )
    reference = seeded(model, **kwargs)
    causal = seeded(model, **{k: v for k, v in kwargs.items() if k != "token_type_ids"})
    assert not torch.equal(reference.sequences, causal.sequences)  # the bidirectional prefix changes the tokens
    paged = seeded(model, **kwargs, cache_implementation="paged", cache_config=CACHE)
    assert_same_scores(reference, paged)
    paged.past_key_values.release()


def test_a_model_whose_sub_models_run_other_attentions_gets_each_back():
    """PaliGemma 2 runs its Gemma2 text model on eager attention and its vision tower on SDPA; a paged call switches
    them all, then restores each one (restoring the top-level "sdpa" everywhere raised after generating)."""
    model = tiny_paligemma("gemma2")
    before = (model.config._attn_implementation, model.config.text_config._attn_implementation)
    assert before == ("sdpa", "eager")
    kwargs = dict(input_ids=torch.randint(3, 190, (1, 7), generator=torch.Generator().manual_seed(3)), max_new_tokens=4)
    reference = seeded(model, **kwargs, do_sample=False)
    paged = seeded(model, **kwargs, do_sample=False, cache_implementation="paged", cache_config=CACHE)
    assert_same_scores(reference, paged)
    assert (model.config._attn_implementation, model.config.text_config._attn_implementation) == before
    assert model.model.language_model.layers[0].self_attn.config._attn_implementation == "eager"
    paged.past_key_values.release()


@pytest.mark.parametrize("mode", MODES)
def test_inputs_embeds_prompts_run_exactly_like_stock(llama, mode):
    input_ids, attention_mask = left_padded_batch([6, 10], seed=9)
    embeds = llama.get_input_embeddings()(input_ids).detach()
    kwargs = dict(inputs_embeds=embeds, attention_mask=attention_mask, max_new_tokens=8, **MODES[mode])
    pool = get_pool(llama, **CACHE)
    cached_before = pool.stats().num_cached
    reference = seeded(llama, **kwargs)
    paged = seeded(llama, **kwargs, cache_implementation="paged", cache_config=CACHE)
    assert_same_scores(reference, paged)
    paged.past_key_values.release()
    assert pool.stats().num_cached == cached_before


# ---------------------------------------------------------------------- the dense view of a layer
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
def test_layer_keys_and_values_equal_the_dynamic_cache_tensors(family):
    """`cache.layers[i].keys/.values` of a left-padded batch: the stock tensors (sliding layers: their last
    `W - 1` positions), with the left pads zero (never stored)."""
    model = tiny_model(family, **({"sliding_window": 6} if family == "mistral" else {}))
    input_ids, attention_mask = left_padded_batch([5, 11, 8], seed=1)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=7, do_sample=False)
    reference = seeded(model, **kwargs)
    paged = seeded(model, **kwargs, cache_implementation="paged", cache_config=CACHE)
    assert isinstance(reference.past_key_values, DynamicCache)
    pads = (attention_mask.cumsum(-1) == 0).sum(-1)
    length = paged.past_key_values.get_seq_length()
    for stock, layer in zip(reference.past_key_values.layers, paged.past_key_values.layers):
        keys, values = layer.keys, layer.values
        assert keys.shape == stock.keys.shape and values.shape == stock.values.shape
        first = length - keys.shape[2]
        stored = (torch.arange(first, length)[None, :] >= pads[:, None])[:, None, :, None]
        # a later layer's K/V follow the earlier layers' attention: the kernel's rounding (~1e-7) reaches them
        tolerance = SCORE_TOLERANCE if reads_in_place() else 1e-6
        assert (keys - stock.keys).where(stored, 0).abs().max() <= tolerance
        assert (values - stock.values).where(stored, 0).abs().max() <= tolerance
        assert not keys.where(stored, 0).eq(0).all()  # control: real positions hold K/V
        assert keys.where(~stored, 0).eq(0).all() and values.where(~stored, 0).eq(0).all()
    with pytest.raises(AttributeError, match="read-only view"):
        paged.past_key_values.layers[0].keys = torch.zeros(1)
    for (stock_keys, _, stock_window), (keys, _, window) in zip(reference.past_key_values, paged.past_key_values):
        assert keys.shape == stock_keys.shape and (window is None) == (stock_window is None)
        assert window is None or torch.equal(window, stock_window)
    assert len(list(paged.past_key_values)) == len(reference.past_key_values.layers)
    stock_lengths = [reference.past_key_values.get_max_length(i) for i in range(len(reference.past_key_values))]
    assert [paged.past_key_values.get_max_length(i) for i in range(len(paged.past_key_values))] == stock_lengths
    assert paged.past_key_values.get_max_length() == reference.past_key_values.get_max_length()
    paged.past_key_values.release()


def test_layer_view_of_an_empty_cache_is_none(llama):
    cache = PagedCache(llama, **CACHE)
    assert cache.layers[0].keys is None and cache.layers[1].values is None
    cache.release()


# ---------------------------------------------------------------------- weights changed in place
def prompts_sharing_blocks() -> dict:
    """Unpadded prompts of several full blocks: a second identical call is served from the prefix cache."""
    input_ids = torch.randint(3, 128, (2, 21), generator=torch.Generator().manual_seed(3))
    return dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=8, do_sample=False)


def paged_equals_stock(model) -> int:
    """Asserts a paged call equals `DynamicCache` now; returns the prompt tokens it took from the prefix cache."""
    kwargs = prompts_sharing_blocks()
    reference = seeded(model, **kwargs)
    paged = seeded(model, **kwargs, cache_implementation="paged", cache_config=CACHE)
    assert_same_scores(reference, paged)
    reused = paged.past_key_values.stats().prefix_tokens_reused
    paged.past_key_values.release()
    return reused


def test_weights_changed_in_place_never_meet_stale_blocks():
    """base generate -> PEFT LoRA -> `merge_and_unload()` (which writes `weight.data += delta`, unseen by the
    version counter) -> paged equals the merged model on `DynamicCache`; the same after a `.data` edit and after
    `load_state_dict`. Before the fix the merged and edited models were served the base model's blocks."""
    model = tiny_model("llama")
    paged_equals_stock(model)
    assert paged_equals_stock(model) == 2 * 20  # control: unchanged weights are served from the prefix cache
    lora = LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, lora)
    assert get_pool(peft_model) is get_pool(model)
    assert peft_model.merge_and_unload() is model
    assert paged_equals_stock(model) == 0
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight.data *= 1.5
    assert paged_equals_stock(model) == 0
    model.load_state_dict(copy.deepcopy(tiny_model("llama", seed=7).state_dict()))
    assert paged_equals_stock(model) == 0
    assert paged_equals_stock(model) == 2 * 20  # and the new weights' blocks are reused in turn


def test_a_peft_model_generates_on_its_base_models_pool():
    model = tiny_model("llama")
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    input_ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    peft_model.generate(input_ids=input_ids, max_new_tokens=4, pad_token_id=0, cache_implementation="paged")
    pool = get_pool(peft_model)
    assert pool is get_pool(model) and pool.last_cache_stats is not None
    assert pool.stats().num_used == 0
    hf_paged.release_pool(peft_model)
    assert get_pool(model) is not pool


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_peft_prompt_tuning_runs_like_stock_and_prefix_tuning_is_refused():
    """Prompt tuning prepends learned embeddings (`inputs_embeds`: prefix caching is off for it); prefix tuning
    builds its own cache of learned K/V, which a paged cache cannot hold (it was an `AttributeError` from inside
    PEFT)."""
    from peft import PrefixTuningConfig, PromptTuningConfig, TaskType

    prompt = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    options = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False, pad_token_id=0)
    prompt_tuned = get_peft_model(
        tiny_model("llama"), PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=5)
    ).eval()
    reference = prompt_tuned.generate(input_ids=prompt, **options)
    for _ in range(2):
        assert torch.equal(prompt_tuned.generate(input_ids=prompt, **options, cache_implementation="paged"), reference)
    prefix_tuned = get_peft_model(
        tiny_model("llama"), PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=5)
    ).eval()
    pool = get_pool(prefix_tuned, **CACHE)
    with pytest.raises(NotImplementedError, match="PEFT PREFIX_TUNING puts its learned K/V in the cache"):
        prefix_tuned.generate(input_ids=prompt, **options, cache_implementation="paged", cache_config=CACHE)
    assert pool.stats().num_used == 0
    with pytest.raises(NotImplementedError, match="Engine cannot serve a PEFT PREFIX_TUNING model"):
        hf_paged.Engine(prefix_tuned, exact=True)
    with pytest.raises(NotImplementedError, match="Engine cannot serve a PEFT PROMPT_TUNING model"):
        hf_paged.Engine(prompt_tuned, exact=True)


def test_generation_under_autocast_runs_like_stock():
    """Under `torch.autocast` a layer's keys come out in float32 (after RoPE) and its values in bfloat16: both are
    stored in float32 without loss (it was an `index_copy_` dtype error inside the cache and the packed attention)."""
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch([5, 9], seed=3)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False)
    prompts = [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = seeded(model, **kwargs)
        paged = seeded(model, **kwargs, cache_implementation="paged", cache_config=CACHE)
        paged.past_key_values.release()
        engine = hf_paged.Engine(model, **CACHE, exact=True)
        outputs = engine.generate(prompts, max_new_tokens=8, min_new_tokens=8)
    assert torch.equal(reference.sequences, paged.sequences)
    assert [o.token_ids for o in outputs] == reference.sequences[:, input_ids.shape[1] :].tolist()
    assert engine.pool.storage.values[0].dtype == torch.float32
    assert torch.equal(model.generate(**kwargs, cache_implementation="paged"), model.generate(**kwargs))
    engine.close()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_blocks_computed_under_autocast_never_serve_a_call_outside_it(family):
    """Autocast's dtype is in the prefix key, and an idle pool drops K/V stored in another dtype: a plain call after
    an autocast one reused its blocks (scores off by ~1e-3), and on GPT-2 (no RoPE: bfloat16 keys and values) it was
    refused ("holds torch.bfloat16")."""
    model = tiny_model(family)
    prompt = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    kwargs = dict(input_ids=prompt, max_new_tokens=8, do_sample=False, cache_config={"block_size": 8})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seeded(model, **kwargs, cache_implementation="paged").past_key_values.release()
    paged = seeded(model, **kwargs, cache_implementation="paged")
    assert paged.past_key_values.stats().prefix_tokens_reused == 0
    paged.past_key_values.release()
    del kwargs["cache_config"]
    assert_same_scores(seeded(model, **kwargs), paged)
    for a, b in zip(seeded(model, **kwargs).scores, paged.scores, strict=True):
        assert_scores_match(a, b)  # bitwise on the gather path; blocks reused from autocast were ~1e-3 off
