"""`hf-paged serve --gguf-file`: the SmolLM2 GGUF file is converted on the first start only; the second start loads
the cached copy (keyed by the file's SHA-256) and gets the same weights."""

from __future__ import annotations

import time

import pytest
import torch

from hf_paged.reference_models import SMOLLM2_GGUF, smollm2_gguf_dir
from hf_paged.serve.cli import build_parser, load
from hf_paged.serve.gguf_cache import COMPLETE_MARKER, file_digest

pytestmark = pytest.mark.slow


def test_a_gguf_file_is_converted_once_then_loaded_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_PAGED_CACHE", str(tmp_path))
    args = build_parser().parse_args(["serve", str(smollm2_gguf_dir()), "--gguf-file", SMOLLM2_GGUF])
    start = time.perf_counter()
    first, tokenizer, name = load(args)
    converting = time.perf_counter() - start
    start = time.perf_counter()
    second, _, _ = load(args)
    cached = time.perf_counter() - start
    folder = tmp_path / "gguf" / file_digest(smollm2_gguf_dir() / SMOLLM2_GGUF)
    assert (folder / COMPLETE_MARKER).exists() and (folder / "tokenizer.json").exists()
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == [folder.name]  # no staging folder left
    assert cached < converting / 2, (cached, converting)
    assert second.dtype == torch.float32 and name == smollm2_gguf_dir().name
    for (key, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), key
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert torch.equal(first.generate(ids, max_new_tokens=4, do_sample=False),
                       second.generate(ids, max_new_tokens=4, do_sample=False))  # fmt: skip
