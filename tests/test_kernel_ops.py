"""`torch.ops.hf_paged.paged_attention` and `torch.ops.hf_paged.write_kv`: custom ops with fake implementations, so
a step that writes new K/V into the blocks and attends through the block tables compiles with `fullgraph=True` into
one graph that serves every number of rows and tokens, with the outputs of the eager kernels."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from hf_paged.kernels import ops

BLOCK_SIZE, Q_HEADS, KV_HEADS, HEAD_DIM, NUM_BLOCKS = 16, 6, 2, 8, 37  # sizes no varying size meets by chance
BACKENDS = ["aot_eager"] + (["inductor"] if shutil.which("g++") or shutil.which("c++") else [])


def random_step(rng: random.Random, rows: int, width: int) -> dict:
    """One packed step: `rows` rows of up to `width` blocks, each computing 1-9 new tokens at the end of its
    context, their slots, and blocks holding random K/V."""
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    contexts = [rng.randint(1, width * BLOCK_SIZE) for _ in range(rows)]
    contexts[0] = width * BLOCK_SIZE - rng.randrange(BLOCK_SIZE)  # the widest row fills the table's width
    news = [rng.randint(1, min(context, 9)) for context in contexts]
    tables = torch.randperm(NUM_BLOCKS, generator=generator)[: rows * width].view(rows, width).to(torch.int32)
    slots = [
        int(tables[row, position // BLOCK_SIZE]) * BLOCK_SIZE + position % BLOCK_SIZE
        for row in range(rows)
        for position in range(contexts[row] - news[row], contexts[row])
    ]
    tokens = sum(news)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    return {
        "query": randn(tokens, Q_HEADS, HEAD_DIM),
        "keys": randn(tokens, KV_HEADS, HEAD_DIM),
        "values": randn(tokens, KV_HEADS, HEAD_DIM),
        "key_cache": randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM),
        "value_cache": randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM),
        "slots": torch.tensor(slots),
        "block_tables": tables,
        "seq_lens": torch.tensor(contexts, dtype=torch.int32),
        "query_start": torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int32),
    }


def step(query, keys, values, key_cache, value_cache, slots, block_tables, seq_lens, query_start, kernel, window):
    ops.write_kv(key_cache, value_cache, slots, keys, values)
    return ops.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start, 0.3, window, 5.0, None, backend=kernel
    )  # `backend` by keyword: inductor's lowering once clashed with an argument named `kernel`


def run(function, case: dict, kernel: str, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`function` on a copy of the case's blocks: the attention output and the keys' blocks after the write."""
    case = {**case, "key_cache": case["key_cache"].clone(), "value_cache": case["value_cache"].clone()}
    return function(**case, kernel=kernel, window=window), case["key_cache"]


def varying(case: dict) -> dict:
    dims = {"query": (0,), "keys": (0,), "values": (0,), "slots": (0,), "block_tables": (0, 1)}
    ops.mark_varying(
        *((case[name], d) for name, d in dims.items()), (case["seq_lens"], (0,)), (case["query_start"], (0,))
    )
    return case


@pytest.mark.parametrize("kernel", ["cpu", "gather"])
def test_the_ops_pass_torchs_custom_op_checks(kernel):
    case = random_step(random.Random(0), rows=3, width=2)
    attention_args = [case[n] for n in ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start")]
    torch.library.opcheck(ops.paged_attention, (*attention_args, 0.3, 20, 5.0, None, kernel))
    write_args = [case[n].clone() for n in ("key_cache", "value_cache")] + [
        case[n] for n in ("slots", "keys", "values")
    ]
    torch.library.opcheck(ops.write_kv, tuple(write_args))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kernel", ["cpu", "gather"])
def test_one_compiled_graph_serves_40_steps_of_varied_shapes_with_the_eager_outputs(backend, kernel):
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend=backend)
    rng = random.Random(1)
    for index in range(40):
        rows, width = (3, 2) if index == 0 else (rng.randint(1, 5), rng.randint(1, 3))
        case = random_step(rng, rows, width)
        window = None if index % 2 else 20
        expected_out, expected_blocks = run(step, case, kernel, window)
        out, blocks = run(compiled, varying(case), kernel, window)
        assert torch.equal(blocks, expected_blocks)
        assert torch.equal(out, expected_out), (index, (out - expected_out).abs().max())  # the same kernel runs
    assert counters["stats"]["unique_graphs"] == 2  # one per window argument (None, 20): a constant of the graph
    assert counters["graph_break"] == {}


def test_without_marking_the_varying_sizes_torch_compiles_again_negative_control():
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    rng = random.Random(1)
    for index in range(6):
        rows, width = (3, 2) if index == 0 else (1 + index % 2, 1 + index % 3)
        run(compiled, random_step(rng, rows, width), "gather")
    assert counters["stats"]["unique_graphs"] > 1


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("kernel", ["cpu", "gather"])
def test_the_quantized_ops_write_what_the_storage_writes_and_attend_as_the_kernels_do(kv_dtype, kernel):
    from hf_paged import kernels
    from hf_paged.kv_format import QuantizedPages, kv_format
    from hf_paged.storage import KVStorage

    fmt = kv_format(kv_dtype)
    case = random_step(random.Random(3), rows=3, width=2)
    storage = KVStorage(NUM_BLOCKS, BLOCK_SIZE, kv_format=fmt)
    storage.write(0, case["slots"], case["keys"], case["values"])  # the eager steps' write
    pages = [storage.keys[0].clone(), storage.key_scales[0].clone(), storage.values[0].clone()]
    pages.append(storage.value_scales[0].clone())
    written = [torch.zeros_like(page) for page in pages]
    ops.write_kv_quantized(*written, case["slots"], case["keys"], case["values"], kv_dtype)
    for ours, storages in zip(written, pages):  # the slots written (the storage's others hold what empty() gave)
        rows = (NUM_BLOCKS * BLOCK_SIZE, *ours.shape[2:])
        assert torch.equal(ours.view(rows)[case["slots"]], storages.view(rows)[case["slots"]])
    pages = written  # zeros around the written slots: every block the tables name reads back finite

    tables, lengths, starts = case["block_tables"], case["seq_lens"], case["query_start"]
    out = ops.paged_attention_quantized(case["query"], *pages, tables, lengths, starts, 0.3, kv_dtype, 20, 5.0)
    key_pages = QuantizedPages(fmt, pages[0], pages[1], torch.float32)
    value_pages = QuantizedPages(fmt, pages[2], pages[3], torch.float32)
    expected = kernels.paged_attention(
        case["query"], key_pages, value_pages, tables, lengths, starts, scale=0.3, window=20, softcap=5.0,
        kernel=kernel,
    )  # fmt: skip
    reference = ops.paged_attention_quantized(
        case["query"], *pages, tables, lengths, starts, 0.3, kv_dtype, 20, 5.0, backend=kernel
    )
    assert torch.equal(reference, expected)
    assert torch.allclose(out, expected, atol=1e-5)  # "auto" picks the in-place kernel or gathers
    write_args = (*[page.clone() for page in pages], case["slots"], case["keys"], case["values"], kv_dtype)
    torch.library.opcheck(ops.write_kv_quantized, write_args)
    attention_args = (case["query"], *pages, tables, lengths, starts, 0.3, kv_dtype, 20, 5.0, None, kernel)
    torch.library.opcheck(ops.paged_attention_quantized, attention_args)


def test_the_quantized_ops_compile_into_one_graph_with_the_eager_outputs():
    from hf_paged.kv_format import kv_format

    torch._dynamo.reset()
    counters.clear()
    fmt = "int8"

    def quantized_step(query, keys, values, pages, slots, block_tables, seq_lens, query_start):
        ops.write_kv_quantized(*pages, slots, keys, values, fmt)
        return ops.paged_attention_quantized(
            query, *pages, block_tables, seq_lens, query_start, 0.3, fmt, None, None, None, backend="gather"
        )

    compiled = torch.compile(quantized_step, fullgraph=True, dynamic=False, backend="aot_eager")
    rng = random.Random(4)
    for _ in range(8):
        case = random_step(rng, rng.randint(1, 4), rng.randint(1, 3))
        codes, scales = kv_format(fmt).quantize(case["key_cache"])
        pages = [codes, scales, codes.clone(), scales.clone()]
        arguments = [case[n] for n in ("query", "keys", "values")]
        rest = [case[n] for n in ("slots", "block_tables", "seq_lens", "query_start")]
        expected_pages = [page.clone() for page in pages]
        expected = quantized_step(*arguments, expected_pages, *rest)
        varying(case)
        out = compiled(*arguments, pages, *rest)
        assert torch.equal(out, expected) and all(torch.equal(a, b) for a, b in zip(pages, expected_pages))
    assert counters["stats"]["unique_graphs"] == 1 and counters["graph_break"] == {}
