"""examples/finetune_then_serve.py end to end on a tiny Llama: LoRA training lowers the loss, also right after a
paged `generate`; the merged model is saved as safetensors; the reloaded model generates on a paged cache exactly
what it generates on `DynamicCache`, and gives every block back."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import hf_paged

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "finetune_then_serve.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("finetune_then_serve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def report(script, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("finetuned")
    return script.main(["--tiny", "--steps", "30", "--seed", "0", "--output-dir", str(output_dir)])


@pytest.fixture(scope="module")
def reloaded(report):
    model = AutoModelForCausalLM.from_pretrained(report.output_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(report.output_dir, padding_side="left")
    return model, tokenizer


def held_out_batch(script, tokenizer, report):
    prompts = [script.chat_prompt(tokenizer, example.instruction) for example in report.held_out]
    return tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)


def test_training_lowers_the_loss(report):
    assert len(report.step_losses) == 30
    assert all(math.isfinite(loss) for loss in report.step_losses)
    assert report.loss_after < report.loss_before - 0.3, (report.loss_before, report.loss_after)
    first, last = report.step_losses[:5], report.step_losses[-5:]
    assert sum(last) / 5 < sum(first) / 5


def test_paged_generate_restores_the_attention_before_training(report):
    assert report.attention_before_generate == report.attention_after_generate == "sdpa"


def loss_and_gradients(model, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.train()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def same_step(a: tuple[torch.Tensor, list[torch.Tensor]], b: tuple[torch.Tensor, list[torch.Tensor]]) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.fixture
def lora_pair(script):
    """Two identical LoRA-wrapped tiny models; the second has answered a prompt with paged generation."""
    base, tokenizer = script.load_base_model(tiny=True, seed=0)
    train_set, held_out = script.build_examples(seed=0)
    fresh = script.add_lora(base)
    used = copy.deepcopy(fresh)
    script.paged_answers(used, tokenizer, [held_out[0].instruction], max_new_tokens=8)
    assert hf_paged.get_pool(used.get_base_model()).stats().num_used == 0
    return fresh, used, script.encode_batch(tokenizer, train_set[:8])


def test_a_training_step_after_paged_generate_matches_one_without(lora_pair):
    """Paged generation leaves nothing behind that changes a training step (attention, hooks, mask functions)."""
    fresh, used, batch = lora_pair
    step = loss_and_gradients(used, batch)
    assert same_step(loss_and_gradients(fresh, batch), step)
    assert any(g.abs().sum() > 0 for g in step[1])


def test_a_model_left_on_another_attention_trains_differently(lora_pair):
    """Negative control for the test above: the comparison sees an attention implementation left switched."""
    fresh, used, batch = lora_pair
    used.get_base_model().set_attn_implementation("eager")
    assert not same_step(loss_and_gradients(fresh, batch), loss_and_gradients(used, batch))


def test_the_merged_model_is_saved_as_safetensors(report):
    names = {path.name for path in report.output_dir.iterdir()}
    assert any(name.endswith(".safetensors") for name in names), names
    assert "adapter_config.json" not in names  # merged into the weights, not saved as an adapter
    config = json.loads((report.output_dir / "config.json").read_text())
    assert "hf_paged" not in json.dumps(config)


def test_reloaded_model_generates_the_same_on_paged_and_dynamic_cache(script, report, reloaded):
    model, tokenizer = reloaded
    inputs = held_out_batch(script, tokenizer, report)
    assert (inputs["attention_mask"] == 0).any()  # a left-padded batch
    options = dict(max_new_tokens=32, do_sample=False)
    paged = model.generate(**inputs, **options, cache_implementation="paged")
    dynamic = model.generate(**inputs, **options, past_key_values=DynamicCache(config=model.config))
    assert torch.equal(paged, dynamic)
    answers = tokenizer.batch_decode(paged[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answers == report.served.answers
    assert hf_paged.get_pool(model).stats().num_used == 0


def test_the_engine_serves_the_same_answers(report):
    """The continuous-batching Engine (what `hf-paged serve` runs) answers exactly like the paged batch."""
    assert report.served.engine_answers == report.served.answers
    assert report.served.engine_stats.num_requests == len(report.served.answers)


def test_the_saved_weights_hold_the_fine_tuning(script, report, reloaded):
    """Negative control for the comparison above: the base model answers differently, so equal outputs are
    evidence, not an accident of the prompts."""
    model, tokenizer = reloaded
    base, _ = script.load_base_model(tiny=True, seed=0)
    inputs = held_out_batch(script, tokenizer, report)
    options = dict(max_new_tokens=32, do_sample=False, cache_implementation="paged")
    assert not torch.equal(base.generate(**inputs, **options), model.generate(**inputs, **options))
    tuned = dict(model.named_parameters())
    changed = [name for name, weight in base.named_parameters() if not torch.equal(weight, tuned[name])]
    adapted = [name for name, _ in base.named_parameters() if name.split(".")[-2] in script.ATTENTION_PROJECTIONS]
    assert changed == adapted  # the merge changed exactly the layers that carried the adapter


def test_serving_leaves_no_block_in_use(report):
    assert report.served.pool_stats.num_used == 0
    assert report.served.pool_stats.peak_used > 0
    assert report.served.cache_stats.num_rows == len(report.held_out)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--max-new-tokens", "-2"], "--max-new-tokens must be at least 1, got -2"),
        (["--lr", "0"], "--lr must be positive, got 0.0"),
        (["--batch-size", "49"], "--batch-size must be at most 48 (the training examples), got 49"),
    ],
)
def test_bad_arguments_are_refused(script, capsys, argv, message):
    with pytest.raises(SystemExit):
        script.main(["--tiny", *argv])
    assert message in capsys.readouterr().err
