"""One command for a CUDA device: exactness of every available paged-attention backend, decode speed against
`DynamicCache` and `StaticCache`, the Engine against transformers' continuous batching, peak memory; one markdown
table `| part | case | result | verdict |` for the whole run, each row printed as soon as it is measured (so a run
cut short still shows every row it measured).

Parts (sized to stay under 8 minutes on one H100/H200-class GPU with the defaults; on an H200 without flash-attn:
kernels 13 s, exactness 10 s, decode 75 s with one timed run a shape, serving 93 s):

1. **kernels**: every backend that runs here (`gather`, `triton`, `flash`) against the gather reference on random
   block tables (block sizes 16, 32, 256; GQA; windows; softcap; mixed query counts), fp32 and bf16: max abs error.
   Verdict `ok` within `KERNEL_TOLERANCE` (fp32 1e-5, bf16 2e-2), else `FAIL`; `n/a` where the backend cannot run
   the case (the result says why).
2. **exactness**: tiny Llama and Gemma2 (sliding window + softcap) `generate` through each backend vs `DynamicCache`,
   greedy and beam search. fp32: `ok` only if the tokens are equal. bf16: tokens may differ (reported), the verdict
   is on the first step's scores, `ok` when their max abs difference is within `BF16_SCORES_TOLERANCE` (2e-2).
3. **decode**: decode tokens/s of a random-weight Llama (`--layers`, `--hidden`; bf16) at batch 1/8/32 x context
   512..8192: paged (`kernel="auto"`; its decode steps compiled, as `generate` compiles them on CUDA by itself, and
   eager with `disable_compile=True`) vs `DynamicCache` vs `StaticCache` (which `generate` compiles too),
   each timed over `--repeats` more `generate`s of the shape after an untimed one (which compiles and allocates):
   the median tokens/s, and the peak CUDA memory the runs added to the weights (cache, activations). Verdict:
   paged's speed over DynamicCache's and StaticCache's, no pass/fail.
4. **serving**: the Engine vs `generate_batch` (transformers' continuous batching with its own CUDA graphs,
   flash-attn 2 where installed, else SDPA) on the ShareGPT-like workload of benchmarks/engine_throughput.py:
   tokens/s, peak memory, for each of
   `--engine-variants` (`exact`: eager steps; `graphs`: eager steps, decode steps replayed from CUDA graphs;
   `compiled`: compiled steps; `compiled+graphs`: both; compiled and captured before the timed run), each
   variant's tokens compared request by request with the first's. Verdict: the fastest Engine's speed over
   generate_batch's, no pass/fail.

Each part opens with a `setup` row (what it measures, on what) and ends with a `wall time` row; a part that raises
prints one `failed` row (verdict `FAIL`) and the next part still runs.

Usage: python benchmarks/gpu_check.py [--parts kernels exactness decode serving] [--contexts 512 2048 8192]
       [--batches 1 8 32] [--decode-tokens 32] [--repeats 3] [--requests 200]

Without a CUDA device it prints one line saying so and exits with status 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch

NO_DEVICE = "no CUDA device: benchmarks/gpu_check.py measures the GPU backends and needs one (see docs/gpu.md)"
PARTS = ("kernels", "exactness", "decode", "serving")
DEVICE = "cuda"  # `--device cpu`: a smoke run of the script's own logic on tiny shapes (tests/test_gpu_check.py)
HEADER = ("part", "case", "result", "verdict")
NO_VERDICT = "-"
# Max abs error of a backend's attention output against the fp32 gather reference. fp32: the repo's tolerance for
# every in-place kernel (tests/test_triton.py TOLERANCE). bf16: the repo's bf16 tolerance for the same comparison
# (tests/test_triton.py test_half_precision_storage, tests/test_kernels.py TOLERANCE). Outputs here reach ~3.5 in
# magnitude, where bf16 values are 2**-6 = 1.6e-2 apart, so this is about one bf16 step of the output (the Triton
# kernel under the interpreter, fp32 products: 1.3e-2 to 1.5e-2 on these cases); a wrong mask, table or softmax is
# off by 1e-1 or more.
KERNEL_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# Max abs difference of the first step's scores (fp32 logits or log-probabilities) between a paged `generate` and
# DynamicCache's, in bf16: the repo's bf16 tolerance again. The tiny models' logits stay below 1 in magnitude (bf16
# spacing <= 2**-8), so this is a few roundings in the last layer; measured on the CPU (Triton interpreted, the CPU
# kernel): 2e-3 to 5e-3.
BF16_SCORES_TOLERANCE = 2e-2

Cells = tuple[str, str, str]  # (case, result, verdict): one row of a part
ENGINE_VARIANTS = {  # the serving part's Engine options (tokens compared with the first variant run)
    "exact": {"exact": True},
    "compiled": {"compile": True, "cuda_graphs": False},
    "graphs": {"compile": False, "cuda_graphs": True},
    "compiled+graphs": {"compile": True, "cuda_graphs": True},
}


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


def table_row(*cells: object) -> str:
    """One markdown table row; `|` in a cell is escaped and line breaks become spaces, so that every row has as many
    cells as `HEADER`."""
    return "| " + " | ".join(str(cell).replace("|", "\\|").replace("\n", " ") for cell in cells) + " |"


def within(error: float, tolerance: float) -> str:
    """`ok` when `error <= tolerance`, else `FAIL` (NaN fails)."""
    return "ok" if error <= tolerance else "FAIL"


def exactness_verdict(dtype: torch.dtype, tokens_equal: bool, scores_diff: float) -> str:
    """fp32: `ok` only when the tokens are equal. Half precision: `ok` when the first step's scores differ by at most
    `BF16_SCORES_TOLERANCE` (rounding may flip a near-tie, so the tokens may differ)."""
    if dtype == torch.float32:
        return "ok" if tokens_equal else "FAIL"
    return within(scores_diff, BF16_SCORES_TOLERANCE)


def speed_ratio(system: str, rate: float | None, baseline: str, baseline_rate: float | None) -> str:
    """`"paged 1.42x DynamicCache"`: `system`'s tokens/s over `baseline`'s; `n/a` when either did not run."""
    if not rate or not baseline_rate:
        return "n/a"
    return f"{system} {rate / baseline_rate:.2f}x {baseline}"


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


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


KERNEL_CASES = [  # (lengths, query counts, group, window, softcap); 2 KV heads, head_dim 128
    ([4000, 700, 33], [1, 1, 1], 4, None, None),
    ([4000, 700, 33], [1, 1, 1], 8, 1024, 30.0),
    ([1500, 300, 64], [512, 17, 64], 2, None, None),
    ([1500, 300, 64], [512, 17, 64], 4, 257, 50.0),
]


def kernel_error(backend, dtype: torch.dtype, block_size: int, scale: float) -> float | None:
    """The max abs error of `backend` against the fp32 gather reference over `KERNEL_CASES` (lengths times `scale`);
    `None` when the backend refuses the tensors."""
    from hf_paged.kernels.reference import gather_paged_attention

    worst = 0.0
    for seed, (lengths, counts, group, window, softcap) in enumerate(KERNEL_CASES):
        lengths = [max(1, int(n * scale)) for n in lengths]
        counts = [min(max(1, int(c * scale)), n) for c, n in zip(counts, lengths)]
        call = random_call(seed, lengths, counts, 2, group, 128, block_size, dtype, DEVICE)
        if not backend.supports(call[0], call[1]):
            return None
        out = backend.attention(*call, 128**-0.5, window, softcap, None)
        floats = [t.float() if t.is_floating_point() else t for t in call]
        want = gather_paged_attention(*floats, 128**-0.5, window, softcap)
        worst = max(worst, (out.float() - want).abs().max().item())
    return worst


def kernel_part(names: list[str], scale: float = 1.0) -> Iterator[Cells]:
    from hf_paged.kernels import flash, in_place_backend

    tolerances = ", ".join(f"{dtype_name(dtype)} {tolerance:.0e}" for dtype, tolerance in KERNEL_TOLERANCE.items())
    yield (
        "setup",
        f"each in-place backend vs the fp32 gather reference, {len(KERNEL_CASES)} random calls per row (GQA 2-8, "
        f"windows, softcap, mixed query counts, head_dim 128): max abs error; ok within {tolerances}",
        NO_VERDICT,
    )
    for name in names[1:]:
        backend = in_place_backend(name)
        for dtype, tolerance in KERNEL_TOLERANCE.items():
            for block_size in (16, 32, 256):
                case = f"{name} {dtype_name(dtype)}, block {block_size}"
                if name == "flash" and dtype == torch.float32:
                    yield case, "not run: flash-attn takes no fp32", "n/a"
                elif name == "flash" and not flash.accepts_block_size(block_size):
                    yield case, f"not run: flash-attn reads blocks of a multiple of {flash.BLOCK_MULTIPLE}", "n/a"
                elif (error := kernel_error(backend, dtype, block_size, scale)) is None:
                    yield case, f"not run: {name}.supports() refuses these tensors", "n/a"
                else:
                    yield case, f"max abs error {error:.2e}", within(error, tolerance)


# ---------------------------------------------------------------------- 2. generate vs DynamicCache
def exactness_part(names: list[str], new_tokens: int = 24) -> Iterator[Cells]:
    from hf_paged.reference_models import tiny_model

    yield (
        "setup",
        f"tiny Llama and Gemma2 (sliding window + softcap) generate {new_tokens} tokens, batch of 3, through each "
        f"backend vs DynamicCache; ok: fp32 tokens equal, bf16 first-step scores max diff <= "
        f"{BF16_SCORES_TOLERANCE:.0e}",
        NO_VERDICT,
    )
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
                    search = "beam 4" if beams > 1 else "greedy"
                    yield (
                        f"{family} {dtype_name(dtype)}, {name} block {block_size}, {search}",
                        f"tokens equal: {'yes' if same else 'NO'}; first-step scores max diff {first:.2e}; "
                        f"calls {calls}",
                        exactness_verdict(dtype, same, first),
                    )


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


def decode_part(args) -> Iterator[Cells]:
    model = medium_llama(args.layers, args.hidden)
    kernel = "auto"
    with contextlib.suppress(Exception):
        from hf_paged.kernels import resolve_kernel

        kernel = resolve_kernel("auto", DEVICE, args.block_size).backend
    yield (
        "setup",
        f"Llama {args.layers} layers x {args.hidden} ({dtype_name(next(model.parameters()).dtype)}, random weights), "
        f"{args.decode_tokens} new tokens, paged block size {args.block_size} (kernel {kernel}); each system: decode "
        "tokens/s, peak GiB added to the weights",
        NO_VERDICT,
    )
    for context in args.contexts:
        for batch in args.batches:
            tokens = batch * (context + args.decode_tokens)
            paged = {
                "cache_implementation": "paged",
                "cache_config": {"block_size": args.block_size, "num_blocks": tokens // args.block_size + 4 * batch},
            }
            systems = {  # on CUDA generate compiles the paged and the static cache's decode steps by itself
                "paged": paged,
                "paged eager": {**paged, "disable_compile": True},
                "DynamicCache": {},
                "StaticCache": {"cache_implementation": "static"},
            }
            rates, cells = {}, []
            for system, options in systems.items():
                try:
                    shape = (model, batch, context, args.decode_tokens)
                    decode_rate(*shape, **options)  # warm-up: compiles StaticCache
                    runs = [decode_rate(*shape, **options) for _ in range(args.repeats)]
                    rates[system] = statistics.median(rate for rate, _ in runs)
                    peak = max(peak for _, peak in runs)
                    cells.append(f"{system} {rates[system]:,.0f} tok/s ({peak:.1f} GiB)")
                except torch.OutOfMemoryError:
                    cells.append(f"{system} out of memory")
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
            verdict = "; ".join(
                speed_ratio("paged", rates.get("paged"), baseline, rates.get(baseline))
                for baseline in ("DynamicCache", "StaticCache")
            )
            yield f"batch {batch}, context {context}", "; ".join(cells), verdict


# ---------------------------------------------------------------------- 4. serving
def serving_part(args) -> Iterator[Cells]:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from engine_throughput import run_generate_batch, workload

    import hf_paged

    model = medium_llama(args.layers, args.hidden)
    requests = workload(args.requests, args.scale, 2048, model.config.vocab_size)
    budget = args.budget_tokens
    yield (
        "setup",
        f"{args.requests} ShareGPT-like requests, KV budget {budget} tokens, Llama {args.layers} layers x "
        f"{args.hidden} (random weights), block size {args.block_size}; each system: tokens/s, wall s, peak GiB",
        NO_VERDICT,
    )
    params = [hf_paged.SamplingParams(max_new_tokens=n, eos_token_id=()) for _, n in requests]
    engine_rate, reference = None, None
    for variant in args.engine_variants if DEVICE == "cuda" else ["exact"]:  # graphs need CUDA
        engine = hf_paged.Engine(
            model, block_size=args.block_size, num_blocks=budget // args.block_size, progress=False,
            **ENGINE_VARIANTS[variant],
        )  # fmt: skip
        if engine.runner.compile:  # compile (and capture) before timing, on two short requests
            engine.generate([[1, 2, 3], [4, 5]], hf_paged.SamplingParams(max_new_tokens=4, eos_token_id=()))
        reset_peak()
        start = time.perf_counter()
        outputs = engine.generate([p for p, _ in requests], params)
        synchronize()
        elapsed = time.perf_counter() - start
        rate = sum(len(o.token_ids) for o in outputs) / elapsed
        tokens = [o.token_ids for o in outputs]
        reference = reference or tokens
        same = sum(a == b for a, b in zip(tokens, reference))
        runner = engine.runner
        graphs = runner.decode_graphs
        case = (
            f"hf_paged Engine {variant} (kernel {engine.cache.kernel.backend}; {runner.compiled_steps} compiled, "
            f"{runner.graph_steps} graph steps of {runner.num_steps}"
            f"{'' if graphs is None else f', sizes {list(graphs.sizes)} captured in {graphs.capture_s:.1f} s'})"
        )
        engine.close()
        first = args.engine_variants[0] if DEVICE == "cuda" else "exact"
        result = f"{rate:,.0f} tok/s, {elapsed:.1f} s, {peak_gib(DEVICE):.1f} GiB; {same}/{len(tokens)} as {first}"
        yield case, result, NO_VERDICT
        engine_rate = max(engine_rate or 0.0, rate)
    hf_paged.disable()  # transformers' own continuous batching, untouched
    if version("flash_attn") != "not installed":
        model.set_attn_implementation("flash_attention_2")
    graphs = DEVICE == "cuda"  # its own CUDA graphs on, as the Engine's decode graphs are
    case = f"generate_batch ({model.config._attn_implementation}, use_cuda_graph={graphs})"
    reset_peak()
    try:
        elapsed, generated, *_ = run_generate_batch(model, requests, budget, args.block_size, graphs or None)
    except Exception as error:  # noqa: BLE001 (the baseline failing is reported; the Engine's row stands)
        yield case, f"failed: {type(error).__name__}: {error}"[:200], "n/a"
        return
    finally:
        hf_paged.enable()
    rate = generated / elapsed
    result = f"{rate:,.0f} tok/s, {elapsed:.1f} s, {peak_gib(DEVICE):.1f} GiB"
    yield case, result, speed_ratio("Engine (fastest variant)", engine_rate, "generate_batch", rate)


def run_parts(parts: dict[str, Callable[[], Iterator[Cells]]]) -> None:
    """Print the table: the header, then each part's rows as they come (flushed), its wall time, or one `failed`
    row when it raises (the next part still runs)."""
    print(table_row(*HEADER))
    print("|" + "---|" * len(HEADER), flush=True)
    for part, rows in parts.items():
        start = time.perf_counter()
        try:
            for cells in rows():
                print(table_row(part, *cells), flush=True)
        except Exception as error:  # noqa: BLE001 (one failing part must not hide the others)
            failed = f"failed after {time.perf_counter() - start:.0f} s"
            print(table_row(part, failed, f"{type(error).__name__}: {error}"[:300], "FAIL"), flush=True)
            continue
        print(table_row(part, "wall time", f"{time.perf_counter() - start:.0f} s", NO_VERDICT), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--contexts", nargs="+", type=int, default=[512, 2048, 8192])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed generates per decode shape and system (median)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=None, help="default: 256 with flash-attn, else 16")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--budget-tokens", type=int, default=65536)
    parser.add_argument("--scale", type=float, default=1.0, help="of the workload's lengths")
    parser.add_argument(
        "--engine-variants", nargs="+", default=["exact", "graphs", "compiled+graphs"], choices=list(ENGINE_VARIANTS),
        help="the serving part's Engines (on the CPU smoke run: exact only)",
    )  # fmt: skip
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
    on_cuda = DEVICE == "cuda"
    parts = {
        "kernels": lambda: kernel_part(names, 1.0 if on_cuda else 0.01),
        "exactness": lambda: exactness_part(names, 24 if on_cuda else 3),
        "decode": lambda: decode_part(args),
        "serving": lambda: serving_part(args),
    }
    run_parts({part: parts[part] for part in args.parts})
    return 0


if __name__ == "__main__":
    sys.exit(main())
