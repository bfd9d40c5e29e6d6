"""`kv_dtype="int4-channel"`: keys quantized per channel once their block is full, kept exact in companion blocks
until then (`hf_paged.channel_keys`, `hf_paged.staged_storage`). The format's round trip, the storage's writes and
reads across forwards, copy-on-write and `truncate`, byte accounting, and generation held token-identical to stock
`generate` over a `DynamicCache` holding the same values (`tests/quant_helpers.staged_round_trip_cache`): greedy over
left-padded rows, sliding and hybrid layer groups, beams, sampling with n > 1, prefix sharing, the Engine, SmolLM2."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_paged
from hf_paged.allocator import BlockAllocator
from hf_paged.channel_keys import StagedLayout, dequantize_keys, quantize_key_blocks, round_trip_key_blocks
from hf_paged.config import PagedCacheConfig
from hf_paged.engine import Engine
from hf_paged.kernels import paged_attention, resolve_kernel, unavailable_reason
from hf_paged.kv_format import FORMATS, rotate
from hf_paged.pool import KVShape
from hf_paged.reference_models import tiny_model
from hf_paged.staged_storage import StagedKVStorage
from tests.exactness import SCORE_TOLERANCE, reads_in_place
from tests.quant_helpers import generate_staged_round_trip, staged_round_trip_cache

CPU_KERNEL = resolve_kernel("cpu", "cpu").in_place

KV_DTYPE = "int4-channel"
GREEDY = {"do_sample": False, "max_new_tokens": 14, "pad_token_id": 0}


def _paged(model, input_ids, block_size=4, **kwargs):
    config = {"kv_dtype": KV_DTYPE, "block_size": block_size, "num_blocks": 400, **kwargs.pop("cache_config", {})}
    out = model.generate(
        input_ids, cache_implementation="paged", cache_config=config, return_dict_in_generate=True, **kwargs
    )
    out.past_key_values.release()
    pool = hf_paged.get_pool(model)
    pool.check_invariants()
    return out


def _same(reference, paged):
    assert torch.equal(reference.sequences, paged.sequences)
    for ref, got in zip(getattr(reference, "logits", None) or (), paged.logits or ()):
        if reads_in_place():  # the CPU kernel reads the pages: within tolerance
            torch.testing.assert_close(got, ref, rtol=0, atol=SCORE_TOLERANCE)
        else:  # every read gathers: bit for bit
            assert torch.equal(ref, got)


# ---------------------------------------------------------------------------------------------- the format itself
@settings(max_examples=50, deadline=None)
@given(
    blocks=st.integers(1, 3),
    block_size=st.sampled_from([1, 2, 16, 64]),
    half_dim=st.sampled_from([1, 4, 32]),
    magnitude=st.sampled_from([1e-3, 1.0, 40.0]),
    seed=st.integers(0, 2**16),
)
def test_each_channel_comes_back_within_half_its_step(blocks, block_size, half_dim, magnitude, seed):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(blocks, block_size, 2, 2 * half_dim, generator=generator) * magnitude
    keys[..., 0] += 5 * magnitude  # an outlier channel of one sign, as keys have
    codes, params = quantize_key_blocks(keys)
    assert codes.dtype == torch.uint8 and codes.shape == (blocks, block_size, 2, half_dim)
    rotated = dequantize_keys(codes, params[:, None, :, 0], params[:, None, :, 1], torch.float32, rotate_back=False)
    step = params[:, None, :, 0].float()
    # half a step, plus the bfloat16 rounding of the minimum and the step (over 15 steps)
    bound = step * (0.5 + 16 * 2.0**-8) + rotate(keys).abs().amax(dim=1, keepdim=True) * 2.0**-7 + 1e-6
    assert ((rotated - rotate(keys)).abs() <= bound).all()
    torch.testing.assert_close(round_trip_key_blocks(keys), rotate(rotated), rtol=0, atol=0)


def test_a_channel_of_one_value_comes_back_exactly_and_a_negative_control_can_fail():
    keys = torch.randn(1, 8, 1, 4)
    back = dequantize_keys(*_split(quantize_key_blocks(keys)), torch.float32, rotate_back=False)
    rotated = rotate(keys)
    assert torch.equal(back.amin(dim=1), rotated.amin(dim=1).to(torch.bfloat16).float())
    assert not torch.equal(round_trip_key_blocks(keys), keys)  # 4 bits are not exact


def _split(quantized):
    codes, params = quantized
    return codes, params[:, None, :, 0], params[:, None, :, 1]


def test_layout_bytes_and_companions():
    layout = StagedLayout(block_size=64, num_heads=3, head_dim=64)  # SmolLM2's lanes
    assert (layout.code_bytes, layout.value_scales_at, layout.key_params_at, layout.row_bytes) == (
        6144,
        12288,
        12672,
        13440,
    )
    assert (layout.companions(torch.bfloat16), layout.companions(torch.float32)) == (2, 4)
    shape = KVShape(30, 3, 64, torch.bfloat16, kv_dtype=KV_DTYPE, block_size=64)
    bf16 = KVShape(30, 3, 64, torch.bfloat16)
    assert shape.bytes_per_token == 30 * 13440 // 64 and shape.companions == 2
    assert round(bf16.bytes_per_token / shape.bytes_per_token, 3) == 3.657  # full blocks; open ones cost companions


# ---------------------------------------------------------------------------------------------- the storage
def _storage(block_size=4, companions=2, num_blocks=16):
    allocator = BlockAllocator(num_blocks, block_size, companions)
    return allocator, StagedKVStorage(num_blocks, block_size, kv_format=FORMATS[KV_DTYPE], companions=companions)


def _append(allocator, storage, table, keys, values, block=4):
    start = table.num_tokens
    copies = allocator.append(table, keys.shape[0])
    storage.apply_staging(allocator.staging)
    storage.copy_blocks(copies)
    positions = range(start, table.num_tokens)
    slots = torch.tensor([table.block_ids[p // block] * block + p % block for p in positions])
    storage.write(0, slots, keys, values)


def _read(storage, table):
    slots = torch.tensor([[table.block_ids[p // 4] * 4 + p % 4 for p in range(table.num_tokens)]])
    keys, values = storage.gather(0, slots)
    return keys[0].transpose(0, 1), values[0].transpose(0, 1)


def test_a_block_filled_over_several_writes_holds_what_one_write_would():
    keys, values = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    expected_keys = torch.cat([round_trip_key_blocks(keys[:8].view(2, 4, 2, 8)).view(8, 2, 8), keys[8:]])
    expected_values = FORMATS["int4"].round_trip(values)
    for splits in ([10], [3, 1, 6], [1] * 10, [5, 5]):
        allocator, storage = _storage()
        table = allocator.new_table()
        start = 0
        for count in splits:
            _append(allocator, storage, table, keys[start : start + count], values[start : start + count])
            start += count
            got_keys, got_values = _read(storage, table)
            reference = torch.cat([expected_keys[: start // 4 * 4], keys[start // 4 * 4 : start]])
            assert torch.equal(got_keys, reference), splits  # open block exact, full blocks per channel
            assert torch.equal(got_values, expected_values[:start])
        allocator.check_invariants()


def test_copy_on_write_and_truncate_keep_what_each_table_reads():
    keys, values = torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    allocator, storage = _storage()
    parent = allocator.new_table()
    _append(allocator, storage, parent, keys[:6], values[:6])  # block 1 open, 2 tokens
    child = allocator.fork(parent)
    _append(allocator, storage, child, keys[6:], values[6:])  # copies block 1 and its companions
    assert child.block_ids[1] != parent.block_ids[1]
    parent_keys, _ = _read(storage, parent)
    child_keys, _ = _read(storage, child)
    assert torch.equal(parent_keys[4:], keys[4:6]) and torch.equal(child_keys[4:], keys[4:7])
    full = _read(storage, parent)[0][:4]
    allocator.truncate(parent, 3)  # block 0 is open again: its keys read back, dequantized, into companions
    storage.apply_staging(allocator.staging)
    assert torch.equal(_read(storage, parent)[0], full[:3])
    _append(allocator, storage, parent, keys[3:4] * 2, values[3:4])
    allocator.check_invariants()
    again = torch.cat([full[:3], keys[3:4] * 2]).view(1, 4, 2, 8)
    assert torch.equal(_read(storage, parent)[0], round_trip_key_blocks(again).view(4, 2, 8))


def test_blocks_default_to_64_tokens_and_a_given_size_is_kept():
    assert PagedCacheConfig(kv_dtype=KV_DTYPE).block_size_on("cpu") == 64
    assert PagedCacheConfig(kv_dtype=KV_DTYPE, block_size=16).block_size_on("cpu") == 16
    assert PagedCacheConfig(kv_dtype="int4").block_size_on("cpu") == 16


def test_the_pool_counts_companions_in_its_bytes():
    model = tiny_model("llama")
    hf_paged.release_pool(model)
    pool = hf_paged.get_pool(model, kv_dtype=KV_DTYPE, num_blocks=32)
    assert pool.block_size == 64 and pool.allocator.staging.per_open_block == pool.kv_shape.companions
    cache = hf_paged.PagedCache(model, kv_dtype=KV_DTYPE, num_blocks=32)
    model.generate(torch.tensor([[5, 6, 7]]), past_key_values=cache, **GREEDY)
    stats = pool.stats()
    assert stats.num_used == 1 + pool.kv_shape.companions  # one open block and its companions
    assert stats.kv_bytes_total == pool.storage.nbytes
    cache.release()
    assert pool.stats().num_used == 0
    pool.check_invariants()


IN_PLACE = [
    pytest.param("cpu", marks=pytest.mark.skipif(not CPU_KERNEL, reason="the CPU kernel cannot be built here")),
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            unavailable_reason("triton", "cpu") is not None, reason="Triton runs on CPU tensors only interpreted"
        ),
    ),
]


def _full_and_open_blocks(dtype, device="cpu"):
    """A kernel call over rows ending inside an open block and on a block edge, written over two writes each;
    decode and prefill queries. Returns the storage and the call's arguments."""
    generator = torch.Generator().manual_seed(11)
    block, heads, dim = 16, 2, 64
    allocator, storage = _storage(block, companions=4, num_blocks=64)
    tables, lengths = [], [5, 16, 37, 64, 1]
    for length in lengths:
        table = allocator.new_table()
        for count in (length // 2, length - length // 2):
            if count:
                new = torch.randn(2, count, heads, dim, generator=generator).to(device, dtype)
                _append(allocator, storage, table, new[0] * 3, new[1], block)
        tables.append(table)
    width = max(len(t.block_ids) for t in tables)
    block_tables = torch.tensor([t.block_ids + t.block_ids[:1] * (width - len(t.block_ids)) for t in tables])
    counts = [1, 3, 2, 1, 1]
    query_start = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(counts), 4, dim, generator=generator).to(dtype)
    key_pages, value_pages = storage.layer_tensors(0)
    call = (query, block_tables.int(), torch.tensor(lengths).int(), query_start)
    query, block_tables, lengths, query_start = (tensor.to(device) for tensor in call)
    return storage, (query, key_pages, value_pages, block_tables, lengths, query_start)


@pytest.mark.parametrize("backend", IN_PLACE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", [{}, {"window": 7}, {"softcap": 5.0, "sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])}])
def test_in_place_kernels_read_full_and_open_blocks_as_the_gather_reference(backend, dtype, options):
    """Rows ending inside an open block and on a block edge, written over two writes each; decode and prefill
    queries. A negative control reads every open block as if it were full: far off."""
    storage, args = _full_and_open_blocks(dtype)
    dim = args[0].shape[-1]
    expected = paged_attention(*args, scale=dim**-0.5, kernel="gather", **options)
    got = paged_attention(*args, scale=dim**-0.5, kernel=backend, **options)
    tolerance = 3e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=tolerance)
    storage._tables[:, 0] = -1  # negative control: open blocks read as full ones
    storage._device_tables.clear()
    wrong = paged_attention(*args, scale=dim**-0.5, kernel=backend, **options)
    assert (wrong.float() - expected.float()).abs().nan_to_num(nan=float("inf")).max() > 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_triton_kernel_on_the_device_reads_full_and_open_blocks_as_the_gather_reference(dtype):
    """The same call on a CUDA device, through the compiled Triton kernel (the test above runs it interpreted)."""
    _, args = _full_and_open_blocks(dtype, "cuda")
    dim = args[0].shape[-1]
    expected = paged_attention(*args, scale=dim**-0.5, kernel="gather")
    got = paged_attention(*args, scale=dim**-0.5, kernel="triton")
    tolerance = 3e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=tolerance)


@pytest.mark.parametrize("kernel", ["cpu", "gather"])
def test_the_staged_ops_write_what_the_storage_writes_and_attend_as_the_kernels_do(kernel):
    """`ops.write_kv_staged` on a copy of a lane's rows = `StagedKVStorage.write` (a write that fills one block and
    opens the next); `ops.paged_attention_staged` over the rows = the kernels over `StagedPages`."""
    from hf_paged.kernels import ops

    generator = torch.Generator().manual_seed(12)
    allocator, storage = _storage(block_size=4, companions=2)
    table = allocator.new_table()
    _append(allocator, storage, table, *torch.randn(2, 3, 2, 8, generator=generator))
    keys, values = torch.randn(2, 3, 2, 8, generator=generator)
    allocator.append(table, 3)  # tokens 3-5: the write fills block 0 and opens block 1
    storage.apply_staging(allocator.staging)
    slots = torch.tensor([table.block_ids[p // 4] * 4 + p % 4 for p in range(3, 6)])
    rows, tables = storage.raw[0].clone(), storage.tables_on(torch.device("cpu"))
    storage.write(0, slots, keys, values)
    ops.write_kv_staged(rows, tables, 4, slots, keys, values)
    assert torch.equal(rows, storage.raw[0])  # byte for byte: codes, scales, per-channel parameters, companions

    query = torch.randn(2, 4, 8, generator=generator)  # the last two tokens' queries
    block_tables = torch.tensor([table.block_ids], dtype=torch.int32)
    args = (block_tables, torch.tensor([6], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32), 0.35)
    out = ops.paged_attention_staged(query, rows, tables, 4, 2, *args, None, 5.0, None, kernel)
    expected = paged_attention(query, *storage.layer_tensors(0), *args[:3], scale=0.35, softcap=5.0, kernel=kernel)
    assert torch.equal(out, expected)
    torch.library.opcheck(ops.write_kv_staged, (rows.clone(), tables, 4, slots, keys, values))
    torch.library.opcheck(ops.paged_attention_staged, (query, rows, tables, 4, 2, *args, None, 5.0, None, kernel))


# ---------------------------------------------------------------------------------------------- generation
@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3"])  # full; sliding + softcap; hybrid layer groups
def test_greedy_generation_equals_stock_over_the_same_values(family):
    model = tiny_model(family)
    input_ids = torch.randint(3, 100, (3, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(input_ids)
    mask[1, :3] = 0  # left pads: the pages group each row's tokens from its first real one
    mask[2, :6] = 0
    options = {**GREEDY, "attention_mask": mask, "output_logits": True}
    reference = generate_staged_round_trip(model, input_ids, 4, **options, return_dict_in_generate=True)
    paged = _paged(model, input_ids, **options)
    _same(reference, paged)
    assert paged.past_key_values.attention_calls.keys() <= {"gather", "cpu"}
    if family == "llama":  # under the "hf_paged" attention (gemma2/3 here: eager attention, dense reads)
        assert ("cpu" in paged.past_key_values.attention_calls) == reads_in_place()  # the kernel reads these pages


@pytest.mark.skipif(unavailable_reason("triton", "cpu") is not None, reason="Triton runs on CPU tensors interpreted")
def test_generate_through_the_triton_kernel_equals_stock_over_the_same_values():
    model = tiny_model("llama")
    input_ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(6))
    options = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    reference = generate_staged_round_trip(model, input_ids, 4, **options)
    out = _paged(model, input_ids, cache_config={"kernel": "triton"}, **options)
    assert torch.equal(out.sequences, reference)
    assert set(out.past_key_values.attention_calls) == {"triton"}


def test_a_negative_control_per_token_int4_pages_differ():
    model = tiny_model("llama")
    input_ids = torch.randint(3, 100, (2, 11), generator=torch.Generator().manual_seed(1))
    reference = generate_staged_round_trip(model, input_ids, 4, **GREEDY, output_logits=True,
                                           return_dict_in_generate=True)  # fmt: skip
    int4 = model.generate(input_ids, cache_implementation="paged", **GREEDY, output_logits=True,
                          return_dict_in_generate=True, cache_config={"kv_dtype": "int4", "block_size": 4})  # fmt: skip
    assert not torch.allclose(reference.logits[0], int4.logits[0], atol=1e-4)


def test_beam_search_and_sampling_with_n_equal_stock():
    model = tiny_model("llama")
    input_ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    beams = {"num_beams": 3, "num_return_sequences": 2, "do_sample": False, "max_new_tokens": 9, "pad_token_id": 0}
    reference = generate_staged_round_trip(model, input_ids, 4, **beams, return_dict_in_generate=True)
    _same(reference, _paged(model, input_ids, **beams))
    sampling = {"do_sample": True, "num_return_sequences": 3, "max_new_tokens": 9, "pad_token_id": 0, "top_k": 20}
    torch.manual_seed(7)
    reference = generate_staged_round_trip(model, input_ids, 4, **sampling, return_dict_in_generate=True)
    torch.manual_seed(7)
    _same(reference, _paged(model, input_ids, **sampling))


def test_prefix_sharing_reuses_full_blocks_and_copies_open_ones_on_write():
    model = tiny_model("llama")
    hf_paged.release_pool(model)
    prefix = torch.randint(3, 100, (1, 14), generator=torch.Generator().manual_seed(3))
    input_ids = torch.cat([prefix, torch.tensor([[41, 42]])], dim=1)
    options = {**GREEDY, "num_beams": 2, "num_return_sequences": 2, "output_logits": True}
    unshared = _paged(model, input_ids, cache_config={"prefix_caching": False}, **options)
    _paged(model, prefix, max_new_tokens=1, do_sample=False, pad_token_id=0)  # caches the prefix blocks
    pool = hf_paged.get_pool(model)
    reused_before = pool.stats().prefix_tokens_reused
    shared = _paged(model, input_ids, **options)
    assert pool.stats().prefix_tokens_reused - reused_before == 12  # three full blocks of 4
    assert shared.past_key_values.stats().cow_copies > 0
    _same(unshared, shared)
    # the format is in the prefix key: int4 pages never stand in for these blocks
    from hf_paged.planner import pool_root

    int4_pool = hf_paged.pool.BlockPool(8, 4, KVShape(2, 2, 16, torch.float32, kv_dtype="int4"))
    assert pool_root(pool, model) != pool_root(int4_pool, model)


def test_engine_steps_equal_stock_per_prompt():
    model = tiny_model("llama")
    hf_paged.release_pool(model)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 100, (n,), generator=generator).tolist() for n in (3, 17, 9, 30, 6)]
    engine = Engine(
        model,
        kv_dtype=KV_DTYPE,
        block_size=4,
        num_blocks=256,
        max_batch_size=4,
        max_prefill_tokens=8,
        max_num_batched_tokens=8,
        exact=True,
    )
    outputs = engine.generate(prompts, max_new_tokens=10)
    assert engine.pool.kv_dtype == KV_DTYPE
    for prompt, output in zip(prompts, outputs):
        expected = generate_staged_round_trip(model, torch.tensor([prompt]), 4, max_new_tokens=10, do_sample=False)
        assert output.token_ids == expected[0, len(prompt) :].tolist()
    assert engine.pool.stats().num_used == 0
    engine.pool.check_invariants()


def test_smollm2_greedy_equals_stock_over_the_same_values(smollm2):
    model, tokenizer = smollm2
    prompts = ["The capital of France is", "def fibonacci(n):"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    pads = (batch.attention_mask.shape[1] - batch.attention_mask.sum(dim=1)).tolist()
    options = {"max_new_tokens": 70, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    reference = model.generate(**batch, past_key_values=staged_round_trip_cache(model, 64, pads), **options)
    paged = model.generate(**batch, cache_implementation="paged", cache_config={"kv_dtype": KV_DTYPE}, **options)
    assert torch.equal(reference, paged)  # 70 new tokens: the first block of 64 fills and is quantized
    pool = hf_paged.get_pool(model)
    assert pool.kv_dtype == KV_DTYPE and pool.block_size == 64 and pool.stats().num_used == 0
