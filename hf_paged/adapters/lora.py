"""`LoraAdapter`: one PEFT LoRA adapter read for serving next to its base model — its low-rank factors per target
module, checked against the base, and a digest of its weights."""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

# the keys of a saved LoRA adapter (PEFT's `get_peft_model_state_dict`: adapter names removed)
_PREFIX = "base_model.model."
_FACTORS = (".lora_A.weight", ".lora_B.weight")


@dataclass(frozen=True)
class LoraModule:
    """The low-rank update of one linear module: `y += (x @ A.T) @ B.T * scaling`.

    Attributes:
        path (`str`): the module's name in the base model (`model.layers.0.self_attn.q_proj`).
        A (`torch.Tensor`): `[rank, in_features]`.
        B (`torch.Tensor`): `[out_features, rank]`.
        scaling (`float`): `lora_alpha / rank` (`/ sqrt(rank)` with `use_rslora`), as PEFT computes it.
    """

    path: str
    A: torch.Tensor
    B: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.A.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter read from PEFT's files (`save_pretrained`) or from a `LoraConfig` and its state dict, checked
    against a base model: every target is a `torch.nn.Linear` of the base with the factors' shapes. Adapter types
    and LoRA variants that change more than linear layers by a low-rank product (prompt tuning, IA3, DoRA, biases,
    `modules_to_save`, embedding targets, ...) are refused, naming what was found.

    Attributes:
        name (`str`): the name requests use.
        modules (`tuple[LoraModule, ...]`): one per target module.
        digest (`str`): blake2b of every factor's values and scaling: two adapters with the same digest compute the
            same K/V (the prefix cache keys an adapter's blocks by its name and this digest).

    Example:

    ```python
    >>> import copy
    >>> from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    >>> from hf_paged.reference_models import tiny_model
    >>> base = tiny_model("llama")
    >>> config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    >>> tuned = get_peft_model(copy.deepcopy(base), config)
    >>> adapter = LoraAdapter.load("tuned", (config, get_peft_model_state_dict(tuned)), base)
    >>> len(adapter.modules), adapter.rank, adapter.modules[0].path, adapter.modules[0].scaling
    (4, 4, 'model.layers.0.self_attn.q_proj', 2.0)

    ```
    """

    name: str
    modules: tuple[LoraModule, ...]
    digest: str

    @property
    def rank(self) -> int:
        """The largest rank of its modules."""
        return max(module.rank for module in self.modules)

    @property
    def num_bytes(self) -> int:
        return sum(m.A.numel() * m.A.element_size() + m.B.numel() * m.B.element_size() for m in self.modules)

    @classmethod
    def load(cls, name: str, source, base: torch.nn.Module) -> LoraAdapter:
        """Read adapter `name` from `source` — a directory written by PEFT's `save_pretrained`, or a pair
        `(LoraConfig or its dict, state dict)` — onto `base`'s devices and dtypes; `ValueError` (or
        `NotImplementedError` for an adapter type or LoRA variant that is not served) when it does not fit."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter name must be a non-empty string, got {name!r}")
        config, state = _read(name, source)
        _check_config(name, config)
        modules = []
        for path, (a, b) in sorted(_factors(name, state).items()):
            target = _target(name, base, path)
            rank = a.shape[0]
            if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
                raise ValueError(
                    f"adapter {name!r}: {path} has lora_A of shape {tuple(a.shape)} and lora_B of shape "
                    f"{tuple(b.shape)}, which are no rank-r pair"
                )
            if a.shape[1] != target.in_features or b.shape[0] != target.out_features:
                raise ValueError(
                    f"adapter {name!r} was not trained for this base model: {path} is a Linear of "
                    f"{target.in_features} -> {target.out_features} features here, the adapter's factors are for "
                    f"{a.shape[1]} -> {b.shape[0]}"
                )
            weight = target.weight
            alpha = _pattern_value(config.get("alpha_pattern") or {}, path, config.get("lora_alpha", 8))
            scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
            modules.append(
                LoraModule(path, a.to(weight.device, weight.dtype), b.to(weight.device, weight.dtype), scaling)
            )
        if not modules:
            raise ValueError(f"adapter {name!r} holds no LoRA factors (no *.lora_A.weight / *.lora_B.weight keys)")
        return cls(name, tuple(modules), _digest(modules))


def _read(name: str, source) -> tuple[dict, Mapping[str, torch.Tensor]]:
    """The adapter's config (as a dict) and state dict."""
    if isinstance(source, str | os.PathLike):
        path = os.fspath(source)
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise ValueError(f"adapter {name!r}: {path} is no PEFT adapter directory (no adapter_config.json)")
        from peft import PeftConfig
        from peft.utils import load_peft_weights

        return _config_dict(PeftConfig.from_pretrained(path)), load_peft_weights(path, device="cpu")
    if isinstance(source, tuple | list) and len(source) == 2:
        config, state = source
        if not isinstance(state, Mapping):
            raise ValueError(f"adapter {name!r}: the second item must be the adapter's state dict, got {type(state)}")
        return _config_dict(config), state
    raise ValueError(
        f"adapter {name!r}: expected a directory saved by PEFT or a (LoraConfig, state dict) pair, got "
        f"{type(source).__name__}"
    )


def _config_dict(config) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise ValueError(f"an adapter config must be a PEFT config or a dict, got {type(config).__name__}")


def _check_config(name: str, config: dict) -> None:
    peft_type = str(getattr(config.get("peft_type"), "value", config.get("peft_type")))
    if peft_type != "LORA":
        raise NotImplementedError(
            f"adapter {name!r} is a PEFT {peft_type} adapter; only LoRA adapters are served per request (merge "
            "other adapter types into the model and serve it on its own)"
        )
    variants = {
        "use_dora": "DoRA (use_dora=True)",
        "modules_to_save": "modules_to_save (whole modules replaced)",
        "lora_bias": "LoRA biases (lora_bias=True)",
        "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
        "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)",
        "layer_replication": "layer replication",
        "target_parameters": "LoRA on parameters (target_parameters)",
        "use_qalora": "QALoRA (use_qalora=True)",
        "use_bdlora": "BD-LoRA",
    }
    for key, what in variants.items():
        if config.get(key):
            raise NotImplementedError(f"adapter {name!r} uses {what}, which is not served per request; merge it")
    if config.get("bias", "none") != "none":
        raise NotImplementedError(f"adapter {name!r} trains biases (bias={config['bias']!r}), which is not served")


def _factors(name: str, state: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`{module path: (A, B)}` of a LoRA state dict; any other key is refused, naming it."""
    halves: dict[str, list] = {}
    for key, tensor in state.items():
        factor = next((i for i, end in enumerate(_FACTORS) if key.endswith(end)), None)
        if factor is None:
            raise NotImplementedError(
                f"adapter {name!r} holds {key!r}, which is no LoRA factor of a linear layer (embedding or other "
                "targets are not served per request)"
            )
        path = key[: -len(_FACTORS[factor])]
        path = path[len(_PREFIX) :] if path.startswith(_PREFIX) else path
        halves.setdefault(path, [None, None])[factor] = torch.as_tensor(tensor).detach()
    for path, (a, b) in halves.items():
        if a is None or b is None:
            raise ValueError(f"adapter {name!r}: {path} has only one of lora_A and lora_B")
    return {path: (a, b) for path, (a, b) in halves.items()}


def _target(name: str, base: torch.nn.Module, path: str) -> torch.nn.Linear:
    try:
        module = base.get_submodule(path)
    except AttributeError:
        raise ValueError(f"adapter {name!r} was not trained for this base model: it has no module {path}") from None
    if type(module) is not torch.nn.Linear:
        raise NotImplementedError(
            f"adapter {name!r} targets {path}, a {type(module).__name__}; only torch.nn.Linear targets are served "
            "per request"
        )
    return module


def _pattern_value(pattern: dict, path: str, default):
    """PEFT's per-module override (`alpha_pattern`) for `path`, or `default`."""
    if not pattern:
        return default
    from peft.utils.other import get_pattern_key

    return pattern.get(get_pattern_key(pattern.keys(), path), default)


def _digest(modules: list[LoraModule]) -> str:
    digest = hashlib.blake2b(digest_size=16, person=b"hf_paged-lora")
    for module in modules:
        digest.update(module.path.encode() + repr(module.scaling).encode())
        for tensor in (module.A, module.B):
            digest.update(str(tensor.dtype).encode())
            digest.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
