"""Shared pieces of the LoRA tests: random adapters for a base model, and the stock reference — PEFT's model with
only the request's adapter active (or none), `generate` with `DynamicCache` in fp32."""

from __future__ import annotations

import copy

import torch
from peft import get_peft_model, set_peft_model_state_dict

from hf_paged.reference_models import random_lora

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def three_adapters(base) -> dict:
    """Three adapters of different ranks, targets and scalings: `{name: (LoraConfig, state dict)}`."""
    return {
        "qv": random_lora(base, seed=1, rank=4),
        "all": random_lora(base, seed=2, rank=8, target_modules=ALL_LINEAR),
        "mlp": random_lora(base, seed=3, rank=2, target_modules=("o_proj", "down_proj"), use_rslora=True),
    }


class PeftReference:
    """PEFT's model over a copy of `base` holding `adapters`; `generate(prompt, adapter, ...)` runs the prompt alone
    with only `adapter` active (`None`: adapters disabled, the base model)."""

    def __init__(self, base, adapters: dict):
        self.model = None
        for name, (config, state) in adapters.items():
            self.add(name, config, state, base)

    def add(self, name: str, config, state, base=None) -> None:
        if self.model is None:
            self.model = get_peft_model(copy.deepcopy(base), config, adapter_name=name)
        else:
            self.model.add_adapter(name, config)
        set_peft_model_state_dict(self.model, state, adapter_name=name)
        self.model.eval()

    def generate(self, prompt: list[int], adapter: str | None, max_new_tokens: int, seed: int | None = None, **options):
        ids = torch.tensor([prompt])
        options = {"max_new_tokens": max_new_tokens, "min_new_tokens": max_new_tokens, "do_sample": False, **options}
        if seed is not None:
            torch.manual_seed(seed)
        if adapter is None:
            with self.model.disable_adapter():
                out = self.model.generate(input_ids=ids, **options)
        else:
            self.model.set_adapter(adapter)
            out = self.model.generate(input_ids=ids, **options)
        return out[0, len(prompt) :].tolist()


def save_lora(adapter: tuple, folder) -> str:
    """Write `(LoraConfig, state dict)` as PEFT's `save_pretrained` does (`adapter_config.json`,
    `adapter_model.safetensors`); returns the folder."""
    from safetensors.torch import save_file

    config, state = adapter
    config.save_pretrained(folder)
    save_file({key: value.contiguous() for key, value in state.items()}, f"{folder}/adapter_model.safetensors")
    return str(folder)
