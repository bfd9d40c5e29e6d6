"""The Triton kernel compiled ahead of time for a CUDA GPU (sm_90), on this machine: the interpreter
(tests/test_triton.py) runs the kernel's Python and would not see what only the compiler checks, such as branches
that return different types for half-precision pages. Triton ships its own PTX assembler, so this needs no GPU; it
runs in a child process because the kernel is defined as interpreted or compiled when triton is first imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

# (storage dtype, quantized bits, query heads per KV head, head_dim, block size, window, softcap, sinks, keys per
# channel: kv_dtype="int4-channel")
VARIANTS = [
    ("bfloat16", 0, 4, 128, 16, True, True, True, False),
    ("float16", 0, 1, 64, 256, False, False, False, False),
    ("float16", 0, 3, 80, 16, False, False, False, False),
    ("float32", 0, 8, 128, 32, True, False, True, False),
    ("bfloat16", 8, 2, 64, 16, False, True, False, False),
    ("float16", 4, 2, 64, 16, True, False, False, False),
    ("bfloat16", 4, 3, 64, 64, False, False, False, True),
    ("float32", 4, 2, 64, 64, True, True, True, True),
]
# (row lengths, queries per row, query heads per KV head, window, softcap) of the calls run on a CUDA device:
# decode rows, then mixed chunks with a window and softcap
DEVICE_CASES = [([300, 17, 64], [1, 1, 1], 4, None, None), ([300, 70, 64], [40, 17, 64], 2, 33, 30.0)]

COMPILE = textwrap.dedent(
    """
    import collections, inspect, json, re, sys
    import torch
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from hf_paged.kernels import triton as backend

    TARGET = GPUTarget("cuda", 90, 32)
    # what Triton's launcher assumes at run time of arguments like these: pointers of whole allocations 16-byte
    # aligned, and strides of 64-channel heads (k/v/q/out/companions/channel parameters) multiples of 16
    ALIGNED_STRIDES = re.compile(r"^(q|o|k|v|kp|st)_stride_(token|head|block|slot|two)$")
    WIDTH = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "b32": 4, "u32": 4, "f32": 4, "b64": 8}


    def global_loads(ptx):
        \"\"\"{bytes a load instruction moves: count} over the PTX's global loads (ld.global, cp.async).\"\"\"
        sizes = collections.Counter()
        for vector, width in re.findall(r"ld\\.global(?:\\.[a-z]+\\d*)*?(?:\\.v(\\d))?\\.([bsuf]\\d+)\\s", ptx):
            sizes[str(int(vector or 1) * WIDTH[width])] += 1
        for size in re.findall(r"cp\\.async\\.c[ag]\\.shared\\.global[^;]*,\\s*(0x[0-9a-f]+|\\d+)", ptx):
            sizes[str(int(size, 0))] += 1
        return dict(sizes)


    @triton.jit
    def probe(x):
        pass  # the smallest kernel: does this triton compile for CUDA at all?


    @triton.jit
    def byte_wise(codes, out, N: tl.constexpr):
        dims, keys = tl.arange(0, 64), tl.arange(0, N)  # a tile of N keys of 64 channels, 32 bytes a key
        packed = tl.load(codes + keys[None, :] * 32 + dims[:, None] // 2).to(tl.int32)  # every code its byte
        nibbles = tl.where(dims[:, None] % 2 == 0, packed & 15, packed >> 4).to(tl.float32)
        tl.store(out + keys, tl.sum(nibbles, axis=0))


    try:
        triton.compile(ASTSource(probe, {"x": "*fp32"}), target=TARGET)
    except Exception as error:
        print(json.dumps({"unavailable": f"{type(error).__name__}: {error}"[-400:]}))
        sys.exit(0)
    TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    kernel = backend._kernel()
    names = list(inspect.signature(kernel.fn).parameters)
    results = []
    for dtype, bits, group, head_dim, block_size, window, softcap, sinks, channel in json.loads(sys.argv[1]):
        dtype = getattr(torch, dtype)
        constants = backend.kernel_constants(dtype, group, head_dim, block_size, window, softcap, sinks, bits)
        if channel:
            constants.update(CHANNEL_KEYS=True, STAGING_TOKENS=10)
        pages = {0: TYPES[dtype], 8: "i8", 4: "u8"}[bits]
        pointers = dict(
            query_ptr=TYPES[dtype], out_ptr=TYPES[dtype], key_ptr=pages, value_ptr=pages, tables_ptr="i32",
            seq_lens_ptr="i32", query_start_ptr="i32", sinks_ptr="fp32", key_scales_ptr="bf16",
            value_scales_ptr="bf16", key_params_ptr="bf16", stage_ptr="i32", staging_ptr=TYPES[dtype],
            query_plain_ptr=TYPES[dtype],
        )
        constants.update({name: 1 for name in names if name.endswith("stride_dim")})  # specialized, as launched
        signature = {
            name: "constexpr" if name in constants else "*" + pointers[name] if name in pointers
            else "fp32" if name in ("scale", "softcap") else "i32"
            for name in names
        }
        aligned = [n for n in names if n not in constants and (n in pointers or ALIGNED_STRIDES.match(n))]
        source = ASTSource(
            kernel, signature, constexprs={(names.index(n),): v for n, v in constants.items()},
            attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
        )
        try:
            compiled = triton.compile(source, target=TARGET)
            results.append([len(compiled.asm["cubin"]), "", global_loads(compiled.asm["ptx"])])
        except Exception as error:  # the message names the failing line
            results.append([0, f"{type(error).__name__}: {error}"[-800:], {}])
    control = triton.compile(
        ASTSource(byte_wise, {"codes": "*u8", "out": "*fp32", "N": "constexpr"}, constexprs={(2,): 128},
                  attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}),
        target=TARGET,
    )
    print(json.dumps({"results": results, "control": global_loads(control.asm["ptx"])}))
    """
)


def compile_variants(variants: list[tuple], folder) -> dict:
    """`results`: [cubin bytes, error, {bytes a global load moves: loads in the PTX}] per variant, and `control`: the
    loads of a kernel that loads 4-bit codes a byte at a time; compiled in a child process without the interpreter
    (from a file: triton reads a kernel's source)."""
    script = folder / "compile_paged_attention.py"
    script.write_text(COMPILE)
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(script), json.dumps(variants)], env=env, capture_output=True, text=True, timeout=600
    )
    if done.returncode:
        pytest.fail(f"the compile script failed:\n{done.stderr[-3000:]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    if "unavailable" in answer:
        pytest.skip(f"this triton cannot compile for CUDA here: {answer['unavailable']}")
    return answer


def test_the_kernel_compiles_for_a_cuda_gpu_for_every_page_format(tmp_path):
    results = compile_variants(VARIANTS, tmp_path)["results"]
    failures = [f"{variant}: {error}" for variant, (size, error, _) in zip(VARIANTS, results, strict=True) if not size]
    assert not failures, "\n".join(failures)


def test_quantized_codes_load_as_vectors_never_a_byte_at_a_time(tmp_path):
    """int8 and 4-bit pages (per token and keys per channel) load their codes in vectors of bytes: the compiled
    kernel has no one-byte global load, each 4-bit byte loaded once and its two nibbles split in registers. The
    control, a kernel that addresses every 4-bit code's byte on its own, is all one-byte loads."""
    quantized = [variant for variant in VARIANTS if variant[1] and variant[3] == 64]
    answer = compile_variants(quantized, tmp_path)
    assert answer["control"].get("1", 0) >= 16, answer["control"]  # the detector sees byte-wise loads
    for variant, (size, error, loads) in zip(quantized, answer["results"], strict=True):
        assert size, error
        assert "1" not in loads, (variant, loads)
        assert sum(count for width, count in loads.items() if int(width) >= 8), (variant, loads)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32, 256])
def test_the_compiled_kernel_on_the_device_matches_the_reference(dtype, block_size):
    """On a CUDA device the kernel runs compiled (tests/test_triton.py runs it interpreted on the CPU only)."""
    from hf_paged import kernels
    from hf_paged.kernels.reference import gather_paged_attention

    from .test_kernels import TOLERANCE, random_call

    for seed, (lengths, counts, group, window, softcap) in enumerate(DEVICE_CASES):
        call = random_call(seed, lengths, counts, group=group, head_dim=128, block_size=block_size, dtype=dtype)
        call = [tensor.cuda() for tensor in call]
        out = kernels.paged_attention(*call, scale=128**-0.5, window=window, softcap=softcap, kernel="triton")
        floats = [tensor.float() if tensor.is_floating_point() else tensor for tensor in call]
        want = gather_paged_attention(*floats, 128**-0.5, window, softcap)
        assert (out.float() - want).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_pages_on_the_device_match_dequantize_then_reference(kv_dtype, dtype):
    """int8/int4 pages compiled on a CUDA device (tests/test_triton.py checks them under the interpreter)."""
    from hf_paged import kernels
    from hf_paged.kv_format import QuantizedPages, kv_format

    from .test_kernels import TOLERANCE, random_call

    fmt = kv_format(kv_dtype)
    for seed, (lengths, counts, group, window, softcap) in enumerate(DEVICE_CASES):
        call = random_call(seed, lengths, counts, group=group, head_dim=64, block_size=16, dtype=dtype)
        query, key_cache, value_cache, tables, lengths, starts = [tensor.cuda() for tensor in call]
        key_pages = QuantizedPages(fmt, *fmt.quantize(key_cache), dtype)
        value_pages = QuantizedPages(fmt, *fmt.quantize(value_cache), dtype)
        options = {"scale": 64**-0.5, "window": window, "softcap": softcap}
        pages = (key_pages, value_pages)
        got = kernels.paged_attention(query, *pages, tables, lengths, starts, kernel="triton", **options)
        dense = (key_pages.dequantize().float(), value_pages.dequantize().float())
        want = kernels.paged_attention(query.float(), *dense, tables, lengths, starts, kernel="gather", **options)
        assert got.dtype == dtype and (got.float() - want).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.gpu
def test_generate_on_quantized_pages_on_the_device_matches_stock_over_the_same_values():
    """fp32 generate on int8/int4 pages through the compiled kernel equals stock `generate` over a `DynamicCache`
    that stores the same quantized-then-dequantized K/V (greedy and beam 4)."""
    from hf_paged.reference_models import tiny_model

    from .quant_helpers import generate_round_trip

    model = tiny_model("llama").cuda()
    input_ids = torch.randint(3, 128, (2, 21), generator=torch.Generator().manual_seed(1)).cuda()
    for kv_dtype in ("int8", "int4"):
        for beams in (1, 4):
            options = {"max_new_tokens": 12, "do_sample": False, "num_beams": beams, "pad_token_id": 0}
            expected = generate_round_trip(model, kv_dtype, input_ids, **options)
            out = model.generate(
                input_ids,
                return_dict_in_generate=True,
                cache_implementation="paged",
                cache_config={"kernel": "triton", "block_size": 16, "kv_dtype": kv_dtype},
                **options,
            )
            assert torch.equal(out.sequences, expected), (kv_dtype, beams)
            assert set(out.past_key_values.attention_calls) == {"triton"}
            out.past_key_values.release()


def test_keys_a_step_follow_the_products_and_the_page_format(monkeypatch):
    """Half-precision products take 128 keys a step, fp32 64, fp32 over int8 pages 16 (measured on an H200:
    docs/gpu.md); `TILE_N`, when set, overrides them all."""
    from hf_paged.kernels import triton as backend

    monkeypatch.setattr(backend, "interpreted", lambda: False)
    tiles = {
        (dtype, bits): backend.kernel_constants(dtype, 4, 128, 16, False, False, False, bits)["TILE_N"]
        for dtype in (torch.bfloat16, torch.float16, torch.float32)
        for bits in (0, 8, 4)
    }
    assert tiles == {
        (torch.bfloat16, 0): 128, (torch.bfloat16, 8): 128, (torch.bfloat16, 4): 128,
        (torch.float16, 0): 128, (torch.float16, 8): 128, (torch.float16, 4): 128,
        (torch.float32, 0): 64, (torch.float32, 8): 16, (torch.float32, 4): 64,
    }  # fmt: skip
    monkeypatch.setattr(backend, "TILE_N", 32)
    assert backend.kernel_constants(torch.bfloat16, 4, 128, 16, False, False, False, 0)["TILE_N"] == 32
