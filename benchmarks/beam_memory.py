"""Beam search on shared copy-on-write pages vs DynamicCache: peak KV bytes, KV bytes copied per step, wall time.

One prompt of `--prompt` random tokens, `--new` new tokens forced (min_new_tokens), `num_beams` in `--beams`, greedy
beam search with DynamicCache and with cache_implementation="paged" (block size 16), alternating, `--repeats` times;
wall time is the median, memory figures are the same on every run.

- DynamicCache: KV bytes are the sizes of its K/V tensors, read after every update and reorder; every step its
  `reorder_cache` copies the whole cache (index_select).
- paged: peak KV bytes = most distinct blocks held x bytes per block; bytes copied = copy-on-write block copies x
  bytes per block. A reorder only permutes block tables.
Both caches also read the whole context once per layer per step to attend (concatenation vs block-table gather);
that traffic is the same on both sides and is not counted as a copy here.

Usage: python benchmarks/beam_memory.py [--models tiny smollm2] [--beams 4 8] [--prompt 128] [--new 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import environment, load_model, markdown_table
from transformers import DynamicCache

import hf_paged


class KVMeter:
    """Records DynamicCache K/V bytes after each update and each reorder (which copies them all)."""

    def __init__(self):
        self.peak = self.copied = self.steps = 0

    @staticmethod
    def nbytes(cache) -> int:
        return sum(
            t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values) if t is not None
        )

    def __enter__(self):
        meter, update, reorder = self, DynamicCache.update, DynamicCache.reorder_cache
        self._originals = update, reorder

        def metered_update(cache, *args, **kwargs):
            out = update(cache, *args, **kwargs)
            meter.peak = max(meter.peak, meter.nbytes(cache))
            return out

        def metered_reorder(cache, beam_idx):
            reorder(cache, beam_idx)
            meter.copied += meter.nbytes(cache)
            meter.steps += 1

        DynamicCache.update, DynamicCache.reorder_cache = metered_update, metered_reorder
        return self

    def __exit__(self, *exc):
        DynamicCache.update, DynamicCache.reorder_cache = self._originals


def run(model, num_beams: int, prompt: int, new: int, paged: bool):
    input_ids = torch.randint(3, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    kwargs = dict(
        input_ids=input_ids,
        num_beams=num_beams,
        min_new_tokens=new,
        max_new_tokens=new,
        pad_token_id=0,
        do_sample=False,
        return_dict_in_generate=True,
    )
    start = time.perf_counter()
    if paged:
        out = model.generate(**kwargs, cache_implementation="paged", cache_config={"block_size": 16})
        seconds = time.perf_counter() - start
        stats = out.past_key_values.stats()
        per_block = hf_paged.get_pool(model).kv_shape.bytes_per_block_token * stats.block_size
        out.past_key_values.release()
        return out.sequences, stats.peak_blocks * per_block, stats.cow_copies * per_block / new, seconds
    with KVMeter() as meter:
        out = model.generate(**kwargs)
    seconds = time.perf_counter() - start
    return out.sequences, meter.peak, meter.copied / max(meter.steps, 1), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    parser.add_argument("--beams", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(environment() + "\n")
    rows = []
    for name in args.models:
        model, label = load_model(name)
        for num_beams in args.beams:
            runs = {False: [], True: []}
            for _ in range(args.repeats):
                for paged in (False, True):
                    runs[paged].append(run(model, num_beams, args.prompt, args.new, paged=paged))
            dyn, pag = ((*runs[p][0][:3], statistics.median(r[3] for r in runs[p])) for p in (False, True))
            same = "yes" if torch.equal(dyn[0], pag[0]) else "NO"
            mib = 2**20
            rows.append(
                [
                    label,
                    num_beams,
                    f"{dyn[1] / mib:.2f}",
                    f"{pag[1] / mib:.2f}",
                    f"{pag[1] / dyn[1]:.2f}",
                    f"{dyn[2] / mib:.3f}",
                    f"{pag[2] / mib:.4f}",
                    f"{dyn[3]:.1f}",
                    f"{pag[3]:.1f}",
                    f"{dyn[3] / pag[3]:.2f}x",
                    same,
                ]
            )
            print(rows[-1], flush=True)
    print()
    print(
        markdown_table(
            [
                "model",
                "beams",
                "peak KV MiB Dynamic",
                "peak KV MiB paged",
                "paged / Dynamic",
                "MiB copied/step Dynamic",
                "MiB copied/step paged",
                "s Dynamic",
                "s paged",
                "speed-up",
                "same tokens",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
