"""`Engine`: continuous batching over a model's global block pool."""

from __future__ import annotations

import itertools
import operator
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
from ..support import cache_not_taken, check_cache_kept, prompt_learning_method
from .params import SamplingParams
from .request import Request, RequestOutput, RequestStatus
from .routing import OutputRouter
from .sampler import next_tokens, token_logprobs
from .scheduler import Scheduler, Step
from .stats import EngineStats, LatencyHistograms, Reservoir, percentile
from .step_runner import StepRunner, check_compile
from .text import TextTracker

Prompt = str | Sequence[int]


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
        compile (`bool`): run packed steps through `torch.compile` of the model's forward (inductor), with the paged
            attention and K/V writes as custom ops (see `engine.step_runner`); outputs then differ from eager
            `generate`'s by float rounding. Compiling fails over to eager steps with one warning.
        **cache_config: pool options (`block_size`, `num_blocks`, `max_memory`, `prefix_caching`, `kernel`,
            `kv_dtype` (`"int8"`, `"int4"`: quantized pages), ...), or
            `cache_config=` a dict or `PagedCacheConfig` of them, as `generate` takes it.

    Example:

    ```python
    >>> import hf_paged, torch
    >>> from hf_paged.reference_models import tiny_model
    >>> model = tiny_model("llama")
    >>> engine = hf_paged.Engine(model, block_size=4, num_blocks=64)
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
        compile: bool = False,
        **cache_config,
    ):
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
        check_compile(compile)
        if compile and cpu_linear != "stock":
            raise ValueError(
                f"compile=True with cpu_linear={cpu_linear!r}: compiled steps pack the linear weights themselves "
                "(inductor's freezing), and Dynamo cannot trace hf_paged's packed layers; choose one"
            )
        reason = cache_not_taken(model)
        if reason is not None:
            raise NotImplementedError(f"the Engine cannot serve this model: {reason}")
        method = prompt_learning_method(model)
        if method is not None:
            raise NotImplementedError(
                f"the Engine cannot serve a PEFT {method} model: it adds learned virtual tokens (or K/V) to every "
                "forward, which the Engine's steps do not hold (adapters that change weights, such as LoRA, are served)"
            )
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
        self.runner = StepRunner(model, self.cache, self.adapters, self.pad_token_id, compile)
        self._lock = threading.RLock()
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._router = OutputRouter()  # each generate/stream call's outputs go to it, whoever steps
        self._last_stats: EngineStats | None = None  # of the last generate
        self._stepped_since_last_stats = False  # steps ran since (stream, or the caller driving step())
        self.latency = LatencyHistograms()  # since the engine was created: what /metrics shows
        self.adapter_counts: dict[str | None, dict[str, int]] = {}  # per adapter (None: base), never reset
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
        `frequency_penalty`, `presence_penalty`, `logit_bias`, `logprobs`) over `generation_config` (default: the
        model's).
        """
        params = self._params(generation_config, options)
        bad_bias = [token for token, _ in params.logit_bias if token >= self.vocab_size]
        if bad_bias:
            raise ValueError(f"logit_bias token ids must be in [0, {self.vocab_size}), got {bad_bias[:5]}")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"logprobs must be at most the vocabulary size {self.vocab_size}, got {params.logprobs}")
        prompt_ids = self._prompt_ids(prompt)
        if params.stop:
            _check_stop_strings(params.stop, self.tokenizer)
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
            request = Request(request_id, prompt_ids, params, text, generator, adapter=lora)
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
        return self._counters["steps"]

    @property
    def step_counts(self) -> dict[str, int]:
        """Since the last `reset_stats()` (cheap): forwards by kind (`prefill`, `decode`, `mixed`), positions the
        model computed, and pad positions among them."""
        c = self._counters
        return {
            "prefill": c["prefill_steps"],
            "decode": c["decode_steps"],
            "mixed": c["mixed_steps"],
            "positions": c["positions_computed"],
            "pads": c["pad_positions"],
        }

    @property
    def prefix_hit_rate(self) -> float:
        """Share of admitted prompt tokens taken from the prefix cache since the last `reset_stats()` (cheap)."""
        counters = self._counters
        reused, admitted = counters["prefix_tokens_reused"], counters["admitted_tokens"]
        return reused / admitted if admitted else 0.0

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
            self._last_step_time = time.perf_counter()
            outputs = []
            for request in dict.fromkeys(changed):
                outputs.append(request.output())
                if request.finished:
                    self._account_finished(request)
                    self._requests.pop(request.request_id, None)
            self._release_unused_adapters()
            return self._router.route(outputs)

    def _run(self, step: Step) -> list[Request]:
        """Run `step`; returns the requests that got a token (a prompt chunk short of the end gets none)."""
        now = time.perf_counter()
        for request in step.admitted:
            if request.admission_time is None:  # its first admission (a preempted request was admitted before)
                request.admission_time = now
                self.latency.request_queue_time.observe(now - request.arrival_time)
        self._counters["admitted_tokens"] += sum(r.num_tokens for r in step.admitted)
        self._counters["prefix_tokens_reused"] += sum(  # a step's blocks are taken: its chunk is in the rows
            r.row.num_tokens - count for r, count in zip(step.requests, step.new_tokens) if r in step.admitted
        )
        try:
            logits = self._forward(step)
            done = [i for i, r in enumerate(step.requests) if r.row.num_tokens == r.num_tokens]
            sampled = [step.requests[i] for i in done]
            tokens, logprobs = [], []
            if sampled:
                logits = logits[done]
                tokens = next_tokens(sampled, logits)
                logprobs = token_logprobs(sampled, logits, tokens)
        except BaseException as error:
            self.cache.detach()
            for request in step.requests:
                self.scheduler.finish(request, "error", f"{type(error).__name__}: {error}")
            raise
        self._counters["steps"] += 1
        self._counters[f"{step.kind}_steps"] += 1
        latency = self.latency
        for request, token, logprob in zip(sampled, tokens, logprobs):
            previous = request.last_token_time
            try:
                request.append_token(token, logprob)
            except Exception as error:  # its text failed (the tokenizer cannot decode the token): it alone ends
                self.scheduler.finish(
                    request, "error", f"decoding token {token} failed: {type(error).__name__}: {error}"
                )
                continue
            if previous is None:
                latency.time_to_first_token.observe(request.first_token_time - request.arrival_time)
            else:
                latency.inter_token_latency.observe(request.last_token_time - previous)
            reason = self._finish_reason(request, token)
            if reason is not None:
                self.scheduler.finish(request, reason)
        return sampled

    def _forward(self, step: Step) -> torch.Tensor:
        self.cache.run(step.batch)
        compiled = self.runner.compiled_steps
        logits, positions = self.runner.forward(step, self._implementation)
        self._counters["compiled_steps"] += self.runner.compiled_steps - compiled
        self._counters["positions_computed"] += positions
        self._counters["pad_positions"] += positions - sum(step.new_tokens)
        return logits

    def _finish_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        generated = len(request.output_token_ids)
        if token in params.eos_token_id and generated >= params.min_new_tokens:
            return "stop"
        if request.text is not None and request.text.stopped:
            return "stop"
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
        configs = _per_prompt(generation_config, len(prompts))
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
        configs = _per_prompt(generation_config, len(prompts))
        pending = set(self._add_all(prompts, configs, options))
        try:
            yield from self._collect(pending)
        finally:
            self._forget(pending)  # the caller stopped listening: nobody needs their final report

    def masked_pad(self, generation_config, options: dict) -> int | None:
        """The pad token `generate` masks in a tensor of token ids given without an attention mask: the config's
        `pad_token_id`, unless it is also an end-of-sequence token (then `generate` cannot tell pads apart)."""
        config = generation_config if isinstance(generation_config, GenerationConfig) else self.model.generation_config
        pad = config.pad_token_id
        eos = options.get("eos_token_id")
        if eos is None:
            eos = getattr(generation_config, "eos_token_id", None)
        if eos is None:
            eos = config.eos_token_id
        eos = [] if eos is None else [eos] if _is_token(eos) else list(eos)
        return None if pad is None or pad in eos else pad

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
                self._account_finished(request)

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
            self._counters = dict.fromkeys(
                (
                    "num_requests",
                    "prompt_tokens",
                    "generated_tokens",
                    "steps",
                    "prefill_steps",
                    "decode_steps",
                    "admitted_tokens",
                    "prefix_tokens_reused",
                    "mixed_steps",
                    "positions_computed",
                    "pad_positions",
                    "compiled_steps",
                ),
                0,
            )
            self._ttfts = Reservoir()  # bounded: a long-running engine keeps a sample, not every request's
            self._ttft_sum = 0.0
            self._preemptions_at_reset = self.scheduler.num_preemptions
            self._start_time = self._last_step_time = time.perf_counter()
            self.pool.reset_peak()

    def stats(self) -> EngineStats:
        """Counters since the last `reset_stats()` (see `EngineStats`)."""
        with self._lock:
            c = self._counters
            elapsed = max(self._last_step_time - self._start_time, 1e-9)
            return EngineStats(
                num_requests=c["num_requests"],
                prompt_tokens=c["prompt_tokens"],
                generated_tokens=c["generated_tokens"],
                elapsed_s=elapsed,
                requests_per_s=c["num_requests"] / elapsed,
                tokens_per_s=c["generated_tokens"] / elapsed,
                mean_ttft_s=self._ttft_sum / self._ttfts.count if self._ttfts.count else None,
                p90_ttft_s=percentile(self._ttfts.values, 0.9),
                num_steps=c["steps"],
                prefill_steps=c["prefill_steps"],
                decode_steps=c["decode_steps"],
                mixed_steps=c["mixed_steps"],
                positions_computed=c["positions_computed"],
                pad_positions=c["pad_positions"],
                preemptions=self.scheduler.num_preemptions - self._preemptions_at_reset,
                peak_blocks=self.pool.stats().peak_used,
                prefix_hit_rate=self.prefix_hit_rate,
                attention_kernel=self.cache.kernel.backend,
                attention_calls=dict(self.cache.attention_calls),
                compiled_steps=c["compiled_steps"],
            )

    def _account_finished(self, request: Request) -> None:
        counts = self.adapter_counts.setdefault(
            request.adapter_name, {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0}
        )
        counts["requests"] += 1
        counts["prompt_tokens"] += len(request.prompt_token_ids)
        counts["generated_tokens"] += len(request.output_token_ids)
        self._counters["num_requests"] += 1
        self._counters["prompt_tokens"] += len(request.prompt_token_ids)
        self._counters["generated_tokens"] += len(request.output_token_ids)
        if request.first_token_time is not None:
            ttft = request.first_token_time - request.arrival_time
            self._ttfts.add(ttft)
            self._ttft_sum += ttft
        if request.finish_reason in ("stop", "length") and request.finish_time is not None:
            self.latency.e2e_request_latency.observe(request.finish_time - request.arrival_time)

    def close(self) -> None:
        """Abort every request and return all blocks to the pool."""
        with self._lock:
            for request_id in list(self._requests):
                self.abort(request_id)
            self._requests.clear()
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
    def _params(self, generation_config, options: dict) -> SamplingParams:
        if isinstance(generation_config, SamplingParams):
            return SamplingParams.from_generation_config(None, **{**_fields(generation_config), **options})
        config = generation_config if generation_config is not None else self.model.generation_config
        return SamplingParams.from_generation_config(config, **options)

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, Mapping):  # a tokenizer's output (apply_chat_template's)
            prompts = _encoded_prompts(prompt)
            if len(prompts) != 1:
                raise ValueError(f"one prompt was expected, got a tokenizer output of {len(prompts)}")
            prompt = prompts[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer: Engine(model, tokenizer)")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif hasattr(prompt, "ndim") and hasattr(prompt, "tolist"):  # a torch tensor or a numpy array
            if prompt.ndim > 2 or (prompt.ndim == 2 and prompt.shape[0] != 1):
                raise ValueError(
                    f"a prompt tensor must be 1-D or [1, length], got shape {tuple(prompt.shape)} (several prompts: "
                    "add them one by one, or pass the tensor to generate)"
                )
            ids = prompt.reshape(-1).tolist()
        elif isinstance(prompt, Sequence):
            if any(isinstance(t, Mapping) and "role" in t for t in prompt):
                raise ValueError(f"got chat messages: {CHAT_TEMPLATE_HINT}")
            ids = [operator.index(t) if _is_token(t) else t for t in prompt]  # numpy integers are token ids too
        else:
            raise ValueError(f"a prompt must be a string or a sequence of token ids, got {type(prompt).__name__}")
        bad = out_of_vocabulary(ids, self.vocab_size)
        if bad:
            raise ValueError(f"token ids must be ints in [0, {self.vocab_size}), got {bad[:5]}")
        if not ids:
            raise ValueError("the prompt is empty; a request needs at least one token")
        if self.max_context is not None and len(ids) >= self.max_context:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; the model's context window is {self.max_context} tokens"
            )
        return ids


def _has_adapter_layers(model: torch.nn.Module) -> bool:
    tuners = sys.modules.get("peft.tuners.tuners_utils")  # not imported: no adapter layer can exist
    return tuners is not None and any(isinstance(m, tuners.BaseTunerLayer) for m in model.modules())


def out_of_vocabulary(token_ids, vocab_size: int) -> list:
    """The entries of `token_ids` that are no token id of a `vocab_size` vocabulary (not an int, or out of range)."""
    return [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]


def _pad_token_id(model, tokenizer) -> int:
    for source in (model.generation_config, tokenizer):
        value = getattr(source, "pad_token_id", None)
        if isinstance(value, int):
            return value
    return 0


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


CHAT_TEMPLATE_HINT = (
    "apply the chat template first, e.g. tokenizer.apply_chat_template(messages, add_generation_prompt=True)"
)


def _check_stop_strings(stop: tuple[str, ...], tokenizer) -> None:
    """Refuse stop strings without a tokenizer, and those holding a special token's text: the text they are
    searched in skips special tokens (end on such a token with `eos_token_id` instead)."""
    if tokenizer is None:
        raise ValueError(f"stop strings {list(stop)} need a tokenizer: Engine(model, tokenizer)")
    specials = set(getattr(tokenizer, "all_special_tokens", ()))
    specials |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    for text in stop:
        for special in sorted(specials):
            if special and special in text:
                token_id = tokenizer.convert_tokens_to_ids(special)
                raise ValueError(
                    f"stop string {text!r} holds the special token {special!r} (id {token_id}), which the text stop "
                    f"strings are searched in never shows (special tokens are skipped); end on it with "
                    f"eos_token_id={token_id} instead"
                )


def as_prompt_list(prompts, masked_pad: int | None = None) -> list:
    """One prompt (a string, token ids, a 1-D tensor or array) or several (a list of them, a 2-D tensor or array,
    a tokenizer's output) as a list of prompts. A 2-D tensor or array holding `masked_pad` loses those positions,
    as `generate` masks them when it is given no attention mask."""
    if isinstance(prompts, Mapping):
        return _encoded_prompts(prompts)
    if hasattr(prompts, "ndim") and hasattr(prompts, "tolist"):  # a torch tensor or a numpy array
        if prompts.ndim not in (1, 2):
            raise ValueError(f"a tensor of prompts must be 1-D or 2-D, got shape {tuple(prompts.shape)}")
        if prompts.ndim == 1:
            return [prompts.tolist()]
        rows = prompts.tolist()
        if masked_pad is not None and any(masked_pad in row for row in rows):
            rows = [[token for token in row if token != masked_pad] for row in rows]
        return rows
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and _is_token(prompts[0])):
        return [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(
            f"prompts must be a string, token ids, a tensor, or a non-empty list of these, got {prompts!r:.80}"
        )
    return list(prompts)


def _encoded_prompts(encoding: Mapping) -> list[list[int]]:
    """The prompts of a tokenizer's output (a `BatchEncoding`, as `apply_chat_template` returns, or a dict): its
    `input_ids`, one prompt or a batch, without the positions its `attention_mask` marks as padding."""
    if "input_ids" not in encoding:
        if "role" in encoding:
            raise ValueError(f"got a chat message: {CHAT_TEMPLATE_HINT}")
        raise ValueError(f"a mapping of prompts needs input_ids (a tokenizer's output), got keys {sorted(encoding)}")
    ids, mask = encoding["input_ids"], encoding.get("attention_mask")
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    mask = mask.tolist() if hasattr(mask, "tolist") else mask
    if ids and _is_token(ids[0]):  # one prompt
        ids, mask = [ids], None if mask is None else [mask]
    if mask is None:
        return ids
    return [[token for token, keep in zip(row, keep_row) if keep] for row, keep_row in zip(ids, mask)]


def _is_token(value) -> bool:
    """Whether `value` is one token id (an int, a numpy integer or a 0-d integer tensor; not a bool)."""
    if isinstance(value, bool | float):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _per_prompt(generation_config, count: int) -> list:
    if isinstance(generation_config, Sequence) and not isinstance(generation_config, str):
        if len(generation_config) != count:
            raise ValueError(f"{len(generation_config)} generation configs for {count} prompts")
        return list(generation_config)
    return [generation_config] * count


__all__ = ["Engine", "RequestStatus"]


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
