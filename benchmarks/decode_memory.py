"""Peak resident memory a long-context decode adds on top of its cache: the paged cache with its in-place kernel,
with `kernel="gather"`, and `DynamicCache`, each in a fresh process, side by side in one run.

Each process prefills a batch of random prompts (SmolLM2-135M, fp32), then resets the kernel's peak-RSS mark
(`/proc/self/clear_refs`), decodes `--new-tokens` more tokens continuing the same cache, and reports the peak RSS of
the decode above the RSS it started from: the transient memory of the steps (the gather path's dense per-layer copy
of batch x context K/V, `DynamicCache`'s concatenation). Large allocations are returned to the system at once
(`MALLOC_MMAP_THRESHOLD_`), so RSS follows live memory. Linux only.

Usage: python benchmarks/decode_memory.py [--batch 8] [--contexts 1024 4096] [--new-tokens 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from common import environment, markdown_table

SYSTEMS = {"paged (in place)": "auto", "paged gather": "gather", "DynamicCache": None}
HEADERS = ["batch", "context", "cache", "KV held MiB", "decode peak above start MiB"]

CHILD = r"""
import json, sys, torch, hf_paged
from hf_paged.reference_models import load_smollm2

def rss_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])

batch, context, new_tokens, kernel = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
model, _ = load_smollm2()
ids = torch.randint(3, model.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
options = dict(do_sample=False, pad_token_id=0, return_dict_in_generate=True)
if kernel == "none":
    first = model.generate(ids, max_new_tokens=1, **options)
else:
    first = model.generate(ids, max_new_tokens=1, cache_implementation="paged",
                           cache_config={"kernel": kernel, "max_memory": "4GiB"}, **options)
cache = first.past_key_values
kv_bytes = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * (
    model.config.hidden_size // model.config.num_attention_heads) * 4 * batch * (context + new_tokens)
open("/proc/self/clear_refs", "w").write("5")  # peak RSS := RSS now
start = rss_kib("VmRSS:")
model.generate(first.sequences, attention_mask=torch.ones_like(first.sequences), past_key_values=cache,
               max_new_tokens=new_tokens, min_new_tokens=new_tokens, **options)
peak = rss_kib("VmHWM:")
print(json.dumps({"kv_mib": kv_bytes / 2**20, "peak_mib": (peak - start) / 1024}))
"""


def run(batch: int, context: int, new_tokens: int, kernel: str | None) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    args = [str(batch), str(context), str(new_tokens), kernel or "none"]
    result = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096])
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    print(environment() + "\n")
    rows = []
    for context in args.contexts:
        for name, kernel in SYSTEMS.items():
            measured = run(args.batch, context, args.new_tokens, kernel)
            rows.append([args.batch, context, name, f"{measured['kv_mib']:.0f}", f"{measured['peak_mib']:.0f}"])
            print(markdown_table(HEADERS, rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown_table(HEADERS, rows))


if __name__ == "__main__":
    main()
