"""Assisted decoding (prompt lookup and an assistant model) on a paged cache: crop frees blocks, output exact."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_paged import PagedCache, get_pool
from hf_paged.reference_models import tiny_model

pytestmark = pytest.mark.kernel_matrix  # every test runs on the in-place kernel and on gather


@pytest.mark.parametrize("cached_prompt", [False, True], ids=["cold", "prompt-cached"])
def test_prompt_lookup_and_assistant_model_match_greedy(cached_prompt):
    model = tiny_model("llama")
    assistant = tiny_model("llama", seed=3, num_hidden_layers=1)
    prompt = torch.randint(3, 20, (1, 30))  # a small vocabulary: prompt lookup finds candidates
    options = dict(input_ids=prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
    greedy = model.generate(**options)
    if cached_prompt:  # assisted decoding prefills the whole prompt: a cached prefix must not be taken
        model.generate(**options, cache_implementation="paged", cache_config={"block_size": 4})
    lookup = model.generate(
        **options, prompt_lookup_num_tokens=3, cache_implementation="paged", cache_config={"block_size": 4}
    )
    assisted = model.generate(**options, assistant_model=assistant, cache_implementation="paged")
    assert torch.equal(greedy, lookup) and torch.equal(greedy, assisted)
    assert get_pool(model).stats().num_used == 0


def test_prompt_lookup_on_smollm2(smollm2):
    model, tokenizer = smollm2
    text = "List the days of the week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Again:"
    ids = tokenizer(text, return_tensors="pt")
    options = dict(**ids, max_new_tokens=24, do_sample=False)
    reference = model.generate(**options, prompt_lookup_num_tokens=4)
    paged = model.generate(**options, prompt_lookup_num_tokens=4, cache_implementation="paged")
    assert torch.equal(reference, paged)
    assert torch.equal(reference, model.generate(**options))
    assert get_pool(model).stats().num_used == 0


@contextmanager
def paged_assistant(assistant, block_size: int = 4):
    """Give the assistant model a paged cache of its own (through its generation config: transformers' assisted
    decoding passes the assistant no cache options)."""
    config = assistant.generation_config
    saved = config.cache_implementation, config.cache_config
    config.cache_implementation, config.cache_config = "paged", {"block_size": block_size}
    try:
        yield
    finally:
        config.cache_implementation, config.cache_config = saved


@pytest.mark.parametrize("main_cache", ["paged", "dynamic"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sample"])
def test_assistant_with_its_own_paged_cache_matches_dynamic_caches(main_cache, do_sample):
    """Stock transformers raises on the assistant's second call when the assistant's generation config names a cache
    implementation (it meets the cache its first call returned); hf_paged continues on that paged cache."""
    model = tiny_model("llama")
    assistant = tiny_model("llama", seed=3, num_hidden_layers=1)
    prompt = torch.randint(3, 20, (1, 30), generator=torch.Generator().manual_seed(1))
    options = dict(input_ids=prompt, max_new_tokens=20, do_sample=do_sample, pad_token_id=0, assistant_model=assistant)
    options.update(return_dict_in_generate=True, output_logits=True)
    torch.manual_seed(7)
    reference = model.generate(**options)
    paged_main = {"cache_implementation": "paged"} if main_cache == "paged" else {}
    torch.manual_seed(7)
    with paged_assistant(assistant):
        paged = model.generate(**options, **paged_main)
    assert torch.equal(reference.sequences, paged.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(reference.logits, paged.logits)) <= 1e-5
    if main_cache == "paged":
        paged.past_key_values.release()
    stats = get_pool(assistant).last_cache_stats  # the assistant's paged cache, released when generate returned
    assert stats is not None and stats.num_rows == 1 and stats.seq_length >= prompt.shape[1]
    assert stats.num_blocks == -(-stats.tokens_stored // 4)  # no block beyond the tokens it holds
    assert get_pool(assistant).stats().num_used == 0 and get_pool(model).stats().num_used == 0


def test_the_assistant_cache_is_released_when_generate_fails():
    model = tiny_model("llama")
    assistant = tiny_model("llama", seed=3, num_hidden_layers=1)

    class Explode(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if input_ids.shape[1] > 36:
                raise KeyError("boom")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    with paged_assistant(assistant), pytest.raises(KeyError, match="boom") as failure:
        model.generate(
            input_ids=torch.randint(3, 20, (1, 30)),
            max_new_tokens=20,
            do_sample=False,
            pad_token_id=0,
            assistant_model=assistant,
            stopping_criteria=StoppingCriteriaList([Explode()]),
            cache_implementation="paged",
        )
    assert failure.traceback  # the failed call's frames, and the candidate generator in them, are still alive
    assert get_pool(assistant).last_cache_stats is not None
    assert get_pool(assistant).stats().num_used == 0 and get_pool(model).stats().num_used == 0


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("method", ["prompt_lookup", "assistant_model"])
def test_crop_returns_every_block_it_empties(monkeypatch, method, block_size):
    """Every crop during assisted decoding leaves each cache exactly ceil(tokens / block_size) blocks (a block size
    of 1 makes each removed position one freed block), and the pool holds nothing else."""
    model = tiny_model("llama")
    assistant = tiny_model("llama", seed=3, num_hidden_layers=1)
    crops = []
    original_crop = PagedCache.crop

    def recording_crop(cache, max_length):
        pool = cache.pool
        before = pool.stats().num_used
        original_crop(cache, max_length)
        after = pool.stats().num_used
        tokens = cache.row_tables[0].num_tokens
        assert cache.get_seq_length() == tokens  # batch of one, no padding
        assert len(cache.row_tables[0].block_ids) == -(-tokens // block_size) == after  # nothing else in the pool
        crops.append((max_length, before - after))

    monkeypatch.setattr(PagedCache, "crop", recording_crop)
    extra = {"prompt_lookup_num_tokens": 3} if method == "prompt_lookup" else {"assistant_model": assistant}
    prompt = torch.randint(3, 12, (1, 24), generator=torch.Generator().manual_seed(5))
    options = dict(input_ids=prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    with paged_assistant(assistant, block_size):
        paged = model.generate(
            **options, **extra, cache_implementation="paged", cache_config={"block_size": block_size}
        )
    assert torch.equal(paged, model.generate(**options))
    assert any(removed < 0 for removed, _ in crops)  # candidates were rejected and cropped away
    if block_size == 1:
        assert all(freed == -removed for removed, freed in crops)
    assert any(freed > 0 for _, freed in crops)
    assert get_pool(model).stats().num_used == 0 and get_pool(assistant).stats().num_used == 0


def test_crop_of_a_fork_keeps_the_blocks_the_other_fork_holds():
    model = tiny_model("llama")
    cache = PagedCache(model, block_size=4, num_blocks=32)
    model(input_ids=torch.randint(3, 128, (1, 10)), past_key_values=cache)
    twin = cache.fork()
    pool = get_pool(model)
    assert pool.stats().num_used == 3
    twin.crop(-6)  # 4 tokens left: its last two blocks are still the original's
    assert len(twin.row_tables[0].block_ids) == 1 and pool.stats().num_used == 3
    cache.crop(-6)  # now nobody holds them
    assert pool.stats().num_used == 1
    twin.release()
    cache.release()
    assert pool.stats().num_used == 0
