"""`Engine`: continuous batching over a model's global block pool."""

from __future__ import annotations

import dataclasses
import itertools
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence

import torch
from transformers import GenerationConfig

from ..adapters import AdapterSet, LoraAdapter
from ..batch_cache import BatchCache
from ..config import ATTENTION_NAME, PagedCacheConfig
from ..cpu_linear import check_cpu_linear, onednn_available, pack_linears, packed_linears, unpack_linears
from ..forward import EAGER, own_attention, paged_attention_for
from ..planner import ForwardPlanner
from ..structured.grammar import DEAD_END, accept_all, request_constraint
from ..support import cache_not_taken, check_cache_kept, prompt_learning_method
from .params import SamplingParams
from .prompts import (
    Prompt,
    as_prompt_list,
    check_stop_strings,
    masked_pad,
    per_prompt,
    prompt_token_ids,
    sampling_params,
)
from .recorder import StatsRecorder
from .request import Request, RequestOutput, RequestStatus
from .routing import OutputRouter
from .sampler import next_tokens, token_logprobs
from .scheduler import Scheduler, Step
from .stats import EngineStats, LatencyHistograms
from .step_runner import StepRunner, check_compile, check_cuda_graphs, decode_graph_sizes, resolve_compile
from .text import TextTracker

DEAD_END_MESSAGE = (
    "structured output reached a dead end: no token continues the response format under the request's other options "
    "(min_new_tokens, logit_bias)"
)


class Engine:
    """Serve many prompts at once on one model: requests join and leave the running batch every step.

    Every step is one forward of the stock model over the engine's paged cache. Under hf_paged's attention (the
    default for SDPA models) a step packs one token of every decoding request together with prompt tokens of
    newly admitted requests (or the next chunk of a long prompt) into one sequence with no pad position, within
    `max_num_batched_tokens` tokens; with no request decoding it prefills up to `max_prefill_tokens` prompt
    tokens. Under a stock attention (eager models) a step either prefills or decodes, rows right-aligned. Cached
    prompt prefixes are reused. Requests hold blocks only for the tokens they have; finished or aborted requests
    free them the same step; when the pool runs out mid-decode the most recently admitted request is preempted and
    later recomputed, with the same output.

    Args:
        model (`PreTrainedModel`): a decoder-only model; its global pool is used (`hf_paged.get_pool`).
        tokenizer (*optional*): needed for string prompts, `text` in outputs and stop strings.
        max_batch_size (`int`): most requests running at once.
        max_prefill_tokens (`int`): most prompt tokens in one step (padded positions, rows x width, under a stock
            attention); a longer prompt is prefilled in chunks.
        max_num_batched_tokens (`int`): most tokens in one packed step while requests decode (their tokens plus
            prompt tokens), so each next token of a decoding request waits for at most one such step however long
            the prompts arriving; at least `max_batch_size`. Raise it where a forward over many tokens costs little
            more than over few (a GPU); lower it for shorter stalls.
        progress (`bool`, *optional*): tqdm bar in `generate`; by default only when stderr is a terminal.
        adapters (`dict`, *optional*): LoRA adapters to serve from this one base model, `{name: source}`, a
            source being a directory saved by PEFT or a `(LoraConfig, state dict)` pair (see `load_adapter`);
            a request picks one with `add_request(..., adapter=name)`.
        max_adapters (`int`): most LoRA adapters resident at once.
        max_rank (`int`): the largest LoRA rank accepted.
        cpu_linear (`str`): `"stock"` (default) or `"onednn"`: pack the weights of the model's `nn.Linear` layers on
            the CPU once for oneDNN's matmul, much faster at decoding's small steps on some CPUs; outputs then differ
            from the unpacked model's by float rounding (see `hf_paged.cpu_linear`). `close()` unpacks them.
        compile (`bool` or `"auto"`): run packed steps through `torch.compile` of the model's forward (see
            `engine.step_runner`): faster steps (docs/benchmarks.md) whose outputs differ from eager `generate`'s by
            float rounding; the first steps pay the compile. `"auto"` (default): compiled unless `exact=True` or
            compiled steps cannot run here (`step_runner.resolve_compile`; `engine.runner.compile` says which).
        exact (`bool`): eager steps, bit-exact with `generate` (no compiling).
        cuda_graphs (`bool` or `"auto"`): replay decode steps from CUDA graphs captured per batch size (padded up
            to the next captured size; `engine.decode_graphs`), over the compiled forward where steps compile.
            `"auto"` (default): on for a CUDA model whose steps compile; `True` asks for them over eager steps too.
        **cache_config: pool options (`block_size`, `num_blocks`, `max_memory`, `prefix_caching`, `kernel`,
            `kv_dtype` (`"int8"`, `"int4"`: quantized pages), `kv_offload` (tiers behind the prefix cache:
            `{"dir": PATH, "remote": "redis://..."}`, see `hf_paged.offload`), ...), or
            `cache_config=` a dict or `PagedCacheConfig` of them, as `generate` takes it.

    Example:

    ```python
    >>> import hf_paged, torch
    >>> from hf_paged.reference_models import tiny_model
    >>> model = tiny_model("llama")
    >>> engine = hf_paged.Engine(model, block_size=4, num_blocks=64, exact=True)  # eager steps: generate's tokens
    >>> outputs = engine.generate([[1, 2, 3], [4, 5, 6, 7, 8]], max_new_tokens=4)
    >>> [len(o.token_ids) for o in outputs], outputs[0].finish_reason
    ([4, 4], 'length')
    >>> expected = model.generate(torch.tensor([[4, 5, 6, 7, 8]]), max_new_tokens=4, do_sample=False)
    >>> outputs[1].token_ids == expected[0, 5:].tolist()
    True
    >>> engine.pool.stats().num_used
    0

    ```
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer=None,
        *,
        max_batch_size: int = 64,
        max_prefill_tokens: int = 4096,
        max_num_batched_tokens: int = 512,
        progress: bool | None = None,
        adapters: Mapping | None = None,
        max_adapters: int = 8,
        max_rank: int = 64,
        cpu_linear: str = "stock",
        compile: bool | str = "auto",
        exact: bool = False,
        cuda_graphs: bool | str = "auto",
        **cache_config,
    ):
        _check_options(model, max_batch_size, max_prefill_tokens, max_num_batched_tokens, cpu_linear, compile, exact)
        check_cuda_graphs(cuda_graphs, exact, model)
        self.adapters = AdapterSet(model, max_adapters, max_rank)
        self.model = model
        self.tokenizer = tokenizer
        self.progress = progress
        nested = cache_config.pop("cache_config", None)  # generate's spelling
        if nested is not None:
            cache_config = {**PagedCacheConfig.from_dict(nested).options(), **cache_config}
        self.cache_config = PagedCacheConfig.from_dict(cache_config)
        self.planner = ForwardPlanner.for_model(model, self.cache_config, caller="Engine")
        self.pool = self.planner.pool
        self.cache = BatchCache(model, self.planner, self.cache_config.kernel)
        text_config = model.config.get_text_config(decoder=True)
        self.max_context = getattr(text_config, "max_position_embeddings", None)
        self.pad_token_id = _pad_token_id(model, tokenizer)
        self.device = model.get_input_embeddings().weight.device
        self.scheduler = Scheduler(
            self.planner, max_batch_size, max_prefill_tokens, self.device, max_num_batched_tokens
        )
        self.cpu_linear = cpu_linear
        self._packed_linears = 0  # layers this engine packed (and unpacks on close)
        if cpu_linear == "onednn" and not packed_linears(model):
            self._packed_linears = pack_linears(model)
        self.exact = exact
        compile = resolve_compile(compile, exact, cpu_linear, model)
        self.runner = StepRunner(model, self.cache, self.adapters, self.pad_token_id, compile)
        if cuda_graphs is True or (cuda_graphs == "auto" and compile and self.device.type == "cuda"):
            self.runner.capture_decode_graphs(decode_graph_sizes(max_batch_size))
        self._lock = threading.RLock()
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._router = OutputRouter()  # each generate/stream call's outputs go to it, whoever steps
        self._last_stats: EngineStats | None = None  # of the last generate
        self._stepped_since_last_stats = False  # steps ran since (stream, or the caller driving step())
        self.recorder = StatsRecorder()
        self.reset_stats()
        for name, source in (adapters or {}).items():
            self.load_adapter(name, source)

    # ------------------------------------------------------------------ adapters
    def load_adapter(self, name: str, source) -> LoraAdapter:
        """Make LoRA adapter `name` resident, read from `source`: a directory saved by PEFT's `save_pretrained`,
        a `(LoraConfig or its dict, state dict)` pair, or a `LoraAdapter` read already. Requests then run on it
        with `adapter=name`, in the same steps as the base model's and other adapters' requests. Refused
        (`ValueError`, nothing loaded) when the name is taken, its rank is above `max_rank`, `max_adapters` are
        resident, or it does not fit the base model; other adapter types and LoRA variants (DoRA, biases,
        `modules_to_save`, embedding targets) raise `NotImplementedError` naming them."""
        if _has_adapter_layers(self.model):
            raise ValueError(
                "per-request LoRA adapters need the plain base model; this model holds PEFT adapter layers "
                "(serve model.get_base_model(), or merge_and_unload() it)"
            )
        with self._lock:
            self._release_unused_adapters()
            return self.adapters.load(name, source)

    def unload_adapter(self, name: str) -> None:
        """Take adapter `name` out of service: new requests can no longer name it (and a new adapter may take the
        name), while requests already added on it run to their end on its weights, which stay resident (and count
        towards `max_adapters`) until the last of them finishes. `UnknownAdapterError` (a `ValueError`) for an
        unknown name."""
        with self._lock:
            self.adapters.unload(name)
            self._release_unused_adapters()

    def _release_unused_adapters(self) -> None:
        if self.adapters.num_resident > len(self.adapters):
            in_use = [r.adapter for r in self._requests.values() if r.adapter is not None and not r.finished]
            self.adapters.release_unused(in_use)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size as it is now (`resize_token_embeddings` changes it)."""
        return self.model.config.get_text_config(decoder=True).vocab_size

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: Prompt,
        generation_config: GenerationConfig | SamplingParams | None = None,
        *,
        request_id: str | None = None,
        adapter: str | None = None,
        **options,
    ) -> str:
        """Queue one prompt (a string, with a tokenizer, or token ids); returns its request id. `adapter` names the
        LoRA adapter it runs on (`None`: the base model); an unknown name raises `ValueError`.

        Options are `SamplingParams` fields (`max_new_tokens`, `do_sample`, `temperature`, `top_k`, `top_p`,
        `repetition_penalty`, `eos_token_id`, `stop`/`stop_strings`, `seed`, `min_new_tokens`,
        `frequency_penalty`, `presence_penalty`, `logit_bias`, `logprobs`, `response_format`) over
        `generation_config` (default: the model's). A `response_format` is compiled here: one that cannot be honoured
        raises `ResponseFormatError` (a `ValueError`) and nothing is queued.
        """
        params = sampling_params(generation_config, options, self.model.generation_config)
        bad_bias = [token for token, _ in params.logit_bias if token >= self.vocab_size]
        if bad_bias:
            raise ValueError(f"logit_bias token ids must be in [0, {self.vocab_size}), got {bad_bias[:5]}")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"logprobs must be at most the vocabulary size {self.vocab_size}, got {params.logprobs}")
        prompt_ids = prompt_token_ids(prompt, self.tokenizer, self.vocab_size, self.max_context)
        if params.stop:
            check_stop_strings(params.stop, self.tokenizer)
        response_format, constraint = params.response_format, None
        if response_format is not None:
            constraint = request_constraint(self.tokenizer, self.vocab_size, response_format, params.eos_token_id)
        generator = None
        if params.do_sample:
            if params.seed is None:
                params = params.with_seed(int(torch.randint(0, 2**62, (1,))))
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        with self._lock:
            if request_id is None:
                request_id = f"req-{next(self._ids)}"
                while request_id in self._requests:  # a caller chose this one
                    request_id = f"req-{next(self._ids)}"
            elif request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            lora = None if adapter is None else self.adapters.get(adapter)
            text = None if self.tokenizer is None else TextTracker(self.tokenizer, params.stop, prompt_ids)
            request = Request(request_id, prompt_ids, params, text, generator, adapter=lora, constraint=constraint)
            self._requests[request_id] = request
            if params.max_new_tokens == 0:
                request.finish("length")
            else:
                self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its output, or `None` when it had finished already (its
        final output not yet reported by `step()`). The next `step()` reports it as finished too (for `stream`).

        Raises:
            KeyError: the engine does not know `request_id`: never added, or finished and already reported by
                `step()` (then forgotten).
        """
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                raise KeyError(f"no request {request_id!r} in this engine (never added, or finished and reported)")
            if request.finished:
                return None
            self.scheduler.finish(request, "abort")
            return request.output()  # the next step() reports it once more, to whoever streams it

    def has_unfinished_requests(self) -> bool:
        """Whether a request is queued, running, or finished but not yet reported by `step()`."""
        with self._lock:
            return bool(self._requests)

    @property
    def skip_window(self) -> int | None:
        """The widest window by which sliding layer groups skip blocks (see `PagedCache.skip_window`); setting it
        overrides every sliding group's (`None`: keep every block)."""
        return self.planner.layout.skip_window

    @skip_window.setter
    def skip_window(self, window: int | None) -> None:
        with self._lock:
            self.cache.skip_window = window

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_steps(self) -> int:
        """Forwards run since the last `reset_stats()` (cheap, unlike `stats()`)."""
        return self.recorder.counters["steps"]

    @property
    def step_counts(self) -> dict[str, int]:
        """Since the last `reset_stats()` (cheap): forwards by kind (`prefill`, `decode`, `mixed`), positions the
        model computed, and pad positions among them."""
        return self.recorder.step_counts

    @property
    def prefix_hit_rate(self) -> float:
        """Share of admitted prompt tokens taken from the prefix cache since the last `reset_stats()` (cheap)."""
        return self.recorder.prefix_hit_rate

    @property
    def latency(self) -> LatencyHistograms:
        """Latency histograms since the engine was created (what `/metrics` shows)."""
        return self.recorder.latency

    @property
    def adapter_counts(self) -> dict[str | None, dict[str, int]]:
        """Finished requests, prompt and generated tokens per adapter (`None`: the base model), never reset."""
        return self.recorder.adapter_counts

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Run one forward (prefill or decode) and return the output of every request that changed; finished
        requests are reported once and forgotten. The outputs of requests a `generate` or `stream` call is
        collecting go to that call, whoever steps; final outputs of other requests that such a call's steps
        produced are reported by the next `step()`."""
        check_cache_kept(self.model)  # refused before anything changes: the requests wait for the model to be fixed
        with self._lock:
            self.pool.follow_model_dtype(self.model)  # `model.to(dtype)` while nothing runs
            changed = [r for r in self._requests.values() if r.finished]  # max_new_tokens=0, or failed earlier
            if self.planner.prefix_caching:  # the weights may have been trained since the last step
                self.planner.refresh_root(self.model, [request.row for request in self.scheduler.running])
            # an eager model runs the "hf_paged" attention in eager math: packed steps, stock eager's outputs
            self._implementation = paged_attention_for(self.model, self.cache_config, keep_eager=False)
            self.scheduler.packed = self._implementation == ATTENTION_NAME
            self.cache.eager_math = self.scheduler.packed and own_attention(self.model) == EAGER
            step, failed = self.scheduler.schedule()
            changed += failed
            if step is not None:
                changed += self._run(step)
                self._stepped_since_last_stats = True
            self.recorder.last_step_time = time.perf_counter()
            outputs = []
            for request in dict.fromkeys(changed):
                outputs.append(request.output())
                if request.finished:
                    self.recorder.finished(request)
                    self._requests.pop(request.request_id, None)
            self._release_unused_adapters()
            return self._router.route(outputs)

    def _run(self, step: Step) -> list[Request]:
        """Run `step`; returns the requests that got a token (a prompt chunk short of the end gets none)."""
        self.recorder.admitted(step, time.perf_counter())
        try:
            logits = self._forward(step)
            done = [i for i, r in enumerate(step.requests) if r.row.num_tokens == r.num_tokens]
            sampled = [step.requests[i] for i in done]
            tokens, logprobs = [], []
            if sampled:
                if len(done) < logits.shape[0]:  # else every row: no copy (64 x 49,152 fp32 logits: 0.5 ms a step)
                    logits = logits[done]
                tokens = next_tokens(sampled, logits)
                logprobs = token_logprobs(sampled, logits, tokens)
        except BaseException as error:
            self.cache.detach()
            for request in step.requests:
                self.scheduler.finish(request, "error", f"{type(error).__name__}: {error}")
            raise
        self.recorder.stepped(step)
        constrained = [i for i, r in enumerate(sampled) if r.constraint is not None and tokens[i] != DEAD_END]
        accept_all([sampled[i].constraint for i in constrained], [tokens[i] for i in constrained])  # their masks'
        for request, token, logprob in zip(sampled, tokens, logprobs):
            if token == DEAD_END:
                self.scheduler.finish(request, "error", DEAD_END_MESSAGE)
                continue
            previous = request.last_token_time
            try:
                request.append_token(token, logprob)
            except Exception as error:  # its text failed (the tokenizer cannot decode the token): it alone ends
                self.scheduler.finish(
                    request, "error", f"decoding token {token} failed: {type(error).__name__}: {error}"
                )
                continue
            self.recorder.token(request, previous)
            reason = self._finish_reason(request, token)
            if reason is not None:
                self.scheduler.finish(request, reason)
        return sampled

    def _forward(self, step: Step) -> torch.Tensor:
        self.cache.run(step.batch)
        compiled, replayed = self.runner.compiled_steps, self.runner.graph_steps
        logits, positions = self.runner.forward(step, self._implementation)
        runner = self.runner
        self.recorder.forward(step, positions, runner.compiled_steps > compiled, runner.graph_steps > replayed)
        return logits

    def _finish_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        generated = len(request.output_token_ids)
        if token in params.eos_token_id and generated >= params.min_new_tokens:
            return "stop"
        if request.text is not None and request.text.stopped:
            return "stop"
        if request.constraint is not None and request.constraint.terminated:
            return "stop"  # the response format is complete (with no end-of-sequence token to wait for)
        if generated >= params.max_new_tokens:
            return "length"
        if self.max_context is not None and request.num_tokens >= self.max_context:
            return "length"
        return None

    # ------------------------------------------------------------------ batch APIs
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        generation_config: GenerationConfig | SamplingParams | Sequence | None = None,
        *,
        progress: bool | None = None,
        **options,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in input order (token ids, text with a tokenizer, finish
        reason). `generation_config` may be one config for all prompts or one per prompt; `options` apply to all.
        A request that can never fit in the pool finishes alone with `finish_reason="error"`."""
        prompts = as_prompt_list(prompts, self.masked_pad(generation_config, options))
        configs = per_prompt(generation_config, len(prompts))
        self.reset_stats()
        ids = self._add_all(prompts, configs, options)
        try:
            results = self._drive(ids, progress)
        except BaseException:  # an error or an interrupt: nobody will collect this call's requests
            self._forget(ids)
            raise
        self.last_stats = self.stats()
        return [results[i] for i in ids]

    @property
    def last_stats(self) -> EngineStats | None:
        """`EngineStats` of the engine's last run: those of the last `generate` call when it returns; after steps
        run any other way (`stream`, or the caller driving `step()`), the counters since the last `reset_stats()`
        as of the last step. `None` before any step."""
        if self._stepped_since_last_stats:
            return self.stats()
        return self._last_stats

    @last_stats.setter
    def last_stats(self, stats: EngineStats | None) -> None:
        self._last_stats = stats
        self._stepped_since_last_stats = False

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        generation_config: GenerationConfig | SamplingParams | Sequence | None = None,
        **options,
    ) -> Iterator[RequestOutput]:
        """Like `generate`, but yields each request's incremental output (`new_token_ids`, `new_text`) as steps
        produce it. Closing the iterator early aborts the requests not yet finished."""
        prompts = as_prompt_list(prompts, self.masked_pad(generation_config, options))
        configs = per_prompt(generation_config, len(prompts))
        pending = set(self._add_all(prompts, configs, options))
        try:
            yield from self._collect(pending)
        finally:
            self._forget(pending)  # the caller stopped listening: nobody needs their final report

    def masked_pad(self, generation_config, options: dict) -> int | None:
        """The pad token `generate` masks in a tensor of token ids given without an attention mask (see
        `prompts.masked_pad`)."""
        return masked_pad(generation_config, options, self.model.generation_config)

    def _add_all(self, prompts: list, configs: list, options: dict) -> list[str]:
        """Queue every prompt, or none: a bad prompt or option leaves nothing of the call queued."""
        ids: list[str] = []
        try:
            for prompt, config in zip(prompts, configs):
                ids.append(self.add_request(prompt, config, **options))
        except BaseException:
            self._forget(ids)
            raise
        return ids

    def _forget(self, request_ids) -> None:
        """Abort those of `request_ids` still unfinished and drop them all unreported (their caller is gone)."""
        with self._lock:
            for request_id in request_ids:
                request = self._requests.pop(request_id, None)
                if request is None:
                    continue
                if not request.finished:
                    self.scheduler.finish(request, "abort")
                self.recorder.finished(request)

    def _drive(self, ids: list[str], progress: bool | None) -> dict[str, RequestOutput]:
        from tqdm.auto import tqdm

        show = progress if progress is not None else self.progress
        show = sys.stderr.isatty() if show is None else show
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="hf_paged", unit="req", disable=not show) as bar:
            for output in self._collect(set(ids)):
                if output.finished:
                    results[output.request_id] = output
                    bar.update(1)
        return results

    def _collect(self, pending: set[str]) -> Iterator[RequestOutput]:
        """This call's outputs until its requests `pending` finish (`OutputRouter.collect`)."""
        return self._router.collect(self.step, pending)

    # ------------------------------------------------------------------ stats and shutdown
    def reset_stats(self) -> None:
        with self._lock:
            self.recorder.reset(self.scheduler.num_preemptions)
            self.pool.reset_peak()

    def stats(self) -> EngineStats:
        """Counters since the last `reset_stats()` (see `EngineStats`)."""
        with self._lock:
            stats = self.recorder.snapshot(
                self.scheduler.num_preemptions,
                self.pool.stats().peak_used,
                self.cache.kernel.backend,
                dict(self.cache.attention_calls),
            )
        offload = self.pool.offload
        return stats if offload is None else dataclasses.replace(stats, kv_tiers=tuple(offload.stats().tiers))

    def close(self) -> None:
        """Abort every request and return all blocks to the pool."""
        with self._lock:
            for request_id in list(self._requests):
                self.abort(request_id)
            self._requests.clear()
            self.runner.close()
            self.cache.detach()
            self.adapters.release_unused(())
            if self._packed_linears:
                unpack_linears(self.model)
                self._packed_linears = 0

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ input checks


def _has_adapter_layers(model: torch.nn.Module) -> bool:
    tuners = sys.modules.get("peft.tuners.tuners_utils")  # not imported: no adapter layer can exist
    return tuners is not None and any(isinstance(m, tuners.BaseTunerLayer) for m in model.modules())


def _pad_token_id(model, tokenizer) -> int:
    for source in (model.generation_config, tokenizer):
        value = getattr(source, "pad_token_id", None)
        if isinstance(value, int):
            return value
    return 0


def _check_options(
    model, max_batch_size, max_prefill_tokens, max_num_batched_tokens, cpu_linear, compile, exact
) -> None:
    """Refuse options out of range or in conflict, and models the Engine cannot serve, before anything is built."""
    limits = {
        "max_batch_size": max_batch_size,
        "max_prefill_tokens": max_prefill_tokens,
        "max_num_batched_tokens": max_num_batched_tokens,
    }
    for name, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if max_num_batched_tokens < max_batch_size:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_batch_size "
            f"({max_batch_size}): a step holds one token of every running request"
        )
    _check_cpu_linear(cpu_linear, model)
    check_compile(compile, exact, cpu_linear)
    reason = cache_not_taken(model)
    if reason is not None:
        raise NotImplementedError(f"the Engine cannot serve this model: {reason}")
    method = prompt_learning_method(model)
    if method is not None:
        raise NotImplementedError(
            f"the Engine cannot serve a PEFT {method} model: it adds learned virtual tokens (or K/V) to every "
            "forward, which the Engine's steps do not hold (adapters that change weights, such as LoRA, are served)"
        )


def _check_cpu_linear(cpu_linear, model: torch.nn.Module) -> None:
    """Refuse a `cpu_linear` this model or torch cannot run, before anything is built."""
    if check_cpu_linear(cpu_linear) != "onednn":
        return
    device = model.get_input_embeddings().weight.device
    if device.type != "cpu":
        raise ValueError(f"cpu_linear='onednn' packs CPU weights, but the model is on {device}; use cpu_linear='stock'")
    if not onednn_available():
        raise ValueError(
            f"cpu_linear='onednn' needs torch's oneDNN CPU matmul, which torch {torch.__version__} here lacks; use "
            "cpu_linear='stock'"
        )


__all__ = ["Engine", "RequestStatus"]
