"""The exactness statement (docs/exactness.md) and the behaviour it states: with quantized pages, a prompt's answer
can depend on what ran before it (full blocks another call computed in a batch of another shape, served by the
prefix cache, hold other codes), and `prefix_caching=False` makes the answer a function of the call alone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import hf_paged
from hf_paged.reference_models import tiny_model
from tests.exactness import SCORE_TOLERANCE

ROOT = Path(__file__).resolve().parent.parent
EXACTNESS = ROOT / "docs" / "exactness.md"
BLOCK = 4
SYSTEM_LENGTH = 40  # ten full blocks shared by every prompt
CLAIM = "same quantized values"
QUALIFIED = re.compile(r"exactness\.md|computed alike")


@pytest.fixture(scope="module")
def bf16_llama():
    """A tiny Llama in bfloat16: a batch of another shape moves its K/V by a bfloat16 rounding step, enough to move
    int4 codes (in fp32 a tiny model's K/V move by ~1e-7 and its codes stay put)."""
    return tiny_model("llama").to(torch.bfloat16)


def chat_like_prompts(count: int = 4) -> list[torch.Tensor]:
    """`count` prompts (`[1, length]`): one shared 40-token "system prompt", then a suffix of its own each."""
    generator = torch.Generator().manual_seed(7)
    system = torch.randint(3, 128, (1, SYSTEM_LENGTH), generator=generator)
    return [torch.cat([system, torch.randint(3, 128, (1, 3 + 2 * i), generator=generator)], 1) for i in range(count)]


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(p.shape[1] for p in prompts)
    ids, mask = torch.zeros(len(prompts), width, dtype=torch.long), torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.shape[1] :], mask[row, width - prompt.shape[1] :] = prompt[0], 1
    return ids, mask


def answer(model, ids, mask=None, **cache_config):
    """Greedy paged `generate` (blocks of 4) keeping its cache: `(sequences, logits [steps, batch, vocab], cache)`."""
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids) if mask is None else mask,
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="paged",
        cache_config={"block_size": BLOCK, **cache_config},
        return_dict_in_generate=True,
        output_logits=True,
    )
    return out.sequences, torch.stack(out.logits).float(), out.past_key_values


def stored_system_prompt(cache, row: int) -> torch.Tensor:
    """Row `row`'s shared system-prompt blocks as the pool stores them: every layer's K and V (or codes and scales),
    flattened to one vector per token."""
    storage = cache.pool.storage
    blocks = torch.tensor(cache.row_tables[row].block_ids[: SYSTEM_LENGTH // BLOCK])
    parts = []
    for lane in sorted(storage.keys):
        tensors = [storage.keys, storage.values]
        if storage.format.quantized:
            tensors += [storage.key_scales, storage.value_scales]
        parts += [t[lane][blocks].float().reshape(SYSTEM_LENGTH, -1) for t in tensors]
    return torch.cat(parts, 1)


def fresh_then_batched(model, kv_dtype: str):
    """Prompt 0 answered alone in a fresh pool, then all prompts in one left-padded batch: the stored system prompt
    of each, and prompt 0's fresh sequences and logits."""
    prompts = chat_like_prompts()
    hf_paged.release_pool(model)
    sequences, logits, cache = answer(model, prompts[0], kv_dtype=kv_dtype)
    alone = stored_system_prompt(cache, 0)
    cache.release()
    hf_paged.get_pool(model).clear_prefix_cache()
    _, _, cache = answer(model, *left_padded(prompts), kv_dtype=kv_dtype)
    batched = stored_system_prompt(cache, 0)
    cache.release()
    return prompts, alone, batched, sequences, logits


@pytest.fixture(scope="module")
def batch_moves_k_v(bf16_llama) -> bool:
    """Whether this machine computes the batched call's K/V (unquantized bf16 pages) other than a single row's:
    the float rounding that quantized codes can then turn into a different step."""
    _, alone, batched, _, _ = fresh_then_batched(bf16_llama, "auto")
    assert (alone - batched).abs().max() <= 0.05 * alone.abs().max()  # rounding, not another computation
    return not torch.equal(alone, batched)


def needs_moved_k_v(moved: bool) -> None:
    if not moved:
        pytest.skip("this machine computed the batch's rows bitwise like a single row: no history to show")


# ---------------------------------------------------------------------- the behaviour
def test_int4_prefix_cached_by_a_batched_call_holds_other_codes_and_changes_the_later_answer(
    bf16_llama, batch_moves_k_v
):
    needs_moved_k_v(batch_moves_k_v)
    prompts, alone, batched, sequences, logits = fresh_then_batched(bf16_llama, "int4")
    assert (alone != batched).any(1).sum() > 0  # the same tokens at the same positions, other int4 codes or scales
    _, after_logits, cache = answer(bf16_llama, prompts[0], kv_dtype="int4")  # served the batched call's blocks
    cache.release()
    assert hf_paged.get_pool(bf16_llama).last_cache_stats.prefix_tokens_reused == SYSTEM_LENGTH
    assert not torch.equal(after_logits, logits)  # what ran before changed this answer's logits


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "int4"])
def test_without_prefix_caching_the_answer_after_a_batched_call_equals_a_fresh_pools(bf16_llama, kv_dtype):
    prompts, _, _, sequences, logits = fresh_then_batched(bf16_llama, kv_dtype)
    answer(bf16_llama, prompts[1], kv_dtype=kv_dtype)[2].release()  # more history: another prompt alone
    again, again_logits, cache = answer(bf16_llama, prompts[0], kv_dtype=kv_dtype, prefix_caching=False)
    cache.release()
    assert hf_paged.get_pool(bf16_llama).last_cache_stats.prefix_tokens_reused == 0
    assert torch.equal(again, sequences)
    assert torch.equal(again_logits, logits)  # bitwise: nothing of what ran before reached this call


def test_a_negative_control_with_prefix_caching_the_same_comparison_sees_the_history(bf16_llama, batch_moves_k_v):
    """The bitwise comparison above can fail: with prefix caching on, the answer after the batched call is served
    the batched call's blocks, and its logits are not a fresh pool's."""
    needs_moved_k_v(batch_moves_k_v)
    prompts, _, _, _, logits = fresh_then_batched(bf16_llama, "auto")
    _, after_logits, cache = answer(bf16_llama, prompts[0])
    cache.release()
    assert hf_paged.get_pool(bf16_llama).last_cache_stats.prefix_tokens_reused == SYSTEM_LENGTH
    assert not torch.equal(after_logits, logits)


def test_fp32_pages_reuse_k_v_another_batch_computed_and_stay_within_rounding():
    """fp32: the blocks a batched call cached differ from a single row's by float rounding only, and the answer
    served them keeps the fresh answer's tokens, its logits within the kernels' tolerance."""
    model = tiny_model("llama")
    prompts, alone, batched, sequences, logits = fresh_then_batched(model, "auto")
    assert (alone - batched).abs().max() < 1e-5
    again, again_logits, cache = answer(model, prompts[0])
    cache.release()
    assert hf_paged.get_pool(model).last_cache_stats.prefix_tokens_reused == SYSTEM_LENGTH
    assert torch.equal(again, sequences)
    torch.testing.assert_close(again_logits, logits, rtol=0, atol=SCORE_TOLERANCE)


# ---------------------------------------------------------------------- the statement
def paragraphs(path: Path) -> list[str]:
    return re.split(r"\n\s*\n", path.read_text())


def documents() -> list[Path]:
    """Every page and module docstring that could state an exactness claim."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "hf_paged").rglob("*.py"))]


def unqualified_claims(paths: list[Path]) -> list[str]:
    """Paragraphs that say "same quantized values" without the condition it needs ("computed alike") or a link to
    the statement (docs/exactness.md)."""
    return [
        f"{path.name}: {paragraph.strip()[:120]}..."
        for path in paths
        for paragraph in paragraphs(path)
        if CLAIM in " ".join(paragraph.split()) and not QUALIFIED.search(" ".join(paragraph.split()))
    ]


def test_the_exactness_statement_covers_every_precision_and_prefix_reuse():
    text = EXACTNESS.read_text()
    flat = " ".join(text.split())
    for topic in ("fp32", "bf16", "int8", "int4", "prefix cach", "DynamicCache", "cpu_linear"):
        assert topic in flat, topic
    assert re.search(r"""prefix_caching["']?\s*[:=]\s*False""", flat)  # how to get history-independent answers
    assert "benchmarks/exactness.py" in flat and "benchmarks.md#exactness" in flat  # the numbers and the command
    heading = "## Exactness: bf16 against fp32, and answers after a cached prefix"
    assert heading in (ROOT / "docs" / "benchmarks.md").read_text()


def test_no_doc_claims_the_same_quantized_values_without_the_qualification():
    assert unqualified_claims(documents()) == []


def test_a_negative_control_the_unqualified_claim_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Token-identical to stock over the same quantized values.\n\n"
        "Token-identical to stock over the same\nquantized values when computed alike ([exactness](exactness.md)).\n"
    )
    assert len(unqualified_claims([page])) == 1


def test_readme_links_the_exactness_statement():
    assert "docs/exactness.md" in (ROOT / "README.md").read_text()
