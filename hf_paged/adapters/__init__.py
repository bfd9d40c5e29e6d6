"""LoRA adapters served per request next to one base model (`Engine(model, adapters=...)`)."""

from .adapter_set import AdapterSet
from .lora import LoraAdapter, LoraModule

__all__ = ["AdapterSet", "LoraAdapter", "LoraModule"]
