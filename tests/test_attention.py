"""The hf_paged attention math: GQA from shapes, soft-capping, sinks and masks, against plain references."""

from __future__ import annotations

import pytest
import torch

from hf_paged.attention import _causal_mask, eager_paged_attention, paged_attention_forward


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
