"""`AdapterSet`: the LoRA adapters resident next to one base model, and the per-token low-rank update that applies
each to the tokens of its own requests within one forward."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch

from ..errors import UnknownAdapterError
from .lora import LoraAdapter
from .ops import lora_delta


class CompiledStepLora(NamedTuple):
    """What a compiled step's forward takes for the adapters (`AdapterSet.compiled_step_lora`), as graph inputs:
    every target module's stacked factors and the masks of the step's positions. Each module takes `tokens` (`[T,
    slots x R]`, one row per packed position), except `row_module`, which sees only every row's last position (the
    LM head under `logits_to_keep`) and takes `rows` (`[rows, slots x R]`)."""

    factors: dict  # module path -> (A, B)
    tokens: torch.Tensor
    rows: torch.Tensor
    row_module: str | None
    adapters: AdapterSet  # whose step: the hooks of other sets on the same model add nothing


class _CompiledStep:
    """Where a compiled step's forward puts its `CompiledStepLora` for the adapter hooks it traces: set and cleared
    inside the traced function, so the hooks read the function's own inputs (tensors read from an
    object outside the graph would be guarded by identity and compiled again every step)."""

    def __init__(self):
        self.lora: CompiledStepLora | None = None  # an instance attribute from the start: graphs guard on it


COMPILED_STEP = _CompiledStep()


class AdapterSet:
    """LoRA adapters served from one copy of a base model, each chosen per request.

    Every adapter takes a slot. Per target module the slots' factors are stacked once, at load time, into
    `A: [slots x R, in]` and `B: [out, slots x R]` (`R` the largest resident rank, smaller ranks padded with zero
    rows, scaling folded into `B`), and a forward hook on the base module adds, during a step run under
    `applied(...)`, `((x @ A.T) * mask) @ B.T`: `mask[t]` keeps the `R` columns of token `t`'s slot and zeroes the
    others (all of them for a base-model token). So tokens of any mix of adapters go through the same two matmuls
    per module, packed prefill and decode steps included, and a base-model token gets exactly its base output.
    Outside `applied(...)` the hooks do nothing: the base model computes as before. A compiled step instead passes
    `compiled_step_lora(...)` into its traced function, which hands it to the hooks (`COMPILED_STEP.lora`): the
    factors and masks are then graph inputs, and the module that sees the rows is named rather than told apart by
    its number of positions (a size the graph takes as an input, unknown while it traces).

    An adapter unloaded while requests still run on it leaves the set at once (new requests cannot name it; a new
    adapter may take its name) but keeps its slot, and so its weights, until `release_unused` finds no request
    using it: requests finish on the weights they started with.

    Args:
        model (`torch.nn.Module`): the base model (without PEFT adapter layers).
        max_adapters (`int`): most adapters resident at once (unloaded ones still serving requests count).
        max_rank (`int`): the largest LoRA rank accepted.

    Example:

    ```python
    >>> import copy, torch
    >>> from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    >>> from hf_paged.reference_models import tiny_model
    >>> base = tiny_model("llama")
    >>> config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    >>> state = get_peft_model_state_dict(get_peft_model(copy.deepcopy(base), config))
    >>> adapters = AdapterSet(base, max_adapters=2, max_rank=8)
    >>> adapter = adapters.load("a", (config, state))
    >>> adapters.names, adapters.slot_of(adapter)
    (['a'], 0)
    >>> ids = torch.tensor([[5, 6, 7]])
    >>> with torch.no_grad(), adapters.applied(torch.tensor([0, 0, 0]), torch.tensor([0])):
    ...     tuned = base(ids).logits
    >>> with torch.no_grad(), adapters.applied(torch.tensor([-1, -1, -1]), torch.tensor([-1])):  # base tokens
    ...     plain = base(ids).logits
    >>> bool(torch.equal(plain, base(ids).logits.detach())), bool(torch.equal(tuned, plain))
    (True, False)
    >>> adapters.unload("a") is adapter, adapters.release_unused(in_use=()), adapters.names
    (True, 1, [])

    ```
    """

    def __init__(self, model: torch.nn.Module, max_adapters: int = 8, max_rank: int = 64):
        for label, value in (("max_adapters", max_adapters), ("max_rank", max_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{label} must be a positive int, got {value!r}")
        self.model = model
        self.max_adapters = max_adapters
        self.max_rank = max_rank
        self._slots: list[LoraAdapter | None] = []
        self._by_name: dict[str, LoraAdapter] = {}
        self._stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # module path -> (A, B)
        self._select: torch.Tensor | None = None  # [1 + slots, slots x R]: row 0 is a base-model token's mask
        self._hooks: list = []
        self._local = threading.local()  # the running step's masks, in the thread running it
        weakref.finalize(self, _remove_hooks, self._hooks)  # a dropped set leaves no hook (nor weights) on the model

    # ------------------------------------------------------------------ what is resident
    @property
    def names(self) -> list[str]:
        """Names requests can use, in load order."""
        return list(self._by_name)

    @property
    def num_resident(self) -> int:
        """Adapters holding a slot (unloaded ones still serving requests included)."""
        return sum(adapter is not None for adapter in self._slots)

    @property
    def num_bytes(self) -> int:
        """Bytes of the stacked factors every forward reads (zero padding included)."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self._stacks.values())

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str) -> LoraAdapter:
        """The adapter requests call `name`; `UnknownAdapterError` (a `ValueError`) naming the loaded ones when there
        is none."""
        adapter = self._by_name.get(name)
        if adapter is None:
            raise UnknownAdapterError(name, list(self._by_name))
        return adapter

    def slot_of(self, adapter: LoraAdapter) -> int:
        return next(i for i, resident in enumerate(self._slots) if resident is adapter)

    # ------------------------------------------------------------------ load and unload
    def load(self, name: str, source) -> LoraAdapter:
        """Read adapter `name` from `source` (see `LoraAdapter.load`; or a `LoraAdapter` read already, e.g. off the
        thread that steps the engine), check the limits and make it resident."""
        if name in self._by_name:
            raise ValueError(f"an adapter named {name!r} is loaded already; unload it first")
        if isinstance(source, LoraAdapter):
            if source.name != name:
                raise ValueError(f"the adapter given for {name!r} was read as {source.name!r}")
            adapter = source
        else:
            adapter = LoraAdapter.load(name, source, self.model)
        if adapter.rank > self.max_rank:
            module = next(m.path for m in adapter.modules if m.rank == adapter.rank)
            raise ValueError(f"adapter {name!r} has rank {adapter.rank} ({module}), above max_rank={self.max_rank}")
        if self.num_resident >= self.max_adapters:
            retiring = self.num_resident - len(self._by_name)
            still = f" ({retiring} of them unloaded but still serving their requests)" if retiring else ""
            raise ValueError(
                f"cannot load adapter {name!r}: {self.num_resident} adapters are resident{still}, "
                f"max_adapters={self.max_adapters}; unload one first"
            )
        free = next((i for i, resident in enumerate(self._slots) if resident is None), None)
        if free is None:
            self._slots.append(adapter)
        else:
            self._slots[free] = adapter
        self._by_name[name] = adapter
        self._restack()
        return adapter

    def unload(self, name: str) -> LoraAdapter:
        """Take `name` out of the set: new requests can no longer use it. Its slot is freed by `release_unused`
        once no request runs on it."""
        adapter = self.get(name)
        del self._by_name[name]
        return adapter

    def release_unused(self, in_use: Iterable[LoraAdapter]) -> int:
        """Free the slots of unloaded adapters no request in `in_use` runs on; returns how many were freed."""
        busy = {id(adapter) for adapter in in_use}
        live = {id(adapter) for adapter in self._by_name.values()}
        freed = 0
        for index, adapter in enumerate(self._slots):
            if adapter is not None and id(adapter) not in live and id(adapter) not in busy:
                self._slots[index] = None
                freed += 1
        if freed:
            while self._slots and self._slots[-1] is None:
                self._slots.pop()
            self._restack()
        return freed

    def close(self) -> None:
        """Remove the hooks and every adapter."""
        _remove_hooks(self._hooks)
        self._slots.clear()
        self._by_name.clear()
        self._stacks.clear()
        self._select = None

    # ------------------------------------------------------------------ the forward
    def compiled_step_lora(
        self, token_slots: torch.Tensor, row_slots: torch.Tensor, row_module: str | None
    ) -> CompiledStepLora | None:
        """The `CompiledStepLora` of a packed step whose positions have `token_slots` and whose rows `row_slots`
        (slot `-1`: the base model); `row_module` (a module path, or `None`) is the one module that sees the rows.
        `None` without resident adapters."""
        select = self._select
        if select is None or not self._stacks:
            return None
        device = select.device
        return CompiledStepLora(
            dict(self._stacks),
            select.index_select(0, (token_slots + 1).to(device)),
            select.index_select(0, (row_slots + 1).to(device)),
            row_module,
            self,
        )

    @contextlib.contextmanager
    def applied(self, token_slots: torch.Tensor, row_slots: torch.Tensor) -> Iterator[None]:
        """Within this context (in this thread), a forward over the base model adds to every position of its
        input the update of its slot: `token_slots` gives one slot per input position (flattened `[batch x
        length]`), `row_slots` one per row for modules that see only the rows' last positions (the LM head under
        `logits_to_keep`); slot `-1` is the base model."""
        select = self._select
        if select is None or not self._stacks:
            yield
            return
        masks = {}
        for slots in (row_slots, token_slots):
            masks[slots.numel()] = select.index_select(0, (slots + 1).to(select.device))
        self._local.masks = masks
        try:
            yield
        finally:
            self._local.masks = None

    def _restack(self) -> None:
        """Stack every slot's factors per target module and hook the target modules."""
        _remove_hooks(self._hooks)
        self._stacks.clear()
        resident = [(index, adapter) for index, adapter in enumerate(self._slots) if adapter is not None]
        if not resident:
            self._select = None
            return
        rank = max(adapter.rank for _, adapter in resident)
        width = len(self._slots) * rank
        stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for index, adapter in resident:
            for module in adapter.modules:
                if module.path not in stacks:
                    a, b = module.A, module.B
                    stacks[module.path] = (
                        a.new_zeros(width, a.shape[1]),
                        b.new_zeros(b.shape[0], width),
                    )
                a_stack, b_stack = stacks[module.path]
                start = index * rank
                a_stack[start : start + module.rank] = module.A
                b_stack[:, start : start + module.rank] = module.B * module.scaling
        self._stacks = stacks
        first = next(iter(stacks.values()))[0]
        select = torch.zeros(len(self._slots) + 1, width, dtype=first.dtype, device=first.device)
        for index, _ in resident:
            select[index + 1, index * rank : (index + 1) * rank] = 1
        self._select = select
        for path in stacks:
            self._hooks.append(self.model.get_submodule(path).register_forward_hook(self._hook(path)))

    def _hook(self, path: str):
        owner = weakref.ref(self)  # the model holds the hook: it must not keep the set alive

        def add_update(module, args, output):
            adapters = owner()
            compiled = COMPILED_STEP.lora
            if compiled is not None:  # inside a compiled step's traced forward: its inputs
                if compiled.adapters is not adapters:
                    return None  # another engine's adapters on the same model
                a, b = compiled.factors[path]
                mask = compiled.rows if path == compiled.row_module else compiled.tokens
                x = args[0]
                return output + lora_delta(x.reshape(-1, x.shape[-1]), a, b, mask).view_as(output)
            masks = None if adapters is None else getattr(adapters._local, "masks", None)
            if masks is None:
                return None
            a, b = adapters._stacks[path]
            x = args[0]
            count = x.numel() // x.shape[-1]
            mask = masks.get(count)
            if mask is None:
                raise RuntimeError(
                    f"{path} got {count} positions, which match neither the step's tokens nor its rows "
                    f"({sorted(masks)}): the adapters cannot tell whose they are"
                )
            low = x.reshape(count, x.shape[-1]) @ a.T
            low.mul_(mask)
            return output.reshape(count, -1).addmm(low, b.T).view_as(output)

        return add_update


def _remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()
