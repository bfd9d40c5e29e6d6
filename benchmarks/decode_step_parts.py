"""Where a decode step's time goes, paged vs `DynamicCache`, side by side in one run: the attention calls (for
paged, the in-place kernel's share of them), the cache writes (`update`), the paged cache's planning
(`PagedCache.prepare_forward`) and the rest of the step (the model's own layers, sampling, `generate`'s loop).

Each part is timed by wrapping the function that does it (the registered `"sdpa"` and `"hf_paged"` attention
functions, `kernels.cpu.attention`, `DynamicCache.update`, `BatchCache.update`, `PagedCache.prepare_forward`) and
summed per decode step; the prefill forward is left out. Times are medians over the steps of `--rounds` `generate`
calls per cache (after one warm-up call each), so the wrappers' own cost (about a microsecond a call) is included in
every part alike.

Usage: python benchmarks/decode_step_parts.py [--batch 1] [--context 128] [--new-tokens 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch
from common import environment, load_model, markdown_table, timing
from decode_speed import StepClock, greedy_decode
from transformers import AttentionInterface, DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_paged  # noqa: F401  (registers cache_implementation="paged")
from hf_paged import batch_cache, cache
from hf_paged.kernels import cpu

PARTS = ["attention", "kernel", "cache writes", "planning"]
HEADERS = ["cache", "batch", "context", "step ms", *[f"{part} ms" for part in PARTS], "rest ms"]


class StepParts(StepClock):
    """Sums the time of each wrapped part per forward; called after every forward (noting the time, as `StepClock`),
    it starts the next one's sums."""

    def __init__(self):
        super().__init__()
        self.step = 0
        self.parts: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def __call__(self, input_ids, scores, **kwargs):
        self.step += 1
        return super().__call__(input_ids, scores, **kwargs)

    def timed(self, part: str, function):
        def add(seconds: float) -> None:
            self.parts[self.step][part] += seconds

        return timing(function, add)


def install(recorder: StepParts) -> None:
    """Wrap every timed function (once per process)."""
    for name in ("sdpa", "hf_paged"):
        AttentionInterface.register(name, recorder.timed("attention", ALL_ATTENTION_FUNCTIONS[name]))
    cpu.attention = recorder.timed("kernel", cpu.attention)
    DynamicCache.update = recorder.timed("cache writes", DynamicCache.update)
    batch_cache.BatchCache.update = recorder.timed("cache writes", batch_cache.BatchCache.update)
    cache.PagedCache.prepare_forward = recorder.timed("planning", cache.PagedCache.prepare_forward)


def decode_parts(model, recorder: StepParts, input_ids, new_tokens: int, options: dict) -> list[dict[str, float]]:
    """Per decode step of one `generate` call: its wall time ("step") and the seconds of each part."""
    recorder.step, recorder.times = 0, []
    recorder.parts.clear()
    greedy_decode(model, input_ids, new_tokens, options, recorder)
    ends = recorder.times
    return [{"step": ends[step] - ends[step - 1], **recorder.parts[step]} for step in range(1, len(ends))]  # 0: prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=["tiny", "smollm2"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(environment() + "\n")
    model, _ = load_model(args.model)
    recorder = StepParts()
    install(recorder)
    generator = torch.Generator().manual_seed(args.batch * 10_000 + args.context)
    input_ids = torch.randint(3, model.config.vocab_size, (args.batch, args.context), generator=generator)
    caches = {"DynamicCache": {}, "paged": {"cache_implementation": "paged"}}
    steps = {name: [] for name in caches}
    for options in caches.values():  # warm-up (the kernel built or loaded)
        decode_parts(model, recorder, input_ids[:, :16], 4, options)
    for _ in range(args.rounds):
        for name, options in caches.items():
            steps[name].extend(decode_parts(model, recorder, input_ids, args.new_tokens, options))
    rows = []
    for name, measured in steps.items():
        median = {key: statistics.median(s.get(key, 0.0) for s in measured) * 1e3 for key in ["step", *PARTS]}
        rest = median["step"] - median["attention"] - median["cache writes"] - median["planning"]
        cells = [f"{median[part]:.2f}" if any(part in s for s in measured) else "-" for part in PARTS]
        rows.append([name, args.batch, args.context, f"{median['step']:.2f}", *cells, f"{rest:.2f}"])
    print(markdown_table(HEADERS, rows))


if __name__ == "__main__":
    main()
