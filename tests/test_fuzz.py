"""Cache-level fuzz: random sequences of paged `generate` calls, each token-identical to `DynamicCache`.

Cases come from fixed seeds. They run in groups of ten on one pool (one model family and block size per group), so
later cases meet what earlier ones left behind: cached prefixes, evictable blocks, an LRU order. A case draws a
batch size, left-padded prompt lengths, greedy / sampling / beams, `num_return_sequences`, an EOS token that ends
rows early, prompt reuse (a prompt that starts like an earlier one, a fork of a prompt cache, a conversation
continued on the returned cache), and sometimes a nearly full pool: a foreign table holds all but the blocks the
case can need at most (plus 0 or 1), forcing evictions. After every case the pool's invariants hold and no block is
in use. `HF_PAGED_LONG_TESTS=1` runs ten times as many cases.
"""

from __future__ import annotations

import copy
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from transformers import DynamicCache

from hf_paged import PagedCache, PoolExhaustedError, get_pool, release_pool
from hf_paged.reference_models import tiny_model

from .conftest import LONG_TESTS

NUM_CASES = 2_000 if LONG_TESTS else 200
CASES_PER_GROUP = 10
NUM_BLOCKS = 300
VOCAB = 24  # a small vocabulary: EOS and repeated prompt blocks come up often
FAMILIES = [("llama", {}), ("mistral", {"sliding_window": 5}), ("gemma2", {})]
TINY = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB)


@dataclass
class Case:
    """One fuzz case, drawn from its seed."""

    seed: int
    kind: str  # "generate", "fork" or "continue"
    prompts: list[list[int]]
    max_new_tokens: int
    options: dict = field(default_factory=dict)  # decoding options passed to generate
    return_cache: bool = False
    tight_pool: int | None = None  # spare blocks above the case's worst need (< 0: it may run out of blocks)

    @property
    def num_rows(self) -> int:
        return len(self.prompts) * max(self.options.get("num_beams", 1), self.options.get("num_return_sequences", 1))


def draw_case(seed: int, history: list[list[int]]) -> Case:
    rng = random.Random(seed)
    kind = rng.choices(["generate", "fork", "continue"], weights=[6, 2, 2])[0]
    batch = rng.randint(1, 4)
    same_length = rng.random() < 0.3
    lengths = [rng.randint(1, 12)] * batch if same_length else [rng.randint(1, 12) for _ in range(batch)]
    if history and rng.random() < 0.5:  # prompts that start like an earlier one: prefix-cache hits
        earlier = rng.choice(history)
        lengths = [len(earlier) + n % 5 for n in lengths]
        prompts = [earlier + [rng.randrange(3, VOCAB) for _ in range(n - len(earlier))] for n in lengths]
    else:
        prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]
    options = {}
    decoding = rng.choice(["greedy", "sample", "beams", "sample n>1"] if kind == "generate" else ["greedy", "sample"])
    if decoding in ("sample", "sample n>1"):
        options.update(do_sample=True, top_k=rng.choice([0, 5]), temperature=rng.choice([0.7, 1.0, 1.5]))
    if decoding == "sample n>1":
        options["num_return_sequences"] = rng.randint(2, 3)
    if decoding == "beams":
        options["num_beams"] = rng.randint(2, 3)
        options["num_return_sequences"] = rng.randint(1, options["num_beams"])
        options["early_stopping"] = rng.choice([True, False])
        options["do_sample"] = rng.random() < 0.25
    if rng.random() < 0.35:
        options["eos_token_id"] = rng.randrange(3, VOCAB)
    case = Case(seed, kind, prompts, rng.randint(1, 10), options, return_cache=rng.random() < 0.3)
    if kind == "generate" and rng.random() < 0.3:
        case.tight_pool = rng.randint(-4, 1)
    return case


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


def worst_case_blocks(case: Case, block_size: int, num_groups: int) -> int:
    """Blocks the case can hold at once at most: every row alone, prompt and every new token stored, in each of
    the model's layer groups."""
    longest = max(len(p) for p in case.prompts) + case.max_new_tokens
    return case.num_rows * -(-longest // block_size) * num_groups


class Fuzzer:
    """Runs cases on one model and one pool; `seen` counts what they exercised."""

    def __init__(self, model, block_size: int, seen: Counter):
        self.model = model
        self.block_size = block_size
        self.config = {"block_size": block_size, "num_blocks": NUM_BLOCKS}
        self.pool = get_pool(model, **self.config)
        self.seen = seen

    def generate_pair(self, seed, paged_kwargs=None, reference_kwargs=None, **kwargs):
        kwargs = {"pad_token_id": 0, "return_dict_in_generate": True, "output_scores": True, **kwargs}
        torch.manual_seed(seed)
        reference = self.model.generate(**kwargs, **(reference_kwargs or {}))
        torch.manual_seed(seed)
        paged = self.model.generate(**kwargs, **(paged_kwargs or {}))
        assert torch.equal(reference.sequences, paged.sequences), (reference.sequences, paged.sequences)
        if "sequences_scores" in reference:
            torch.testing.assert_close(paged.sequences_scores, reference.sequences_scores, rtol=0, atol=1e-5)
        self.seen["early EOS"] += int(
            "eos_token_id" in kwargs and (paged.sequences[:, -1] == kwargs["pad_token_id"]).any().item()
        )
        return reference, paged

    def run(self, case: Case) -> None:
        stats_before = self.pool.stats()
        getattr(self, f"run_{case.kind}")(case)
        stats = self.pool.stats()
        self.seen[case.kind] += 1
        self.seen["prefix hits (tokens)"] += stats.prefix_tokens_reused - stats_before.prefix_tokens_reused
        self.seen["evictions"] += stats.evictions - stats_before.evictions
        self.seen["copy-on-write copies"] += stats.cow_copies - stats_before.cow_copies
        self.seen[f"block size {self.block_size}"] += 1
        self.pool.check_invariants()
        assert stats.num_used == 0, f"{stats.num_used} blocks still in use"

    def run_generate(self, case: Case) -> None:
        if case.tight_pool is None:
            self.generate_case(case)
            return
        hog = self.pool.allocator.new_table()  # all but the blocks the case can need (+ tight_pool) are taken
        spare = max(0, worst_case_blocks(case, self.block_size, self.pool.layout.num_groups) + case.tight_pool)
        self.pool.allocator.append(hog, max(0, NUM_BLOCKS - spare) * self.block_size)
        self.seen["nearly full pool"] += 1
        try:
            self.generate_case(case)
        except PoolExhaustedError:
            if case.tight_pool >= 0:
                raise  # the case fitted: running out is a bug
            self.seen["ran out of blocks"] += 1
            self.pool.check_invariants()
            assert self.pool.stats().num_used == len(hog.block_ids)  # the failed call returned every block
            self.pool.allocator.free(hog)
            self.generate_case(case)  # with the pool back, the same case is exact
        finally:
            if not hog.is_freed:
                self.pool.allocator.free(hog)

    def generate_case(self, case: Case) -> None:
        input_ids, attention_mask = left_pad(case.prompts)
        _, paged = self.generate_pair(
            case.seed,
            paged_kwargs={"cache_implementation": "paged", "cache_config": self.config},
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=case.max_new_tokens,
            **case.options,
        )
        if case.return_cache:
            assert isinstance(paged.past_key_values, PagedCache)
            self.pool.check_invariants()
            paged.past_key_values.release()
        self.seen["beams" if "num_beams" in case.options else "n > 1"] += "num_return_sequences" in case.options

    def run_fork(self, case: Case) -> None:
        """A prompt cache built once, forked for two continuations (DynamicCache: deep copies)."""
        rng = random.Random(case.seed)
        prefix = torch.tensor([case.prompts[0]] * len(case.prompts))
        prompt_cache = PagedCache(self.model, **self.config)
        dynamic = DynamicCache(config=self.model.config)
        with torch.no_grad():
            self.model(input_ids=prefix, past_key_values=prompt_cache)
            self.model(input_ids=prefix, past_key_values=dynamic)
        for branch in range(2):
            suffix = torch.randint(3, VOCAB, (len(case.prompts), rng.randint(1, 5)), generator=torch.Generator())
            fork = prompt_cache.fork()
            self.generate_pair(
                case.seed + branch,
                paged_kwargs={"past_key_values": fork},
                reference_kwargs={"past_key_values": copy.deepcopy(dynamic)},
                input_ids=torch.cat([prefix, suffix], dim=1),
                max_new_tokens=case.max_new_tokens,
                **case.options,
            )
            fork.release()
        prompt_cache.release()

    def run_continue(self, case: Case) -> None:
        """A conversation: the second call continues on the cache the first call returned."""
        input_ids, attention_mask = left_pad(case.prompts)
        reference, paged = self.generate_pair(
            case.seed,
            paged_kwargs={"cache_implementation": "paged", "cache_config": self.config},
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=case.max_new_tokens,
            **case.options,
        )
        follow = torch.cat([paged.sequences, torch.randint(3, VOCAB, (len(case.prompts), 3))], dim=1)
        mask = torch.cat([attention_mask, torch.ones_like(follow[:, attention_mask.shape[1] :])], dim=1)
        cache = paged.past_key_values
        self.generate_pair(
            case.seed + 1,
            paged_kwargs={"past_key_values": cache},
            reference_kwargs={"past_key_values": reference.past_key_values},
            input_ids=follow,
            attention_mask=mask,
            max_new_tokens=case.max_new_tokens,
            **case.options,
        )
        cache.release()


@pytest.mark.slow
def test_fuzz_paged_generate_against_dynamic_cache():
    seen = Counter()
    for group in range(NUM_CASES // CASES_PER_GROUP):
        family, options = FAMILIES[group % len(FAMILIES)]
        model = tiny_model(family, seed=group, **TINY, **options)
        fuzzer = Fuzzer(model, block_size=1 + group % 4, seen=seen)
        history = []
        for seed in range(group * CASES_PER_GROUP, (group + 1) * CASES_PER_GROUP):
            case = draw_case(seed, history)
            try:
                fuzzer.run(case)
            except BaseException as error:
                raise AssertionError(f"fuzz case failed ({family}, block_size={fuzzer.block_size}): {case}") from error
            history = [case.prompts[0]] + history[:5]
            seen["cases"] += 1
    print(f"fuzz: {dict(seen)}")
    assert seen["cases"] >= NUM_CASES
    for what in ("fork", "continue", "beams", "n > 1", "early EOS", "nearly full pool", "ran out of blocks",
                 "evictions", "prefix hits (tokens)", "copy-on-write copies"):  # fmt: skip
        assert seen[what] > 0, what


def test_negative_control_fuzz_catches_writes_into_shared_blocks():
    """Proves the fuzz can fail: with copy-on-write switched off, rows that share a partly filled block (beams,
    returned sequences, forks) overwrite each other's K/V, and some case soon differs from DynamicCache."""
    model = tiny_model("llama", **TINY)
    fuzzer = Fuzzer(model, block_size=4, seen=Counter())
    fuzzer.pool.allocator._needs_copy_on_write = lambda block_id: False  # rows write into the blocks they share
    try:
        with pytest.raises(AssertionError, match="tensor|Tensor"):
            for seed in range(40):
                fuzzer.run(draw_case(seed, []))
    finally:
        del fuzzer.pool.allocator._needs_copy_on_write
        release_pool(model)
