"""Linear layers packed for oneDNN (`hf_paged.cpu_linear`, `Engine(cpu_linear="onednn")`): close to stock, exact
against `DynamicCache` on the same packed model, never stale, never in the way of training."""

import pytest
import torch

import hf_paged
from hf_paged.cpu_linear import onednn_available, pack_linears, packable, packed_linears, unpack_linears
from hf_paged.reference_models import tiny_model

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN CPU matmul")

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [3] * 21]


def linear_count(model) -> int:
    return sum(type(m) is torch.nn.Linear for m in model.modules())


@pytest.fixture
def model():
    model = tiny_model("llama")
    yield model
    unpack_linears(model)


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_packed_layers_match_stock_within_float_rounding(model):
    ids = torch.tensor([PROMPTS[1]])
    stock = logits(model, ids)
    assert pack_linears(model) == linear_count(model) == packed_linears(model)
    packed = logits(model, ids)
    assert torch.allclose(packed, stock, rtol=1e-5, atol=1e-5)
    assert pack_linears(model) == linear_count(model)  # packing twice changes nothing
    assert unpack_linears(model) == linear_count(model) and packed_linears(model) == 0
    assert torch.equal(logits(model, ids), stock)  # unpacked: stock again, bit for bit


def test_paged_generation_is_exact_against_dynamic_cache_on_the_packed_model(model):
    pack_linears(model)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        dynamic = model.generate(ids, max_new_tokens=12, do_sample=False)
        paged = model.generate(ids, max_new_tokens=12, do_sample=False, cache_implementation="paged")
        assert torch.equal(paged, dynamic)


def test_engine_packs_on_request_and_unpacks_on_close(model):
    with hf_paged.Engine(model, block_size=4, num_blocks=64, cpu_linear="onednn") as engine:
        assert engine.cpu_linear == "onednn" and packed_linears(model) == linear_count(model)
        outputs = engine.generate(PROMPTS, max_new_tokens=12)
        expected = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :] for p in PROMPTS]
        assert [o.token_ids for o in outputs] == [e.tolist() for e in expected]
    assert packed_linears(model) == 0
    with hf_paged.Engine(model, block_size=4, num_blocks=64, exact=True) as engine:  # the default: stock layers
        assert engine.cpu_linear == "stock" and packed_linears(model) == 0


def test_an_engine_leaves_layers_packed_by_someone_else_packed(model):
    pack_linears(model)
    hf_paged.Engine(model, block_size=4, num_blocks=64, cpu_linear="onednn").close()
    assert packed_linears(model) == linear_count(model)


def test_a_weight_changed_in_place_or_replaced_is_packed_again(model):
    ids = torch.tensor([PROMPTS[1]])
    pack_linears(model)
    before = logits(model, ids)
    layer = model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        layer.weight.mul_(3.0)  # an optimizer step, a merged adapter
    changed = logits(model, ids)
    unpack_linears(model)
    stock_changed = logits(model, ids)
    assert not torch.allclose(changed, before, atol=1e-3)  # a stale packed weight would have kept `before`
    assert torch.allclose(changed, stock_changed, rtol=1e-5, atol=1e-5)
    pack_linears(model)
    layer.weight = torch.nn.Parameter(torch.zeros_like(layer.weight))  # replaced
    replaced = logits(model, ids)
    unpack_linears(model)
    assert torch.allclose(replaced, logits(model, ids), rtol=1e-5, atol=1e-5)


def test_training_uses_stock_layers_and_gets_gradients(model):
    ids = torch.tensor([PROMPTS[1]])
    model.train()
    stock_loss = model(ids, labels=ids).loss
    stock_loss.backward()
    stock_grad = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
    model.zero_grad()
    pack_linears(model)
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.equal(loss, stock_loss)
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight.grad, stock_grad)


def test_only_stock_cpu_linears_of_packed_dtypes_are_packed():
    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    assert packable(torch.nn.Linear(4, 4)) and packable(torch.nn.Linear(4, 4, dtype=torch.bfloat16))
    assert not packable(Scaled(4, 4))  # a subclass computes otherwise
    assert not packable(torch.nn.Linear(4, 4, dtype=torch.float16))
    assert not packable(torch.nn.Linear(4, 4, device="meta"))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Scaled(4, 4))
    x = torch.randn(2, 4)
    with torch.no_grad():
        stock = model(x)
        assert pack_linears(model) == 1
        assert torch.allclose(model(x), stock, atol=1e-6)


def test_bad_cpu_linear_is_refused_before_anything_is_built(model):
    with pytest.raises(ValueError, match=r"cpu_linear must be one of \['stock', 'onednn'\], got 'mkl'"):
        hf_paged.Engine(model, cpu_linear="mkl")
    on_meta = tiny_model("llama").to("meta")
    with pytest.raises(ValueError, match="cpu_linear='onednn' packs CPU weights, but the model is on meta"):
        hf_paged.Engine(on_meta, cpu_linear="onednn")
    assert packed_linears(on_meta) == 0


def test_smollm2_engine_with_packed_layers_matches_generate_on_them(smollm2):
    model, tokenizer = smollm2
    prompts = [tokenizer(text).input_ids for text in ("The capital of France is", "def fibonacci(n):")]
    with hf_paged.Engine(model, tokenizer, cpu_linear="onednn") as engine:
        outputs = engine.generate(prompts, max_new_tokens=16)
        expected = [model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p) :] for p in prompts]
        assert [o.token_ids for o in outputs] == [e.tolist() for e in expected]
    assert packed_linears(model) == 0
