"""`CompiledDecode`: `generate`'s decode steps on a `PagedCache` through `torch.compile`.

transformers compiles the decode steps of `generate` when the cache says it can (`Cache.is_compileable`) and the
device or the generation config asks for it (CUDA by default; elsewhere `compile_config=CompileConfig(
_compile_all_devices=True)`): it runs every decode step through `model.get_compiled_call(compile_config)`, and the
prefill eagerly. For a paged call hf_paged's generation glue makes the `PagedCache` compileable for that call and
hands transformers a `CompiledDecode` in place of `torch.compile(model.__call__)`, so the host-side planning stays
outside the compiled region:

1. on the host, as the forward pre-hook would: the cache plans the step (`PagedCache.prepare_forward`: blocks
   taken, copy-on-write carried out, slots addressed);
2. the step's paged tensors (`StepTensors`: K/V blocks, write slots, block tables padded to a width fixed for the
   call from its `max_length`, row lengths) go into the compiled `model.forward`, whose `"hf_paged"` attention takes
   the tensor path of the `"hf_paged_step"` attention (`torch.ops.hf_paged.write_kv`, `paged_attention`), with no
   mask built and no cache object inside the graph. Every decode step of a call has the same shapes: one graph per
   call shape (`dynamic=None` lets Dynamo make a second call shape's sizes symbolic: at most two graphs);
3. on the host: the cache records the step (`BatchCache.record_compiled_forward`).

The compile options are the generation config's `CompileConfig` (backend, mode, fullgraph, dynamic, options).
Weights are graph inputs, not constants (no inductor freezing): a model trained or edited between calls generates
with its new weights, as stock's compiled `StaticCache` does. The first step of a `CompiledDecode` runs eagerly
through the same path and checks that every layer attended once; a model that does not route every layer through the
registered attention, or a compile error, turns compiled decoding off with one warning (the steps then run as the
eager paged call would). A step the compiled path does not take (extra model inputs, attention weights or hidden
states asked for, training mode; `"int4-channel"` pages off the CPU) runs eagerly. Quantized pages compile: the
step's `*_quantized`/`*_staged` ops quantize and read them with the eager path's format code.
"""

from __future__ import annotations

import warnings

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from .compiling import (
    COMPILE_ERRORS,
    FIRST_STEP_ERRORS,
    counting_graphs,
    describe_error,
    fresh_function,
    unattended_layers,
)
from .forward import forward_inputs
from .kernels import ops
from .step_attention import StepTensors, count_attention_calls

# the inputs `generate` passes a decode step that the compiled path takes (any other tensor input runs eagerly)
_TAKEN_INPUTS = frozenset(
    {"input_ids", "attention_mask", "position_ids", "past_key_values", "use_cache", "return_dict", "cache_position"}
)
_NO_OUTPUTS = frozenset({"output_attentions", "output_hidden_states", "logits_to_keep"})


class CompiledDecode:
    """The decode steps of paged `generate` calls on one model, compiled (see the module docstring).

    Args:
        model (`PreTrainedModel`): the model.
        compile_config (`CompileConfig`): how to compile (the generation config's, or transformers' default).

    Attributes:
        compiled_steps, eager_steps (`int`): decode steps run each way.
        graphs (`int`): graphs compiled for it.
        compile_s (`float`): seconds spent in calls that compiled a graph.
        disabled (`str`, *optional*): why compiled decoding stopped, or `None`.

    Example:

    ```python
    >>> import torch, hf_paged
    >>> from transformers import CompileConfig
    >>> from hf_paged.reference_models import tiny_model
    >>> model = tiny_model("llama")
    >>> compile_config = CompileConfig(backend="eager")  # inductor's graphs take longer to build
    >>> compile_config._compile_all_devices = True  # transformers compiles on CUDA only, unless told
    >>> out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False, pad_token_id=0,
    ...                      cache_implementation="paged", cache_config={"block_size": 4, "num_blocks": 32},
    ...                      compile_config=compile_config)
    >>> decode = hf_paged.compiled_decode_of(model)
    >>> decode.compiled_steps, decode.eager_steps  # the first decode step checks the model, eagerly
    (2, 1)

    ```
    """

    def __init__(self, model: torch.nn.Module, compile_config):
        self.model = model
        self.compile_config = compile_config
        self.compiled_steps = self.eager_steps = self.graphs = 0
        self.compile_s = 0.0
        self.disabled: str | None = None
        self._checked = False
        options = {key: value for key, value in compile_config.to_dict().items() if value is not None}
        self._compiled = torch.compile(fresh_function(_decode_forward), **options)

    def __call__(self, **inputs):
        cache = inputs.get("past_key_values")
        if not self._takes(cache, inputs):
            self.eager_steps += 1
            return self.model(**inputs)
        input_ids, position_ids = inputs["input_ids"], inputs["position_ids"]
        cache.prepare_forward(self.model, forward_inputs(self.model, (), inputs))
        try:
            with torch.inference_mode():  # no autograd layer around the custom ops' calls
                logits, compiled = self._logits(cache, input_ids, position_ids)
        except BaseException:
            cache.forward_failed()
            raise
        if logits is None:  # compiled decoding was turned off: take the step back and run it eagerly
            cache.forward_failed()
            self.eager_steps += 1
            return self.model(**inputs)
        cache.record_compiled_forward()
        cache.forward_finished()
        if compiled:
            self.compiled_steps += 1
        else:
            self.eager_steps += 1
        return CausalLMOutputWithPast(logits=logits, past_key_values=cache)

    def _takes(self, cache, inputs: dict) -> bool:
        """Whether this decode step runs compiled: compiling is on for `cache` and has not failed, the step's inputs
        are token ids and positions only, and every row of the cache is past its prompt."""
        if self.disabled is not None or self.model.training or getattr(cache, "decode_table_width", None) is None:
            return False
        if any(name not in _TAKEN_INPUTS and name not in _NO_OUTPUTS for name in inputs):
            return False
        if any(inputs.get(name) not in (None, False) for name in _NO_OUTPUTS if name != "logits_to_keep"):
            return False
        input_ids, position_ids = inputs.get("input_ids"), inputs.get("position_ids")
        if not isinstance(input_ids, torch.Tensor) or not isinstance(position_ids, torch.Tensor):
            return False
        if input_ids.dim() != 2 or position_ids.shape != input_ids.shape:
            return False
        return cache.takes_compiled_decode(input_ids.shape[0])

    def _logits(self, cache, input_ids: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
        """The step's logits (`None` when compiled decoding was turned off here), and whether they came from the
        compiled forward (the first step runs eagerly, checking the model)."""
        rows, num_new = input_ids.shape
        device = input_ids.device
        query_start = torch.arange(0, rows * num_new + 1, num_new, dtype=torch.int32, device=device)
        tensors = StepTensors.of_batch(cache, query_start, device, width=cache.decode_table_width)
        no_mask = torch.ones(rows, 1, num_new, 1, dtype=torch.bool, device=device)  # 4D: transformers builds none
        if not self._checked:
            return self._first_step(input_ids, position_ids, no_mask, tensors), False
        # rows and table width vary between calls (not within one): one graph serves them all
        ops.mark_varying((input_ids, (0,)), (position_ids, (0,)), (no_mask, (0,)), *tensors.varying())
        try:
            with counting_graphs(self, "generate's paged decode step"):
                logits = self._compiled(self.model, input_ids, position_ids, no_mask, tensors)
        except COMPILE_ERRORS as error:
            return self._disable(describe_error(error)), True
        return logits, True

    def _first_step(self, input_ids, position_ids, no_mask, tensors: StepTensors) -> torch.Tensor | None:
        """The first step, eagerly through the compiled path's code, checking that every layer attended once."""
        with count_attention_calls() as calls:
            try:
                logits = _decode_forward(self.model, input_ids, position_ids, no_mask, tensors)
            except FIRST_STEP_ERRORS as error:
                return self._disable(describe_error(error))
        reason = unattended_layers(self.model, calls, len(tensors.windows))
        if reason is not None:
            return self._disable(reason)
        self._checked = True
        return logits

    def _disable(self, reason: str) -> None:
        self.disabled = reason
        warnings.warn(
            f"hf_paged: compiled decoding of paged generate is off for this model ({reason}); its decode steps run "
            "eagerly from now on",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _decode_forward(model, input_ids, position_ids, no_mask, tensors: StepTensors) -> torch.Tensor:
    """The model's forward over a decode step whose attention reads and writes the pages through `tensors`."""
    output = model.forward(
        input_ids=input_ids, position_ids=position_ids, attention_mask=no_mask, use_cache=False, hf_paged_step=tensors
    )
    return output.logits
