"""Resident memory a process keeps after `generate` returns: stock `DynamicCache` vs the paged pool (default CPU
sizing, and a small explicit pool), and what `hf_paged.release_pool(model)` gives back.

Workload: the README quick start (SmolLM2-135M-Instruct in fp32, its two chat questions left-padded,
`max_new_tokens=24`, greedy; with `--workloads beams` also its 4-beam call). Each cache runs in a fresh interpreter,
so allocations never mix. Each one reads its RSS (`/proc/self/status`): after loading the model and reading its
weights once (the safetensors file is memory-mapped: without this, the first forward adds the weights' file pages
to RSS in every mode alike), after each of `--calls` identical `generate` calls, after dropping the output and, for
the paged modes, `hf_paged.release_pool(model)`, then `gc.collect()`, and after glibc's `malloc_trim(0)` (which hands
freed heap memory back to the system). Next to the growth it reports the pool's own pages: how many bytes of the
pool's K/V tensors are resident after the last call (`/proc/self/pagemap`) and the most blocks in use at once x
bytes per block. The pool's tensors are allocated at full size (`torch.empty`), but a page becomes resident only
when a block on it is first written (or, on glibc's heap, when an earlier allocation of that memory wrote it).
`--model tiny` runs a 2-layer Llama on random prompts of the quick start's lengths instead. Linux only.

`--mmap-thresholds 0 65536` measures everything twice: with glibc's default malloc (0), which keeps freed memory
of its heap for later allocations, and with `MALLOC_MMAP_THRESHOLD_=65536` in the measuring processes, where every
allocation of 64 KiB or more is a mapping of its own that goes back to the system when freed: the pool's tensors are
then fresh pages, so their resident bytes are exactly the pages the pool's blocks touched.

Usage: python benchmarks/memory_after_generate.py [--model smollm2|tiny] [--workloads greedy beams]
    [--modes stock paged paged-64MiB] [--calls 2] [--threads N] [--mmap-thresholds 0 65536]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import weakref

MIB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")
MODES = {  # mode -> (label, cache_config of the paged cache; None: stock DynamicCache)
    "stock": ("DynamicCache", None),
    "paged": ("paged, default CPU sizing", {"block_size": 16}),
    "paged-64MiB": ('paged, max_memory="64MiB"', {"block_size": 16, "max_memory": "64MiB"}),
}
QUESTIONS = ["What is the capital of France?", "Name a prime number larger than 10."]
TINY_PROMPT_LENGTHS = (29, 40)
STAGES = {"release": "after release + gc", "malloc_trim": "then malloc_trim"}


def rss_bytes() -> dict[str, int]:
    """`VmRSS`, `RssAnon` and `RssFile` of this process, in bytes."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile"):
                fields[name] = int(value.split()[0]) * 1024
    return fields


def resident_pages(address: int, length: int, chunk: int = 8192):
    """Yield the number of every resident page of `[address, address + length)`, read from `/proc/self/pagemap`
    (bit 63 of a page's entry, readable without privileges) `chunk` pages at a time, allocating next to nothing."""
    first, last = address // PAGE, (address + length - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as pagemap:
        for start in range(first, last + 1, chunk):
            pagemap.seek(start * 8)
            high_bytes = pagemap.read(8 * min(chunk, last + 1 - start))[7::8]
            yield from (start + i for i, byte in enumerate(high_bytes) if byte >= 0x80)


def pool_resident_bytes(pool) -> int:
    """Resident bytes of the pool's K/V tensors (every lane, quantization scales included)."""
    storage = pool.storage
    tensors = [
        t for lanes in (storage.keys, storage.values, storage.key_scales, storage.value_scales) for t in lanes.values()
    ]
    return PAGE * sum(1 for t in tensors for _ in resident_pages(t.data_ptr(), t.numel() * t.element_size()))


def malloc_trim() -> bool:
    """glibc's `malloc_trim(0)`: hand freed heap memory back to the system; `False` where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def quick_start_inputs(model_name: str):
    """`(model, inputs)`: the quick start's model and its two left-padded chat prompts (for "tiny", a 2-layer
    Llama and random prompts of the same lengths)."""
    import torch

    if model_name == "tiny":
        from hf_paged.reference_models import tiny_model

        width = max(TINY_PROMPT_LENGTHS)
        ids = torch.randint(3, 128, (len(TINY_PROMPT_LENGTHS), width), generator=torch.Generator().manual_seed(0))
        mask = torch.tensor([[0] * (width - n) + [1] * n for n in TINY_PROMPT_LENGTHS])
        inputs = {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "pad_token_id": 0}
        return tiny_model("llama"), inputs
    from hf_paged.reference_models import load_smollm2

    model, tokenizer = load_smollm2()
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    return model, dict(tokenizer(prompts, return_tensors="pt", padding=True))


def read_weights(model) -> None:
    """Read every parameter once, so memory-mapped weights are resident before the baseline."""
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.sum()


def generate_options(mode: str, workload: str) -> dict:
    """`generate` keyword arguments of the quick-start call for `workload` with `mode`'s cache."""
    options = {"max_new_tokens": 24, "do_sample": False}
    if workload == "beams":
        options["num_beams"] = 4
    cache_config = MODES[mode][1]
    if cache_config is not None:
        options.update(cache_implementation="paged", cache_config=dict(cache_config))
    return options


def pool_report(pool) -> dict:
    """The pool's size, bytes per block, most blocks in use at once, and its tensors' resident bytes."""
    stats = pool.stats()
    return dict(
        num_blocks=stats.num_blocks,
        block_bytes=stats.block_bytes,
        peak_used=stats.peak_used,
        resident=pool_resident_bytes(pool),
    )


def measure(mode: str, workload: str, model_name: str, calls: int) -> dict:
    """Run the workload `calls` times in this process; RSS after every stage (bytes) and the pool's report."""
    import hf_paged

    paged = MODES[mode][1] is not None
    model, inputs = quick_start_inputs(model_name)
    read_weights(model)
    gc.collect()
    stages, report = {"load": rss_bytes()}, {}
    for call in range(calls):
        out = model.generate(**inputs, **generate_options(mode, workload))
        gc.collect()
        stages[f"generate {call + 1}"] = rss_bytes()
    if paged:
        report = pool_report(hf_paged.get_pool(model))
        pool = weakref.ref(hf_paged.get_pool(model))
        hf_paged.release_pool(model)
    del out
    gc.collect()
    stages["release"] = rss_bytes()
    report["pool_freed"] = not paged or pool() is None
    stages["malloc_trim"] = rss_bytes() if malloc_trim() else None
    return {"stages": stages, "pool": report}


def run_child(mode: str, workload: str, threshold: int, args) -> dict:
    """`measure` in a fresh interpreter (this script with `--child`), with `MALLOC_MMAP_THRESHOLD_=threshold`
    unless it is 0; its result."""
    command = [sys.executable, os.path.abspath(__file__), "--child", mode, "--workloads", workload]
    command += ["--model", args.model, "--calls", str(args.calls), "--threads", str(args.threads)]
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    if threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def shown_stages(calls: int) -> list[str]:
    """The stages a table shows: generate 1, 2 and the last one, the release, malloc_trim."""
    generates = sorted({1, min(2, calls), calls})
    return [f"generate {n}" for n in generates] + list(STAGES)


def growth(measured: dict, stage: str) -> float | None:
    """VmRSS growth (MiB) from the baseline to `stage` (`None` where the stage could not run)."""
    fields = measured["stages"][stage]
    return None if fields is None else (fields["VmRSS"] - measured["stages"]["load"]["VmRSS"]) / MIB


def table_row(workload: str, mode: str, measured: dict, calls: int) -> list[str]:
    """One markdown row: RSS after load, its growth after each stage, the pool's resident pages and peak blocks."""
    cells = [workload, MODES[mode][0], f"{measured['stages']['load']['VmRSS'] / MIB:.1f}"]
    cells += ["n/a" if (g := growth(measured, stage)) is None else f"{g:+.1f}" for stage in shown_stages(calls)]
    pool = measured["pool"]
    if "resident" not in pool:
        return cells + ["-", "-"]
    block_kib, peak_mib = pool["block_bytes"] / 1024, pool["peak_used"] * pool["block_bytes"] / MIB
    reserved = pool["num_blocks"] * pool["block_bytes"] / MIB
    return cells + [
        f"{pool['resident'] / MIB:.1f} of {reserved:.0f}",
        f"{pool['peak_used']} x {block_kib:.0f} KiB = {peak_mib:.1f}",
    ]


def headers(calls: int) -> list[str]:
    stages = [STAGES.get(stage, f"after {stage}") for stage in shown_stages(calls)]
    return [
        "workload",
        "cache",
        "RSS after load, MiB",
        *stages,
        "pool tensors resident, MiB of reserved",
        "peak blocks x block bytes, MiB",
    ]


def differences(results: dict, calls: int) -> list[str]:
    """Per workload and paged mode: its RSS growth minus DynamicCache's after the last call, the release and
    malloc_trim (none without a DynamicCache row)."""
    lines = []
    for (workload, mode), measured in results.items():
        stock = results.get((workload, "stock"))
        if mode == "stock" or stock is None:
            continue
        cells = []
        for stage in (f"generate {calls}", *STAGES):
            paged, base = growth(measured, stage), growth(stock, stage)
            if paged is not None and base is not None:
                cells.append(f"{paged - base:+.1f} MiB {STAGES.get(stage, 'after ' + stage)}")
        lines.append(f"{workload}, {MODES[mode][0]} minus DynamicCache: " + ", ".join(cells))
    return lines


def report(threshold: int, args) -> None:
    """Measure every workload and mode with one glibc setting; print its table and differences."""
    from common import markdown_table

    results = {(w, m): run_child(m, w, threshold, args) for w in args.workloads for m in args.modes}
    setting = f"MALLOC_MMAP_THRESHOLD_={threshold}" if threshold else "glibc's default malloc settings"
    print(f"### {setting}\n")
    rows = [table_row(w, m, measured, args.calls) for (w, m), measured in results.items()]
    print(markdown_table(headers(args.calls), rows) + "\n")
    print("\n".join([*differences(results, args.calls), ""]))
    freed = all(measured["pool"]["pool_freed"] for measured in results.values())
    print(f"pool objects garbage after release_pool + gc: {'yes' if freed else 'NO'}\n")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=["tiny", "smollm2"])
    parser.add_argument("--workloads", nargs="+", default=["greedy"], choices=["greedy", "beams"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--calls", type=int, default=2, help="identical generate calls before the release")
    parser.add_argument("--threads", type=int, default=0, help="torch threads of each process (0: torch's default)")
    parser.add_argument("--mmap-thresholds", nargs="+", type=int, default=[0], help="0: glibc's default")
    parser.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(measure(args.child, args.workloads[0], args.model, args.calls)))
        return
    from common import environment

    print(f"{environment()}; each cache in its own process\n")
    for threshold in args.mmap_thresholds:
        report(threshold, args)
    print("command: python benchmarks/memory_after_generate.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
