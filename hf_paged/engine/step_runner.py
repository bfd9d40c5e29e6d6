"""`StepRunner`: the Engine's forward of one planned step, eager or compiled.

Planning stays on the host (`Scheduler` → `ForwardPlanner` → `ForwardBatch`); the runner turns the planned step into
the model's inputs and runs the model:

- **eager** (`compile=False`, bit-exact with `generate`): the model's own forward over the engine's `BatchCache`
  under the `"hf_paged"` attention, which finds the running `ForwardBatch` through the cache.
- **compiled** (`compile=True`): a step runs as one packed sequence (a decode step's rows one token each, a mixed
  step's rows one after another) through `torch.compile(fullgraph=True)` of the model's forward under the
  `"hf_paged_step"` attention (`hf_paged.step_attention`), with every paged tensor of the step passed in as
  `StepTensors`: the compiled region takes only tensors. The sizes that change from step to step (tokens, rows,
  block-table width) are graph inputs (`ops.mark_varying`), so one graph serves every packed step of a model; the
  compiled forward's outputs differ from the eager one's by float rounding (inductor fuses and reorders
  operations). Steps with LoRA adapters run a compiled forward of their own, the adapters' factors and masks passed
  in as `CompiledStepLora` (one forward per set of hooked modules: Dynamo does not guard on hooks). Other steps
  (the first, which allocates the pool's tensors; a stock attention's right-aligned steps, a right-aligned prefill
  with left pads) run eagerly. Over quantized pages the write and the attention are the ops' `*_quantized`
  variants (codes and scales). Decode steps may instead replay `DecodeGraphs` captured per batch size
  (`capture_decode_graphs`; on CUDA through the Engine's `cuda_graphs`). Where compiling fails (no C++ compiler for
  inductor, a model that breaks the graph), one warning names the error and every later step runs eagerly.

Inductor keeps its generated kernels in its on-disk caches (`TORCHINDUCTOR_CACHE_DIR`); a frozen graph is still
traced and frozen again in every process (about a minute for SmolLM2-135M on 2 CPU cores, docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import os
import warnings

import torch

from ..adapters.adapter_set import COMPILED_STEP, CompiledStepLora
from ..compiling import (
    COMPILE_ERRORS,
    FIRST_STEP_ERRORS,
    counting_graphs,
    cpp_compiler_unavailable,
    describe_error,
    fresh_function,
    unattended_layers,
)
from ..config import ATTENTION_NAME
from ..forward import attention_implementation
from ..kernels import ops
from ..prefix import prefix_namespace
from ..step_attention import STEP_ATTENTION_NAME, StepTensors, count_attention_calls, register_step_attention
from ..tensor_parallel import tensor_parallel_placement
from ..transfer import device_tensor
from .decode_graphs import DEFAULT_SIZES, DecodeGraphs

logger = logging.getLogger(__name__)

COMPILE_BACKEND = "inductor"  # torch.compile's backend for compiled steps (tests may swap it)
FREEZE = True  # inductor's freezing: weights folded into the graph (benchmarks/compiled_steps.py measures without)
# inductor's concat linear (CPU, with freezing): projections of one input (q/k/v, gate/up) run as one matmul, which two
# threads share better (SmolLM2, 2 threads: 1.03x-1.07x the tokens/s, the same tokens; docs/benchmarks.md)
CONCAT_LINEAR = True
CPP_WRAPPER_ENV = "HF_PAGED_CPP_WRAPPER"


def cpp_wrapper_from_env(value: str | None) -> bool:
    """Whether compiled CPU steps get inductor's host code in C++ (its "cpp wrapper") instead of Python, from the
    `HF_PAGED_CPP_WRAPPER` environment variable: unset or `1` yes (SmolLM2's step calls about 900 kernels and views,
    whose Python glue cost 4-9% of a step, docs/benchmarks.md), `0` no (compiling takes ~40% less time)."""
    if value is None or value.strip().lower() in ("", "1", "true", "yes", "on"):
        return True
    if value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{CPP_WRAPPER_ENV}={value!r}: expected 1 (C++ host code for compiled CPU steps) or 0 (Python)")


def adapters_cpp_wrapper_from_env(value: str | None) -> bool:
    """Whether the compiled forward of steps with LoRA adapters gets C++ host code too: only where
    `HF_PAGED_CPP_WRAPPER` is set to `1`. Unset, it gets Python's: for SmolLM2 with adapters on 120 modules, C++ host
    code took 230-244 s to compile against 63-83 s for Python's, for steps ~2% faster (docs/benchmarks.md), which a
    server running for hours may prefer and a notebook's first adapter request should not wait for."""
    return value is not None and value.strip() != "" and cpp_wrapper_from_env(value)


CPP_WRAPPER = cpp_wrapper_from_env(os.environ.get(CPP_WRAPPER_ENV))  # CUDA steps keep Python's host code
ADAPTERS_CPP_WRAPPER = adapters_cpp_wrapper_from_env(os.environ.get(CPP_WRAPPER_ENV))


def check_compile(value, exact: bool = False, cpu_linear: str = "stock") -> bool | str:
    """`value` as an Engine's `compile` option (`True`, `False` or `"auto"`) beside its `exact` and `cpu_linear`
    options, or `ValueError` naming what conflicts."""
    if not isinstance(value, bool) and value != "auto":
        raise ValueError(f"compile must be True, False or 'auto', got {value!r}")
    if not isinstance(exact, bool):
        raise ValueError(f"exact must be True or False, got {exact!r}")
    if exact and value is True:
        raise ValueError(
            "exact=True runs the eager steps, bit-exact with generate; compile=True runs compiled steps, whose outputs "
            "differ from generate's by float rounding: choose one"
        )
    if exact and cpu_linear != "stock":
        raise ValueError(
            f"exact=True keeps the model's own linear layers; cpu_linear={cpu_linear!r} packs them, which changes "
            "outputs by float rounding: choose one"
        )
    if value is True and cpu_linear != "stock":
        raise ValueError(
            f"compile=True with cpu_linear={cpu_linear!r}: compiled steps pack the linear weights themselves "
            "(inductor's freezing), and Dynamo cannot trace hf_paged's packed layers; choose one"
        )
    return value


def resolve_compile(value, exact: bool, cpu_linear: str, model) -> bool:
    """Whether an Engine compiles its steps: `value` when a bool (checked by `check_compile`); for `"auto"` (the
    default) yes where compiled steps are the measured faster forward and can run: not `exact`, the model's own
    linear layers (`cpu_linear="stock"`), no tensor parallelism, a model on the CPU (the only
    device they have been measured on; `compile=True` asks for them elsewhere) and a C++ compiler for inductor (every
    page format: `"int4-channel"` pages too, 1.22x-1.29x their eager steps since the projections run concatenated,
    docs/benchmarks.md). The reason for eager steps is logged at INFO."""
    if value != "auto":
        return value
    device = model.get_input_embeddings().weight.device
    reasons = {
        "exact=True": exact,
        f"cpu_linear={cpu_linear!r}": cpu_linear != "stock",
        "a tensor-parallel model": tensor_parallel_placement(model).world_size > 1,
        f"a model on {device.type} (compiled steps are measured faster on CPUs only so far; compile=True asks for "
        "them)": device.type != "cpu",
    }
    reason = next((reason for reason, applies in reasons.items() if applies), None)
    reason = reason or cpp_compiler_unavailable()
    if reason is not None:
        logger.info("hf_paged: the Engine runs eager steps (compile='auto'): %s", reason)
        return False
    return True


def check_cuda_graphs(value, exact: bool, model) -> bool | str:
    """`value` as an Engine's `cuda_graphs` option (`True`, `False` or `"auto"`), or `ValueError` naming why not."""
    if not isinstance(value, bool) and value != "auto":
        raise ValueError(f"cuda_graphs must be True, False or 'auto', got {value!r}")
    if value is True and exact:
        raise ValueError(
            "exact=True runs the eager steps, bit-exact with generate; cuda_graphs=True replays decode steps padded "
            "to captured batch sizes, whose outputs differ from generate's by float rounding: choose one"
        )
    device = model.get_input_embeddings().weight.device
    if value is True and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a model on a CUDA device; this one is on {device}")
    world_size = tensor_parallel_placement(model).world_size
    if value is True and world_size > 1:
        raise ValueError(
            f"cuda_graphs=True captures one process's steps; this model is split over {world_size} tensor-parallel "
            "ranks, whose steps run collectives: leave cuda_graphs out"
        )
    return value


def decode_graph_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The batch sizes an Engine captures decode graphs for: `DEFAULT_SIZES` below `max_batch_size`, and it."""
    return (*(size for size in DEFAULT_SIZES if size < max_batch_size), max_batch_size)


class StepRunner:
    """Runs an Engine's planned steps through its model (see the module docstring).

    Args:
        model (`PreTrainedModel`): the served model.
        cache (`BatchCache`): the engine's cache (its pool, kernel and running batch).
        adapters (`AdapterSet`): the engine's LoRA adapters.
        pad_token_id (`int`): the id right-aligned steps pad with.
        compile (`bool`): compile packed steps (the Engine's `compile` option, resolved by `resolve_compile`).

    Attributes:
        compiled_steps, eager_steps (`int`): steps run each way.
        graph_steps (`int`): decode steps replayed from `decode_graphs` (compiled or eager forward).
        decode_graphs (`DecodeGraphs`, *optional*): the captured decode graphs (`capture_decode_graphs`).
        graphs (`int`): graphs compiled (a new one means the first step of its shapes' kind, or a recompilation).
        compile_s (`float`): seconds spent in compiled calls that compiled a graph.
        disabled (`str`, *optional*): why compiled steps stopped (a compile error), or `None`.
        python_host_code (`str`, *optional*): why compiling with C++ host code failed, after which the steps
            compile with Python's (`None`: it did not fail, or was not tried).

    Example:

    ```python
    >>> import hf_paged
    >>> from hf_paged.reference_models import tiny_model
    >>> engine = hf_paged.Engine(tiny_model("llama"), block_size=4, num_blocks=64, compile=False)
    >>> _ = engine.generate([[1, 2, 3]], max_new_tokens=3)
    >>> engine.runner.compiled_steps, engine.runner.eager_steps
    (0, 3)

    ```
    """

    def __init__(self, model, cache, adapters, pad_token_id: int, compile: bool = False):
        self.model = model
        self.cache = cache
        self.adapters = adapters
        self.pad_token_id = pad_token_id
        if not isinstance(compile, bool):
            raise ValueError(f"StepRunner takes compile as True or False (see resolve_compile), got {compile!r}")
        self.compile = compile
        self.device = model.get_input_embeddings().weight.device
        self.keep_last_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.compiled_steps = self.eager_steps = self.graphs = self.graph_steps = 0
        self.compile_s = 0.0
        self.disabled: str | None = None
        self.python_host_code: str | None = None  # why compiling with C++ host code failed (then Python's is used)
        self._compiled = None
        self._adapted: tuple[frozenset, object] | None = None  # (modules hooked, compiled forward): `_adapted_forward`
        self._head: tuple | None = None  # (LM head module, its path): `_row_module`
        self._weights: bytes = b""  # the weights the compiled forward folded in (`_weights_key`)
        self._checked = False  # a first step ran eagerly under the step attention and every layer attended once
        self.decode_graphs: DecodeGraphs | None = None
        self._graph_options: dict | None = None  # what `capture_decode_graphs` asked for, captured at first use
        self._graph_weights: bytes = b""  # the weights the decode graphs were captured over

    @property
    def num_steps(self) -> int:
        return self.compiled_steps + self.eager_steps

    def capture_decode_graphs(self, sizes=DEFAULT_SIZES, capture: str = "cuda", width: int | None = None) -> None:
        """Replay decode steps of up to `max(sizes)` rows from graphs captured per size (`DecodeGraphs`), over the
        compiled forward where steps compile, else the eager step forward. Captured at the first decode step after
        the first step (every layer's pages then exist); `width`: block-table columns (default: the most blocks a
        row of the model's longest context, or the whole pool, can hold). The Engine's `cuda_graphs` option calls
        this on CUDA; `capture="eager"` runs the same buffers without recording (tests, any device)."""
        if capture == "cuda" and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a model on a CUDA device; this one is on {self.device.type}")
        if self.decode_graphs is not None:
            self.decode_graphs.close()
            self.decode_graphs = None
        self._graph_options = {"sizes": sizes, "capture": capture, "width": width}

    def close(self) -> None:
        """Return what the runner holds in the pool (the decode graphs' scratch block; captured again at the next
        decode step)."""
        if self.decode_graphs is not None:
            self.decode_graphs.close()
            self.decode_graphs = None

    # ------------------------------------------------------------------ one step
    def forward(self, step, implementation: str) -> tuple[torch.Tensor, int]:
        """Run `step` (planned, its batch given to the cache with `run`); returns the logits of every row's last new
        token, `[rows, vocab]`, and the positions the model computed."""
        if self._compiles(step, implementation):
            logits = self._compiled_forward(step)
            if logits is not None:
                return logits, sum(step.new_tokens)
        self.eager_steps += 1
        packed = step.batch.packed
        inputs = self._packed_inputs(step) if packed is not None else self._forward_inputs(step)
        last = None if packed is None else packed.last_token_index.to(self.device)
        if self.keep_last_logits:
            inputs["logits_to_keep"] = 1 if last is None else last
        with (
            torch.inference_mode(),
            attention_implementation(self.model, implementation),
            self._adapters_applied(step, inputs["input_ids"].shape[1]),
        ):
            output = self.model(**inputs, past_key_values=self.cache, use_cache=True)
        positions = inputs["input_ids"].numel()
        if last is None:
            return output.logits[:, -1, :], positions
        return (output.logits[0] if self.keep_last_logits else output.logits[0].index_select(0, last)), positions

    def _compiles(self, step, implementation: str) -> bool:
        """Whether `step` runs compiled: compiling is on and has not failed, the step is packed under the
        `"hf_paged"` attention, and every layer's pages are allocated (quantized pages too: `ops.write_kv_quantized`;
        requests with LoRA adapters too: `AdapterSet.compiled_step_lora`)."""
        wanted = self.compile or self._graph_options is not None
        if not wanted or self.disabled is not None or implementation != ATTENTION_NAME or self.model.training:
            return False
        if not _packable(step):
            return False
        storage = self.cache.pool.storage
        if storage.stages_keys and self.device.type != "cpu":  # the write that fills a block syncs: CPU steps
            return False
        if not all(layer.is_initialized for layer in self.cache.layers):
            return False
        return all(storage.has_layer(layer) for layer in range(len(self.cache.layers)))

    def _compiled_forward(self, step) -> torch.Tensor | None:
        """The step's logits from the compiled forward or a decode graph (the first step: eagerly under the step
        attention, checking the model), or `None` when the step runs eagerly: compiling failed here (compiled steps
        are then disabled, with one warning), or only graphs were asked for and this step has none."""
        input_ids, position_ids = self._packed_inputs(step).values()
        ends = list(itertools.accumulate(step.new_tokens))
        last = device_tensor([end - 1 for end in ends], self.device)
        query_start = device_tensor([0, *ends], self.device, torch.int32)
        tensors = StepTensors.of_batch(self.cache, query_start, self.device)
        ops.mark_varying((input_ids, (1,)), (position_ids, (1,)), (last, (0,)), *tensors.varying())
        register_step_attention()
        adapted = any(request.adapter is not None for request in step.requests)
        with torch.inference_mode(), attention_implementation(self.model, STEP_ATTENTION_NAME):
            if not self._checked:
                with self._adapters_applied(step, input_ids.shape[1]):
                    logits = self._first_step(input_ids, position_ids, last, tensors)
            elif adapted:  # no decode graph holds the adapters' masks
                if not self.compile:
                    return None
                lora = self._compiled_step_lora(step)
                logits = self._run_compiled(input_ids, position_ids, last, tensors, lora)
            elif self._replays(tensors):
                logits = self.decode_graphs.run(input_ids, position_ids, tensors)
                self.graph_steps += 1
            elif not self.compile:
                return None
            else:
                logits = self._run_compiled(input_ids, position_ids, last, tensors)
        if logits is None:
            return None
        self.cache.record_compiled_forward()
        if self.compile:
            self.compiled_steps += 1
        else:
            self.eager_steps += 1  # the eager step forward: the first step, or a decode graph's replay
        return logits

    def _first_step(self, input_ids, position_ids, last, tensors) -> torch.Tensor:
        """Run the first step eagerly under the step attention, checking that every layer attended exactly once
        through it (a layer that did not would have stored nothing), then build the compiled forward."""
        with count_attention_calls() as calls:
            try:
                logits = _run_model(self.model, self.keep_last_logits, input_ids, position_ids, last, tensors)
            except FIRST_STEP_ERRORS as error:
                return self._disable(describe_error(error))
        reason = unattended_layers(self.model, calls, len(tensors.windows))
        if reason is not None:
            return self._disable(reason)
        self._checked = True
        if self.compile:
            self._build()
        return logits

    def _replays(self, tensors: StepTensors) -> bool:
        """Whether this step replays a decode graph (capturing them first where they were asked for)."""
        if self._graph_options is None:
            return False
        weights = self._weights_key()  # once a step: without prefix caching it samples every parameter
        if self.decode_graphs is not None and self._graph_weights != weights:
            self.decode_graphs.close()  # recorded over the weights as they were: captured again
            self.decode_graphs = None
        if self.decode_graphs is None:
            if self.compile and weights != self._weights:
                self._build()
            self._graph_weights = weights
            options = dict(self._graph_options)
            width = options.pop("width") or self._graph_width()
            self.decode_graphs = DecodeGraphs(
                self._graph_forward, self.cache, width, pad_token_id=self.pad_token_id, **options
            )
        return self.decode_graphs.accepts(tensors)

    def _graph_width(self) -> int:
        """Block-table columns of the decode graphs: enough for the model's longest context, at most the pool."""
        pool, context = self.cache.pool, getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        columns = pool.num_blocks if context is None else -(-context // pool.block_size)
        return min(columns, pool.num_blocks)

    def _graph_forward(self, input_ids, position_ids, last, tensors) -> torch.Tensor:
        """The forward a decode graph records: the compiled one where steps compile, else the eager step forward."""
        if self.compile and self.disabled is None:
            ops.mark_varying((input_ids, (1,)), (position_ids, (1,)), (last, (0,)), *tensors.varying())
            with self._inductor_settings(), counting_graphs(self, "the Engine's step forward"):
                return self._compiled(self.model, self.keep_last_logits, input_ids, position_ids, last, tensors)
        return _run_model(self.model, self.keep_last_logits, input_ids, position_ids, last, tensors)

    def _build(self) -> None:
        """A new compiled forward for the model's weights as they are now (inductor's freezing folds them into the
        graph, as packed constants: the oneDNN layouts its CPU matmuls read fastest); steps with adapters get theirs
        at their next step."""
        self._compiled = _compiled_run_model()
        self._adapted = None
        self._weights = self._weights_key()

    def _adapted_forward(self, lora: CompiledStepLora):
        """The compiled forward of steps with adapters: one for the modules the resident adapters hook, built again
        when they change (Dynamo does not guard on a module's hooks: a graph traced before a module was hooked would
        leave its adapter out)."""
        targets = frozenset(lora.factors)
        if self._adapted is None or self._adapted[0] != targets:
            self._adapted = (targets, _compiled_run_model())
        return self._adapted[1]

    def _inductor_settings(self, adapters: bool = False):
        """Inductor's settings for the step forward (`adapters`: the adapters' forward), read while it compiles,
        inside the call (torch.compile's `options` did not reach `freezing`): freezing, concatenated projections, and
        the C++ host code where `_cpp_wrapper` says."""
        return torch._inductor.config.patch(
            {
                "freezing": FREEZE,
                "cpp.enable_concat_linear": CONCAT_LINEAR,
                "cpp_wrapper": self._cpp_wrapper(adapters),
            }
        )

    def _cpp_wrapper(self, adapters: bool = False) -> bool:
        """Whether the step compiles with C++ host code: on the CPU, as `CPP_WRAPPER` says (the adapters' forward:
        `ADAPTERS_CPP_WRAPPER`), unless it failed here."""
        wanted = ADAPTERS_CPP_WRAPPER if adapters else CPP_WRAPPER
        return wanted and self.device.type == "cpu" and self.python_host_code is None

    def _weights_key(self) -> bytes:
        """What the model's weights are now (`prefix.prefix_namespace`; the planner refreshes it every step when
        prefix caching is on)."""
        planner = self.cache.planner
        return planner.root if planner.prefix_caching else prefix_namespace(self.model)

    def _run_compiled(self, input_ids, position_ids, last, tensors, lora=None) -> torch.Tensor | None:
        """The compiled forward's logits, or `None` after a compile error (compiling is then disabled, with one
        warning)."""
        if self._weights_key() != self._weights:  # trained, merged, edited or replaced since it was compiled
            logger.info("hf_paged: the model's weights changed since the Engine compiled its steps: compiling again")
            self._build()
        adapters = lora is not None
        try:
            with self._inductor_settings(adapters), counting_graphs(self, "the Engine's step forward"):
                forward = self._adapted_forward(lora) if adapters else self._compiled
                logits = forward(self.model, self.keep_last_logits, input_ids, position_ids, last, tensors, lora)
        except COMPILE_ERRORS as error:
            if not self._cpp_wrapper(adapters):
                return self._disable(describe_error(error))
            # C++ host code cannot be written for some graph Python's can: compile once more with Python's
            self.python_host_code = describe_error(error)
            logger.warning(
                "hf_paged: compiling the Engine's step with C++ host code failed (%s); compiling with Python host "
                "code instead",
                self.python_host_code,
            )
            self._build()
            return self._run_compiled(input_ids, position_ids, last, tensors, lora)
        return logits

    def _disable(self, reason: str) -> None:
        """Stop compiling for good, with one warning naming `reason`; the step runs eagerly."""
        self.disabled = reason
        warnings.warn(
            f"hf_paged: the Engine's compiled steps are off ({self.disabled}); every step runs eagerly from now on "
            "(Engine(..., compile=False) chooses that up front)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None

    # ------------------------------------------------------------------ inputs
    def _adapters_applied(self, step, width: int):
        """The context in which the model's forward applies every request's LoRA adapter to its own tokens: one
        adapter slot per input position (packed: each request's new tokens; right-aligned: `width` positions per
        row) and one per row (the LM head under `logits_to_keep`)."""
        if not len(self.adapters) and not self.adapters.num_resident:
            return contextlib.nullcontext()
        if all(request.adapter is None for request in step.requests):
            return contextlib.nullcontext()  # the base model's tokens only: nothing to add
        repeats = step.new_tokens if step.batch.packed is not None else [width] * len(step.requests)
        return self.adapters.applied(*self._adapter_slots(step, repeats))

    def _adapter_slots(self, step, repeats: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every input position's adapter slot (request `i`'s slot `repeats[i]` times) and every row's (`-1`: the
        base model)."""
        rows = [-1 if r.adapter is None else self.adapters.slot_of(r.adapter) for r in step.requests]
        tokens = [slot for slot, count in zip(rows, repeats) for _ in range(count)]
        return torch.tensor(tokens), torch.tensor(rows)

    def _compiled_step_lora(self, step) -> CompiledStepLora | None:
        """The adapters' inputs of a compiled packed step (`AdapterSet.compiled_step_lora`): masks of one row per
        new token, and per request for the LM head under `logits_to_keep`. Their lengths vary from step to step and
        the stacks' width (slots x rank) from one adapter load to the next: all marked varying, so loading or
        unloading an adapter compiles nothing again unless it hooks a module none hooked before."""
        lora = self.adapters.compiled_step_lora(*self._adapter_slots(step, step.new_tokens), self._row_module())
        if lora is not None:
            widths = [dims for a, b in lora.factors.values() for dims in ((a, (0,)), (b, (1,)))]
            ops.mark_varying((lora.tokens, (0, 1)), (lora.rows, (0, 1)), *widths)
        return lora

    def _row_module(self) -> str | None:
        """The path of the module that sees only every row's last position in a compiled step: the LM head, under
        `logits_to_keep` (found once per head module)."""
        head = self.model.get_output_embeddings() if self.keep_last_logits else None
        if head is None:
            return None
        if self._head is None or self._head[0] is not head:
            self._head = (head, next((name for name, module in self.model.named_modules() if module is head), None))
        return self._head[1]

    def _packed_inputs(self, step) -> dict[str, torch.Tensor]:
        """`input_ids` and `position_ids` (`[1, T]`) of a packed step: every request's new tokens one after another,
        each at its own position; no attention mask (the attention masks each row itself)."""
        ids, positions = [], []
        for request, count in zip(step.requests, step.new_tokens):
            end = request.row.num_tokens  # the step's blocks are taken: its tokens are in the row
            ids += request.token_ids[end - count : end]
            positions += range(end - count, end)
        device = self.device
        return {
            "input_ids": device_tensor([ids], device, torch.long),
            "position_ids": device_tensor([positions], device, torch.long),
        }

    def _forward_inputs(self, step) -> dict[str, torch.Tensor]:
        """`input_ids`, `attention_mask` and `position_ids` of the step's right-aligned batch (`plan_step`): row `i`
        has `leading_pads[i]` left pads and computes the last `num_new` of its positions, which end after its new
        tokens."""
        batch = step.batch
        pads, width, past_length, length = batch.leading_pads, batch.num_new, batch.past_length, batch.length
        ends = [r.row.num_tokens for r in step.requests]  # the step's blocks are taken: its tokens are in the rows
        windows = [r.token_ids[max(end - width, 0) : end] for r, end in zip(step.requests, ends)]
        device = self.device
        input_ids = device_tensor([[self.pad_token_id] * (width - len(w)) + w for w in windows], device, torch.long)
        pads_column = device_tensor(pads, device)[:, None]
        attention_mask = (torch.arange(length, device=device)[None, :] >= pads_column).long()
        position_ids = (torch.arange(past_length, length, device=device)[None, :] - pads_column).clamp(min=0)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def _compiled_run_model():
    """A new `torch.compile` of `_run_model` (a fresh function: graphs of its own)."""
    return torch.compile(fresh_function(_run_model), backend=COMPILE_BACKEND, fullgraph=True, dynamic=False)


def _run_model(
    model, keep_last_logits: bool, input_ids, position_ids, last, tensors: StepTensors, lora=None
) -> torch.Tensor:
    """The model's forward over a packed step under the step attention: logits of the tokens `last` names. `lora`
    (`CompiledStepLora`, compiled steps only): the adapters' factors and masks, handed to their hooks."""
    if lora is None:
        return _forward(model, keep_last_logits, input_ids, position_ids, last, tensors)
    COMPILED_STEP.lora = lora
    logits = _forward(model, keep_last_logits, input_ids, position_ids, last, tensors)
    COMPILED_STEP.lora = None
    return logits


def _forward(model, keep_last_logits: bool, input_ids, position_ids, last, tensors: StepTensors) -> torch.Tensor:
    if keep_last_logits:
        output = model.forward(
            input_ids=input_ids, position_ids=position_ids, logits_to_keep=last, use_cache=False, hf_paged_step=tensors
        )
        return output.logits[0]
    output = model.forward(input_ids=input_ids, position_ids=position_ids, use_cache=False, hf_paged_step=tensors)
    return output.logits[0].index_select(0, last)


def _packable(step) -> bool:
    """Whether `step` can run as one packed sequence: it is packed, or right-aligned with every row storing all its
    `num_new` positions (a decode step: one token per row), whose write slots are then in packed order."""
    batch = step.batch
    if batch.packed is not None:
        return True
    return all(count == batch.num_new for count in step.new_tokens) and all(
        addressing.write_index is None for addressing in batch.groups
    )
