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
