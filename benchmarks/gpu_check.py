"""One command for a CUDA device: exactness of every available paged-attention backend, decode speed against
`DynamicCache` and `StaticCache`, the Engine against transformers' continuous batching, peak memory; one markdown
table per part, printed as each part ends (so a run cut short still reports what it measured).

Parts (sized to stay under 8 minutes on one H100/H200-class GPU with the defaults; not yet timed on one):

1. **kernels**: every backend that runs here (`gather`, `triton`, `flash`) against the gather reference on random
   block tables (block sizes 16, 32, 256; GQA; windows; softcap; mixed query counts), fp32 and bf16: max abs error.
2. **exactness**: tiny Llama and Gemma2 (sliding window + softcap) `generate` through each backend vs `DynamicCache`:
   greedy and beam-search tokens equal in fp32; in bf16 the max abs difference of the first step's scores.
3. **decode**: decode tokens/s of a random-weight Llama (`--layers`, `--hidden`; bf16) at batch 1/8/32 x context
   512..8192: paged (`kernel="auto"`) vs `DynamicCache` vs `StaticCache` (not compiled), and the peak CUDA memory
   each run added to the weights (cache, activations).
4. **serving**: the Engine vs `generate_batch` (transformers' continuous batching, flash-attn 2 where installed,
   else SDPA) on the ShareGPT-like workload of benchmarks/engine_throughput.py: tokens/s, peak memory.

Usage: python benchmarks/gpu_check.py [--parts kernels exactness decode serving] [--contexts 512 2048 8192]
       [--batches 1 8 32] [--decode-tokens 32] [--requests 200]

Without a CUDA device it prints one line saying so and exits with status 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import sys
import time

import torch

NO_DEVICE = "no CUDA device: benchmarks/gpu_check.py measures the GPU backends and needs one (see docs/gpu.md)"
PARTS = ("kernels", "exactness", "decode", "serving")
DEVICE = "cuda"  # `--device cpu`: a smoke run of the script's own logic on tiny shapes (tests/test_gpu_check.py)


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def reset_peak() -> int:
    """Reset the peak-memory counter; the bytes allocated now (0 on the CPU, where nothing is counted)."""
    if DEVICE != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def peak_gib(device: str, baseline: int = 0) -> float:
    return (torch.cuda.max_memory_allocated() - baseline) / 2**30 if device == "cuda" else float("nan")


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def version(module: str) -> str:
    try:
        return importlib.import_module(module).__version__
    except ImportError:
        return "not installed"


def environment() -> str:
    import transformers

    if DEVICE != "cuda":
        return f"CPU smoke run, torch {torch.__version__}, triton {version('triton')}"
    name = torch.cuda.get_device_name()
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    return (
        f"{name} ({total:.0f} GiB), torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
        f"{transformers.__version__}, triton {version('triton')}, flash-attn {version('flash_attn')}"
    )


def backends() -> list[str]:
    """The paged-attention backends that can run on this device."""
    from hf_paged.kernels import flash
    from hf_paged.kernels import triton as triton_backend

    names = ["gather"]
    if triton_backend.available() and triton_backend.runs_on(DEVICE):
        names.append("triton")
    if flash.available() and DEVICE == "cuda":
        names.append("flash")
    return names


# ---------------------------------------------------------------------- 1. kernels vs the reference
def random_call(seed, lengths, counts, kv_heads, group, head_dim, block_size, dtype, device):
    generator = torch.Generator().manual_seed(seed)
    row_blocks = [math.ceil(length / block_size) for length in lengths]
    num_blocks = sum(row_blocks) + 2
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(lengths), max(row_blocks), dtype=torch.int32)
    for row, blocks in enumerate(row_blocks):
        tables[row, :blocks] = torch.tensor([order.pop() for _ in range(blocks)], dtype=torch.int32)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(device, dtype)
    value_cache = torch.randn(shape, generator=generator).to(device, dtype)
    query = torch.randn(sum(counts), kv_heads * group, head_dim, generator=generator).to(device, dtype)
    starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    lengths = torch.tensor(lengths, dtype=torch.int32)
    return query, key_cache, value_cache, tables.to(device), lengths.to(device), starts.to(device)


def kernel_part(names: list[str], scale: float = 1.0) -> str:
    from hf_paged.kernels import flash, in_place_backend
    from hf_paged.kernels.reference import gather_paged_attention

    cases = [  # (lengths, counts, group, window, softcap)
        ([4000, 700, 33], [1, 1, 1], 4, None, None),
        ([4000, 700, 33], [1, 1, 1], 8, 1024, 30.0),
        ([1500, 300, 64], [512, 17, 64], 2, None, None),
        ([1500, 300, 64], [512, 17, 64], 4, 257, 50.0),
    ]
    rows = []
    for name in names[1:]:
        backend = in_place_backend(name)
        for dtype in (torch.float32, torch.bfloat16):
            for block_size in (16, 32, 256):
                worst = 0.0
                ran = True
                for seed, (lengths, counts, group, window, softcap) in enumerate(cases):
                    lengths = [max(1, int(n * scale)) for n in lengths]
                    counts = [min(max(1, int(c * scale)), n) for c, n in zip(counts, lengths)]
                    call = random_call(seed, lengths, counts, 2, group, 128, block_size, dtype, DEVICE)
                    if not backend.supports(call[0], call[1]) or (name == "flash" and dtype == torch.float32):
                        ran = False
                        break
                    out = backend.attention(*call, 128**-0.5, window, softcap, None)
                    floats = [t.float() if t.is_floating_point() else t for t in call]
                    want = gather_paged_attention(*floats, 128**-0.5, window, softcap)
                    worst = max(worst, (out.float() - want).abs().max().item())
                if name == "flash" and not flash.accepts_block_size(block_size):
                    ran = False
                rows.append([name, str(dtype).removeprefix("torch."), block_size, f"{worst:.2e}" if ran else "n/a"])
    return markdown_table(["backend", "dtype", "block size", "max abs error vs reference"], rows)


# ---------------------------------------------------------------------- 2. generate vs DynamicCache
def exactness_part(names: list[str], new_tokens: int = 24) -> str:
    from hf_paged.reference_models import tiny_model

    rows = []
    for family in ("llama", "gemma2"):
        for dtype in (torch.float32, torch.bfloat16):
            model = tiny_model(family).to(DEVICE, dtype)
            ids = torch.randint(3, 128, (3, 40), generator=torch.Generator().manual_seed(0)).to(DEVICE)
            options = {"max_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 0}
            for name in names:
                block_size = 256 if name == "flash" else 16
                config = {"kernel": name, "block_size": block_size, "attn_implementation": "hf_paged"}
                for beams in (1, 4):
                    stock = model.generate(
                        ids, num_beams=beams, return_dict_in_generate=True, output_scores=True, **options
                    )
                    out = model.generate(
                        ids, num_beams=beams, return_dict_in_generate=True, output_scores=True,
                        cache_implementation="paged", cache_config=config, **options,
                    )  # fmt: skip
                    calls = dict(out.past_key_values.attention_calls)
                    out.past_key_values.release()
                    same = torch.equal(out.sequences, stock.sequences)
                    first = (out.scores[0].float() - stock.scores[0].float()).abs().max().item()
                    rows.append(
                        [family, str(dtype).removeprefix("torch."), name, "beam 4" if beams > 1 else "greedy",
                         "yes" if same else "NO", f"{first:.2e}", calls]
                    )  # fmt: skip
    headers = ["model", "dtype", "kernel", "search", "tokens equal", "first-step scores max diff", "calls"]
    return markdown_table(headers, rows)


# ---------------------------------------------------------------------- 3. decode speed
def medium_llama(layers: int, hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), max_position_embeddings=16384,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(DEVICE, torch.bfloat16 if DEVICE == "cuda" else torch.float32).eval()


def decode_rate(model, batch: int, context: int, new_tokens: int, **options) -> tuple[float, float]:
    """`(decode tokens/s, peak GiB)` of one `generate`: the decode steps only (from the second forward on)."""
    ids = torch.randint(3, model.config.vocab_size, (batch, context), device=DEVICE)
    starts = []

    def mark(module, args):
        synchronize()
        starts.append(time.perf_counter())

    hook = model.register_forward_pre_hook(mark)
    baseline = reset_peak()
    try:
        out = model.generate(
            ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
            return_dict_in_generate=True, **options,
        )  # fmt: skip
        synchronize()
        end = time.perf_counter()
    finally:
        hook.remove()
    peak = peak_gib(DEVICE, baseline)  # the cache and activations, not the weights
    release = getattr(out.past_key_values, "release", None)
    if release is not None:
        from hf_paged.pool import release_pool

        release()
        release_pool(model)  # the next run starts without the pool's storage
    return batch * (len(starts) - 1) / (end - starts[1]), peak


def decode_part(args) -> str:
    model = medium_llama(args.layers, args.hidden)
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            tokens = batch * (context + args.decode_tokens)
            paged = {
                "cache_implementation": "paged",
                "cache_config": {"block_size": args.block_size, "num_blocks": tokens // args.block_size + 4 * batch},
            }
            systems = {
                "paged": paged,
                "DynamicCache": {},
                "StaticCache": {"cache_implementation": "static"},
            }
            cells = []
            for options in systems.values():
                try:
                    rate, peak = decode_rate(model, batch, context, args.decode_tokens, **options)
                    cells.append(f"{rate:,.0f} tok/s, {peak:.1f} GiB")
                except torch.OutOfMemoryError:
                    cells.append("out of memory")
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
            rows.append([batch, context, *cells])
    kernel = "auto"
    with contextlib.suppress(Exception):
        from hf_paged.kernels import resolve_kernel

        kernel = resolve_kernel("auto", DEVICE, args.block_size).backend
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    title = (
        f"decode, Llama {args.layers} layers x {args.hidden} ({dtype}, random weights), {args.decode_tokens} new "
        f"tokens, paged block size {args.block_size} (kernel {kernel})"
    )
    return title + "\n\n" + markdown_table(["batch", "context", "paged", "DynamicCache", "StaticCache"], rows)


# ---------------------------------------------------------------------- 4. serving
def serving_part(args) -> str:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from engine_throughput import run_generate_batch, workload

    import hf_paged

    model = medium_llama(args.layers, args.hidden)
    requests = workload(args.requests, args.scale, 2048, model.config.vocab_size)
    budget = args.budget_tokens
    rows = []
    engine = hf_paged.Engine(model, block_size=args.block_size, num_blocks=budget // args.block_size, progress=False)
    params = [hf_paged.SamplingParams(max_new_tokens=n, eos_token_id=()) for _, n in requests]
    reset_peak()
    start = time.perf_counter()
    outputs = engine.generate([p for p, _ in requests], params)
    synchronize()
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    name = f"hf_paged Engine (kernel {engine.cache.kernel.backend})"
    rows.append([name, f"{generated / elapsed:,.0f}", f"{elapsed:.1f}", f"{peak_gib(DEVICE):.1f}"])
    engine.close()
    hf_paged.disable()  # transformers' own continuous batching, untouched
    if version("flash_attn") != "not installed":
        model.set_attn_implementation("flash_attention_2")
    attention = model.config._attn_implementation
    reset_peak()
    try:
        elapsed, generated, *_ = run_generate_batch(model, requests, budget, args.block_size)
        rows.append(
            [f"generate_batch ({attention})", f"{generated / elapsed:,.0f}", f"{elapsed:.1f}",
             f"{peak_gib(DEVICE):.1f}"]
        )  # fmt: skip
    except Exception as error:  # noqa: BLE001 (report it in the table, keep the rest)
        rows.append([f"generate_batch ({attention})", f"failed: {type(error).__name__}: {error}"[:120], "-", "-"])
    finally:
        hf_paged.enable()
    title = f"serving, {args.requests} ShareGPT-like requests, KV budget {budget} tokens"
    return title + "\n\n" + markdown_table(["system", "tokens/s", "wall s", "peak GiB"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--contexts", nargs="+", type=int, default=[512, 2048, 8192])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=None, help="default: 256 with flash-attn, else 16")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--budget-tokens", type=int, default=65536)
    parser.add_argument("--scale", type=float, default=1.0, help="of the workload's lengths")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print(NO_DEVICE)
        return 0
    import hf_paged  # noqa: F401  (registers the paged cache)

    names = backends()
    if args.block_size is None:
        args.block_size = 256 if "flash" in names else 16
    print(f"# gpu_check\n\n{environment()}; backends: {', '.join(names)}\n", flush=True)
    steps = {
        "kernels": ("kernels vs the gather reference", lambda: kernel_part(names, 1.0 if DEVICE == "cuda" else 0.01)),
        "exactness": (
            "generate vs DynamicCache (tiny models)",
            lambda: exactness_part(names, 24 if DEVICE == "cuda" else 3),
        ),
        "decode": ("decode speed", lambda: decode_part(args)),
        "serving": ("serving", lambda: serving_part(args)),
    }
    for part in args.parts:
        title, run = steps[part]
        start = time.perf_counter()
        try:
            table = run()
        except Exception as error:  # noqa: BLE001 (one failing part must not hide the others)
            table = f"failed: {type(error).__name__}: {error}"
        print(f"## {title} ({time.perf_counter() - start:.0f} s)\n\n{table}\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
