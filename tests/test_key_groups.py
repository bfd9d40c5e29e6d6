"""Key groups: rows of very different lengths read their keys separately; the split is the cheapest one, and
attention over the groups equals attention over all rows padded to the longest."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_paged.kernels
from hf_paged import planner as planner_module
from hf_paged.batch import ForwardBatch, KeyGroup
from hf_paged.engine import Engine
from hf_paged.key_groups import GROUP_COST_BYTES, MIN_GROUP_COST, group_cost, split_by_length
from hf_paged.reference_models import tiny_model

from .conftest import left_padded_batch


@pytest.fixture(autouse=True)
def gather_kernel(monkeypatch):
    """Key groups split the gather path's reads (an in-place kernel reads each row's own length): these tests read
    through it."""
    monkeypatch.setattr(hf_paged.kernels, "DEFAULT_KERNEL", "gather")


def cost_of(groups: list[list[int]], lengths: list[int], cost: int) -> int:
    return sum(cost + len(rows) * max(lengths[r] for r in rows) for rows in groups)


def test_rows_of_similar_length_stay_together_and_far_apart_ones_split():
    assert split_by_length([300, 8, 290, 10], cost=64) == [[0, 2], [1, 3]]
    # 2 groups read 2 x 300 + 2 x 10 + 2 x 64 = 748 positions; one group 4 x 300 + 64 = 1264
    assert cost_of([[0, 2], [1, 3]], [300, 8, 290, 10], 64) == 748
    assert split_by_length([300, 8, 290, 10], cost=10_000) == [[0, 1, 2, 3]]
    assert split_by_length([7], cost=1) == [[0]]
    assert split_by_length([], cost=1) == []


def test_group_cost_is_a_byte_budget_in_key_positions():
    assert group_cost(1536) == GROUP_COST_BYTES // 1536  # SmolLM2: 3 KV heads x 64 dims x fp32, K and V
    assert group_cost(10**9) == MIN_GROUP_COST
    assert group_cost(None) == GROUP_COST_BYTES // 256


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 500), min_size=1, max_size=5), st.integers(1, 400))
def test_the_split_is_optimal_among_every_partition(lengths, cost):
    groups = split_by_length(lengths, cost)
    assert sorted(r for rows in groups for r in rows) == list(range(len(lengths)))
    best = cost_of(groups, lengths, cost)
    rows = list(range(len(lengths)))
    for labels in itertools.product(range(len(lengths)), repeat=len(lengths)):  # every partition (with repeats)
        parts = [[r for r in rows if labels[r] == k] for k in set(labels)]
        assert best <= cost_of(parts, lengths, cost)


# ---------------------------------------------------------------------- attention over key groups
LENGTHS = [3, 90, 5, 61, 4, 120, 33]


@pytest.fixture(scope="module", params=["llama", "mistral-window-16"])
def model(request):
    """A tiny Llama, and a tiny Mistral whose sliding window (16) is shorter than most rows (groups then start
    where the window does, and skipped blocks are given back while rows are read in groups)."""
    if request.param == "llama":
        return tiny_model("llama")
    return tiny_model("mistral", sliding_window=16, max_position_embeddings=1024)


@pytest.fixture
def every_length_its_own_group(monkeypatch):
    """Groups cost next to nothing (the tiny model's real cost, 512 positions, rarely splits), and every read
    through the tables is recorded: `(rows read, positions read)`."""
    monkeypatch.setattr(planner_module, "group_cost", lambda bytes_per_position: 1)
    reads = []
    read = ForwardBatch.read

    def recording_read(self, storage, layer_idx, rows=None, start=0, stop=None, new=None):
        keys, values = read(self, storage, layer_idx, rows, start, stop, new)
        reads.append((keys.shape[0], keys.shape[2], self.packed is not None))
        return keys, values

    monkeypatch.setattr(ForwardBatch, "read", recording_read)
    return reads


def prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in LENGTHS]


def test_engine_rows_read_in_key_groups_match_generate_alone(model, every_length_its_own_group):
    reads = every_length_its_own_group
    batch = prompts(model.config.vocab_size)
    engine = Engine(model, block_size=4, num_blocks=256, prefix_caching=False, exact=True)
    engine.add_request(batch[0], max_new_tokens=12)
    engine.step()  # the rest arrive while it decodes: mixed steps of one decode row and prompts
    outputs = engine.generate(batch[1:], max_new_tokens=12)
    for prompt, output in zip(batch[1:], outputs):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        assert output.token_ids == alone[0, len(prompt) :].tolist()
    # decode steps (right-aligned) and packed steps both read some rows apart, each up to its own length
    assert any(not packed and rows < len(LENGTHS) for rows, _, packed in reads)
    assert any(packed and rows < len(LENGTHS) for rows, _, packed in reads)
    assert min(length for _, length, _ in reads) < max(LENGTHS)
    engine.close()


def test_generate_rows_read_in_key_groups_match_dynamic_cache(model, every_length_its_own_group):
    input_ids, attention_mask = left_padded_batch(LENGTHS, model.config.vocab_size)
    options = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 10, "do_sample": False}
    reference = model.generate(**options, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    paged = model.generate(
        **options, pad_token_id=0, return_dict_in_generate=True, output_logits=True, cache_implementation="paged"
    )
    assert torch.equal(reference.sequences, paged.sequences)
    gap = max((a - b).abs().max().item() for a, b in zip(reference.logits, paged.logits))
    assert gap < 1e-4
    assert any(rows < len(LENGTHS) for rows, _, _ in every_length_its_own_group)  # decode steps split the rows
    paged.past_key_values.release()


def test_negative_control_a_group_reading_one_key_too_few_changes_outputs(llama, monkeypatch):
    monkeypatch.setattr(planner_module, "group_cost", lambda bytes_per_position: 1)
    key_groups = ForwardBatch.key_groups

    def short_by_one(self, cost):
        groups = key_groups(self, cost)
        return groups and [KeyGroup(group.rows, group.start + 1) for group in groups]

    monkeypatch.setattr(ForwardBatch, "key_groups", short_by_one)
    input_ids, attention_mask = left_padded_batch(LENGTHS, llama.config.vocab_size)
    options = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 10, "do_sample": False}
    reference = llama.generate(**options, pad_token_id=0)
    paged = llama.generate(**options, pad_token_id=0, cache_implementation="paged")
    assert not torch.equal(reference, paged)
