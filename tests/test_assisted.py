"""Assisted decoding (prompt lookup and an assistant model) on a paged cache: crop frees blocks, output exact."""

from __future__ import annotations

import pytest
import torch

from hf_paged import get_pool
from hf_paged.reference_models import tiny_model


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
