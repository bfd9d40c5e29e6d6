"""The flash-attn backend's calls, checked on the CPU: the exact arguments it passes to `flash_attn_with_kvcache` and
`flash_attn_varlen_func`, run through a reference of flash-attn's documented semantics for those arguments, equal
the gather reference; deliberately wrong mappings fail the same check (negative controls). The call itself, and the
block-size and device rules, on a device (`gpu`)."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_paged import kernels
from hf_paged.kernels import flash
from hf_paged.kernels import triton as triton_backend
from hf_paged.kernels.reference import gather_paged_attention

from .test_kernels import random_call

TOLERANCE = 1e-5  # fp32


# ---------------------------------------------------------------------- flash-attn's semantics, as documented
def _check_paged_cache(k_cache, v_cache, block_table, batch):
    num_blocks, page_block_size, nheads_k, headdim = k_cache.shape
    assert v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
    assert page_block_size % 256 == 0, "flash-attn 2: page_block_size must be a multiple of 256"
    assert block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == batch
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "contiguous last dimension"


def _attend(q, k_cache, v_cache, table, seqlen_k, softmax_scale, causal, window_size, softcap):
    """One sequence: `q` `[seqlen_q, nheads, d]` over the first `seqlen_k` keys of its pages, as flash-attn's
    docstrings say: GQA head h reads KV head h // (nheads // nheads_k); causal and windows aligned bottom-right
    (query i sees keys [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right], -1 = unbounded, causal
    bounds the right at i + seqlen_k - seqlen_q); softcap: scores (already scaled) become softcap * tanh(s /
    softcap); a query row seeing no key outputs zeros."""
    seqlen_q, nheads, _ = q.shape
    page = k_cache.shape[1]
    positions = torch.arange(seqlen_k)
    slots = table.long()[positions // page] * page + positions % page
    keys = k_cache.flatten(0, 1)[slots]  # [seqlen_k, nheads_k, d]
    values = v_cache.flatten(0, 1)[slots]
    group = nheads // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys.float()) * softmax_scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(seqlen_q)[:, None]
    j = torch.arange(seqlen_k)[None, :]
    diagonal = i + seqlen_k - seqlen_q
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    left, right = window_size
    if causal:
        allowed &= j <= diagonal
    if left >= 0:
        allowed &= j >= diagonal - left
    if right >= 0:
        allowed &= j <= diagonal + right
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an all-masked row: zeros
    return torch.einsum("hqk,khd->qhd", probs, values.float()).to(q.dtype)


def reference_flash_attn_with_kvcache(
    q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal, window_size, softcap
):
    """`flash_attn_with_kvcache` with a paged cache and no new `k`/`v`: `q` `[batch, seqlen, nheads, headdim]`,
    `cache_seqlens` int32 `[batch]`: the keys each sequence attends to."""
    batch, seqlen_q, nheads, headdim = q.shape
    _check_paged_cache(k_cache, v_cache, block_table, batch)
    assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (batch,)
    assert nheads % k_cache.shape[2] == 0 and headdim == k_cache.shape[3]
    outs = [
        _attend(q[b], k_cache, v_cache, block_table[b], int(cache_seqlens[b]), softmax_scale, causal, window_size,
                softcap)
        for b in range(batch)
    ]  # fmt: skip
    return torch.stack(outs)


def reference_flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap,
    block_table,
):  # fmt: skip
    """`flash_attn_varlen_func` with `block_table` (`k`, `v` the paged caches): `q` `[total_q, nheads, headdim]`,
    sequence b's queries `q[cu_seqlens_q[b] : cu_seqlens_q[b + 1]]`, its key count `cu_seqlens_k[b + 1] -
    cu_seqlens_k[b]`; `max_seqlen_*` bound every sequence's lengths."""
    batch = cu_seqlens_q.numel() - 1
    _check_paged_cache(k, v, block_table, batch)
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    assert cu_seqlens_k.shape == (batch + 1,) and int(cu_seqlens_q[-1]) == q.shape[0]
    assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
    out = torch.empty_like(q)
    for b in range(batch):
        start, stop = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        seqlen_k = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        assert stop - start <= max_seqlen_q and seqlen_k <= max_seqlen_k
        assert seqlen_k <= block_table.shape[1] * k.shape[1]
        out[start:stop] = _attend(
            q[start:stop], k, v, block_table[b], seqlen_k, softmax_scale, causal, window_size, softcap
        )
    return out


# ---------------------------------------------------------------------- our arguments against it
CASES = [  # (lengths, query counts, group, window, softcap)
    ([300, 5, 513], [1, 1, 1], 2, None, None),
    ([300, 5, 513], [1, 1, 1], 4, 7, None),
    ([257, 600], [1, 1], 1, 256, 5.0),  # a window crossing a block edge
    ([40, 300, 270], [40, 17, 1], 2, None, None),  # a whole prompt, a chunk, a decode
    ([40, 300, 270], [40, 17, 1], 4, 33, 5.0),
    ([512, 3], [9, 3], 8, 1, None),
]


def flash_call(case, seed=0):
    lengths, counts, group, window, softcap = case
    call = random_call(seed, lengths, counts, kv_heads=2, group=group, head_dim=64, block_size=256, shared_prefix=256)
    return call, window, softcap


def flash_error(call, window, softcap, corrupt=lambda arguments, call: None) -> float:
    """Max error of flash-attn's semantics over our arguments (`corrupt` edits them first: negative controls)."""
    query, key_cache, value_cache, tables, lengths, starts = call
    scale = query.shape[-1] ** -0.5
    if flash.is_decode(query, lengths):
        arguments = flash.decode_arguments(query, key_cache, value_cache, tables, lengths, scale, window, softcap)
        corrupt(arguments, call)
        out = reference_flash_attn_with_kvcache(**arguments).view_as(query)
    else:
        arguments = flash.varlen_arguments(
            query, key_cache, value_cache, tables, lengths, starts, scale, window, softcap
        )
        corrupt(arguments, call)
        out = reference_flash_attn_varlen_func(**arguments)
    want = gather_paged_attention(query, key_cache, value_cache, tables, lengths, starts, scale, window, softcap)
    return (out - want).abs().max().item()


@pytest.mark.parametrize("case", CASES)
def test_flash_attn_arguments_attend_as_the_reference(case):
    assert flash_error(*flash_call(case)) <= TOLERANCE


def test_decode_steps_call_with_kvcache_and_the_rest_varlen():
    decode, _, _ = flash_call(CASES[0])
    mixed, _, _ = flash_call(CASES[3])
    assert flash.is_decode(decode[0], decode[4]) and not flash.is_decode(mixed[0], mixed[4])
    arguments = flash.decode_arguments(*decode[:5], scale=0.125, window=7)
    assert arguments["q"].shape == (3, 1, 4, 64) and arguments["window_size"] == (6, 0)
    assert arguments["cache_seqlens"].tolist() == [300, 5, 513]  # the new tokens included: already in the blocks
    arguments = flash.varlen_arguments(*mixed[:6], scale=0.125)
    assert arguments["cu_seqlens_k"].tolist() == [0, 40, 340, 610] and arguments["window_size"] == (-1, -1)
    assert arguments["max_seqlen_q"] == 58 and arguments["max_seqlen_k"] == mixed[3].shape[1] * 256


# negative controls: each wrong mapping fails the check above on the cases it concerns
def window_off_by_one(arguments, call):
    left, right = arguments["window_size"]
    arguments["window_size"] = (left + 1, right)


def seqlens_without_the_new_tokens(arguments, call):
    query, _, _, _, lengths, starts = call
    excluded = lengths - (starts[1:] - starts[:-1])
    if "cache_seqlens" in arguments:
        arguments["cache_seqlens"] = excluded.to(torch.int32)
    else:
        arguments["cu_seqlens_k"][1:] = excluded.cumsum(0).to(torch.int32)


def not_causal(arguments, call):
    arguments["causal"] = False


def softcap_unset(arguments, call):
    arguments["softcap"] = 0.0


@pytest.mark.parametrize(
    "corrupt,case",
    [
        (window_off_by_one, CASES[1]),
        (window_off_by_one, CASES[4]),
        (seqlens_without_the_new_tokens, CASES[0]),
        (seqlens_without_the_new_tokens, CASES[3]),
        (not_causal, CASES[3]),
        (softcap_unset, CASES[2]),
    ],
)
def test_negative_control_a_wrong_mapping_fails_the_check(corrupt, case):
    call, window, softcap = flash_call(case)
    assert flash_error(call, window, softcap) <= TOLERANCE
    assert flash_error(call, window, softcap, corrupt) > 1e-3


def test_the_reference_checks_flash_attns_contract():
    # blocks of 16 tokens are refused by flash-attn 2's paged kernels, and by its reference here
    call = random_call(0, [20], [1], block_size=16)
    with pytest.raises(AssertionError, match="multiple of 256"):
        flash_error(call, None, None)


# ---------------------------------------------------------------------- block sizes, devices, the choice
def test_block_size_rule_and_supported_tensors():
    assert [flash.accepts_block_size(size) for size in (16, 128, 256, 512, 768)] == [False] * 2 + [True] * 3
    query, key_cache, *_ = random_call(0, [20], [1], block_size=16)
    assert not flash.supports(query, key_cache)  # on the CPU, and fp32: never flash-attn


def test_block_size_auto_picks_what_the_fastest_backend_reads(monkeypatch):
    from hf_paged.config import PagedCacheConfig

    assert kernels.auto_block_size("cpu") == 16
    monkeypatch.setattr(flash, "available", lambda: False)
    assert kernels.auto_block_size("cuda") == 16  # the Triton kernel or gather: any size
    monkeypatch.setattr(flash, "available", lambda: True)
    assert kernels.auto_block_size("cuda") == kernels.auto_block_size("cuda", "flash") == 256
    assert kernels.auto_block_size("cuda", "triton") == kernels.auto_block_size("cuda", "gather") == 16
    assert kernels.auto_block_size("cpu", "flash") == 16
    config = PagedCacheConfig.from_dict({"block_size": "auto"})
    assert (config.block_size_on("cuda"), config.block_size_on("cpu")) == (256, 16)
    assert kernels.resolve_kernel("auto", "cuda", config.block_size_on("cuda")).backend == "flash"
    with pytest.raises(TypeError, match="block_size must be a positive int or 'auto', got 'big'"):
        PagedCacheConfig.from_dict({"block_size": "big"})


def test_cuda_choice_by_block_size(monkeypatch, caplog):
    monkeypatch.setattr(flash, "available", lambda: True)
    monkeypatch.setattr(triton_backend, "available", lambda: True)
    kernels._warned.clear()
    assert kernels.resolve_kernel("auto", "cuda", 256) == kernels.KernelChoice("auto", "flash", fallback="triton")
    assert kernels.resolve_kernel("flash", "cuda", 512).backend == "flash"
    with caplog.at_level(logging.INFO, logger="hf_paged.kernels"):
        assert kernels.resolve_kernel("auto", "cuda", 16) == kernels.KernelChoice("auto", "triton")
        assert kernels.resolve_kernel("auto", "cuda", 16) == kernels.KernelChoice("auto", "triton")
    lines = [(record.levelname, record.getMessage()) for record in caplog.records]
    assert len(lines) == 1 and lines[0][0] == "INFO"  # auto chooses without a warning
    assert "multiple of 256 tokens, not 16; kernel='auto' uses kernel='triton'" in lines[0][1]
    with pytest.raises(kernels.KernelUnavailableError, match="not 16") as refused:  # asked for by name: refused
        kernels.resolve_kernel("flash", "cuda", 16)
    assert "Kernels available on cuda with blocks of 16 tokens: ['auto', 'gather', 'triton']" in str(refused.value)
    assert kernels.resolve_kernel("triton", "cuda", 16) == kernels.KernelChoice("triton", "triton")
    monkeypatch.setattr(triton_backend, "available", lambda: False)
    assert kernels.resolve_kernel("auto", "cuda", 16).backend == "gather"
    assert kernels.resolve_kernel("auto", "cuda", 256) == kernels.KernelChoice("auto", "flash")
    kernels._warned.clear()


def test_calls_flash_attn_cannot_take_go_to_the_fallback():
    # fp32 on the CPU: flash-attn supports neither, the Triton kernel does under the interpreter (else: gather)
    choice = kernels.KernelChoice("auto", "flash", fallback="triton")
    query, key_cache, *_ = random_call(0, [20], [1], block_size=256)
    expected = "triton" if triton_backend.supports(query, key_cache) else None
    assert choice.backend_for(query, key_cache) == expected


def test_sinks_go_to_the_fallback():
    call, _, _ = flash_call(CASES[0])
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out = flash.attention(*call, scale=0.125, sinks=sinks)
    want = gather_paged_attention(*call, 0.125, sinks=sinks)
    assert (out - want).abs().max() <= TOLERANCE


def test_asking_for_flash_without_flash_attn_names_the_extra(monkeypatch):
    monkeypatch.setattr(flash, "available", lambda: False)
    with pytest.raises(kernels.KernelUnavailableError, match=r"pip install 'hf_paged\[flash\]'"):
        kernels.resolve_kernel("flash", "cuda", 256)


# ---------------------------------------------------------------------- on a device
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_attn_on_the_device_matches_the_reference(case, dtype):
    if not flash.available():
        pytest.skip("flash-attn is not installed")
    call, window, softcap = flash_call(case)
    call = [tensor.cuda() for tensor in call]
    query, key_cache, value_cache = (tensor.to(dtype) for tensor in call[:3])
    args = (query, key_cache, value_cache, *call[3:])
    out = flash.attention(*args, scale=0.125, window=window, softcap=softcap)
    want = gather_paged_attention(*(t.float() if t.is_floating_point() else t for t in args), 0.125, window, softcap)
    assert (out.float() - want).abs().max() <= 2e-2
