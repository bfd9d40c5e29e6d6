"""`hf-paged`: command line entry point (`hf-paged serve MODEL_PATH ...`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
from pathlib import Path

from ..config import PagedCacheConfig, parse_memory
from ..cpu_linear import CPU_LINEARS
from ..kernels import KERNELS
from ..kv_format import KV_DTYPES, kv_format

logger = logging.getLogger("hf_paged.serve")

API_KEY_ENV = "HF_PAGED_API_KEY"
DEFAULT_MAX_BODY = "4MiB"
DEFAULT_SHUTDOWN_GRACE_S = 10.0
DEFAULT_TP_TIMEOUT_S = 30.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-paged", description="PagedAttention for Hugging Face transformers")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model with an OpenAI-compatible API on the paged Engine")
    serve.add_argument("model_path", help="a folder (or Hub id) that AutoModelForCausalLM.from_pretrained loads")
    serve.add_argument(
        "--gguf-file", help="a GGUF file inside MODEL_PATH to load (converted once, cached by its content hash)"
    )
    serve.add_argument("--served-model-name", help="the model id clients ask for (default: MODEL_PATH's name)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    serve.add_argument("--device", default=None, help="e.g. cuda:0 (default: cuda when available, else cpu)")
    serve.add_argument(
        "--block-size",
        type=_block_size,
        default=None,
        help="tokens per KV block (default 16; 64 with --kv-dtype int4-channel, whose keys are quantized over a "
        "block), or auto: the size the fastest attention backend of the device reads (256 on CUDA with flash-attn "
        "2, else 16)",
    )
    serve.add_argument(
        "--kernel",
        choices=KERNELS,
        default=None,
        help="paged-attention backend: auto (default: read the blocks in place where this device has a kernel), "
        "gather (copy K/V out of the blocks, then SDPA), or a named backend",
    )
    serve.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default=None,
        help="how the pool stores K/V: auto (default: the model's dtype), int8 or int4 (quantized pages, a bfloat16 "
        "scale per token and head: about 0.52x and 0.27x the bytes of bfloat16 pages)",
    )
    serve.add_argument(
        "--kv-offload-dir",
        default=None,
        metavar="PATH",
        help="keep the prefix cache's blocks in this directory too (safetensors files, kept across restarts and "
        "shared by processes on this machine); a later prompt with a cached prefix loads it instead of computing it",
    )
    serve.add_argument(
        "--kv-offload-disk",
        type=_memory,
        default=None,
        metavar="BYTES",
        help="most bytes the --kv-offload-dir directory holds (default 10GiB; least recently used dropped first)",
    )
    serve.add_argument(
        "--kv-offload-remote",
        default=None,
        metavar="URL",
        help="keep the prefix cache's blocks in this Redis too (redis://HOST:PORT/DB), shared by every server "
        "naming it (needs the redis client: pip install 'hf-paged[offload]')",
    )
    serve.add_argument(
        "--kv-offload-remote-bytes",
        type=_memory,
        default=None,
        metavar="BYTES",
        help="most bytes this server's blocks take in Redis (default 4GiB; least recently used dropped first)",
    )
    serve.add_argument(
        "--kv-offload-host",
        type=_memory,
        default=None,
        metavar="BYTES",
        help="keep the prefix cache's blocks in this process's memory too, up to BYTES (for a pool on a GPU)",
    )
    serve.add_argument(
        "--cpu-linear",
        choices=CPU_LINEARS,
        default="stock",
        help="matmuls of the model's linear layers on a CPU: stock (default: torch's nn.Linear) or onednn (weights "
        "packed once for oneDNN: faster decoding on many CPUs; outputs differ from stock by float rounding)",
    )
    serve.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the engine's steps through torch.compile (inductor; compiled at start-up, about a minute for a "
        "135M model on 2 CPU cores): 1.3-1.6x the tokens/s of eager steps on a CPU, outputs differ from eager "
        "generate by float rounding. Default: compiled where it can run (no --exact, --cpu-linear stock, --tp 1, "
        "the CPU, a C++ compiler), eager otherwise",
    )
    serve.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay decode steps from CUDA graphs captured per batch size (a CUDA device; padded to the next "
        "captured size). Default: on where the steps compile on CUDA (--compile), off otherwise",
    )
    serve.add_argument(
        "--exact",
        action="store_true",
        help="run the eager steps, whose tokens and logits are bit-exact with transformers' generate (no compiling)",
    )
    serve.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="compute every prompt in full instead of reusing cached prompt blocks: answers then do not depend on "
        "earlier requests (with bf16 or quantized pages a reused block can change an answer; docs/exactness.md)",
    )
    size = serve.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=_positive, help="KV blocks in the pool")
    size.add_argument(
        "--max-memory", type=_memory, help='KV memory for the pool, e.g. "512MiB" (at least one block\'s worth)'
    )
    serve.add_argument(
        "--max-batch-size", type=_positive, default=64, help="most requests running at once (default 64)"
    )
    serve.add_argument(
        "--max-prefill-tokens",
        type=_positive,
        default=4096,
        help="tokens per prefill forward; longer prompts are chunked (default 4096)",
    )
    serve.add_argument(
        "--max-num-batched-tokens",
        type=_positive,
        default=512,
        help="tokens per step while requests decode (theirs plus prompt tokens): bounds how long a prompt stalls them "
        "(default 512); at least --max-batch-size, since a step holds one token of every running request",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help=f"require `Authorization: Bearer KEY` on /v1/* routes (default: ${API_KEY_ENV}, which keeps the key "
        "out of the process list)",
    )
    serve.add_argument(
        "--max-body-size",
        type=_size,
        default=_size(DEFAULT_MAX_BODY),
        help=f"largest request body accepted, e.g. 4MiB (default {DEFAULT_MAX_BODY}); larger ones get 413",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=_seconds,
        default=DEFAULT_SHUTDOWN_GRACE_S,
        help="seconds in-flight requests may run after SIGINT/SIGTERM before they are aborted "
        f"(default {DEFAULT_SHUTDOWN_GRACE_S:g})",
    )
    serve.add_argument(
        "--tp",
        type=_degree,
        default=1,
        help="tensor-parallel degree: start this many ranks, each holding 1/N of the heads (it must divide the "
        "model's KV heads); rank 0 serves (default 1: one process)",
    )
    serve.add_argument(
        "--tp-timeout",
        type=_timeout,
        default=DEFAULT_TP_TIMEOUT_S,
        help="seconds a rank waits for the others before the group stops with an error (default "
        f"{DEFAULT_TP_TIMEOUT_S:g})",
    )
    serve.add_argument(
        "--lora",
        action="append",
        type=_lora,
        default=[],
        metavar="NAME=PATH",
        help="serve the PEFT LoRA adapter saved in PATH as model NAME, next to the base model (repeatable); "
        "a request's `model` field picks it",
    )
    serve.add_argument("--max-loras", type=_degree, default=8, help="most LoRA adapters resident at once (default 8)")
    serve.add_argument("--max-lora-rank", type=_degree, default=64, help="largest LoRA rank accepted (default 64)")
    serve.add_argument("--log-level", type=_log_level, default="info", help=f"one of {', '.join(LOG_LEVELS)}")
    return parser


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {number}")
    return number


def _block_size(value: str) -> int | str:
    return "auto" if value == "auto" else _positive(value)


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number in [0, 65535], got {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in [0, 65535], got {port}")
    return port


def _memory(value: str) -> str:
    _size(value)  # refused here if it is no memory size; kept as written for the pool's messages
    return value


def _log_level(value: str) -> str:
    if value.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return value.lower()


def _lora(value: str) -> tuple[str, str]:
    """`NAME=PATH` of a saved PEFT adapter, checked before the model loads."""
    name, equals, path = value.partition("=")
    if not equals or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise argparse.ArgumentTypeError(f"{path!r} is no PEFT adapter directory (no adapter_config.json)")
    return name.strip(), path


def check_loras(args) -> str | None:
    """Why the `--lora` options cannot be served together (a name twice, the base model's name, too many, with
    `--tp`), or `None`."""
    from pathlib import Path

    names = [name for name, _ in args.lora]
    served = args.served_model_name or Path(args.model_path).name
    if len(set(names)) != len(names):
        return f"--lora: the name {next(n for n in names if names.count(n) > 1)!r} is given twice"
    if served in names:
        return f"--lora: {served!r} is the base model's name (--served-model-name renames it)"
    if len(names) > args.max_loras:
        return f"--lora: {len(names)} adapters, above --max-loras {args.max_loras}"
    if names and args.tp > 1:
        return "--lora cannot be combined with --tp (tensor-parallel engines serve no adapter)"
    return None


def _degree(value: str) -> int:
    try:
        degree = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}") from None
    if degree < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 (1: no tensor parallelism), got {degree}")
    return degree


def _size(value: str) -> int:
    try:
        return parse_memory(int(value) if value.isdigit() else value)
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error).replace("max_memory=", "").replace("max_memory", "size")) from None


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"the grace period must be >= 0 seconds, got {value}")
    return seconds


def _timeout(value: str) -> float:
    seconds = _seconds(value)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"the timeout must be > 0 seconds, got {value}")
    return seconds


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class UsageError(ValueError):
    """A command line option the model or the machine cannot honour: reported as a usage error (status 2)."""


def check_serve_args(args) -> None:
    """Refuse what `hf-paged serve` cannot run with, before anything loads: options that contradict each other,
    a `--device` this machine does not have, a model folder that does not exist (and is no Hub id) or holds no
    model, a `--max-memory` below one KV block of the model (read from its config.json, layer by layer).

    Raises:
        UsageError: naming the option, its value and the limit.
    """
    if args.max_num_batched_tokens < args.max_batch_size:
        raise UsageError(
            f"--max-num-batched-tokens {args.max_num_batched_tokens} is below --max-batch-size {args.max_batch_size}: "
            "a step holds one token of every running request, so it must be at least --max-batch-size"
        )
    if args.exact and args.compile:
        raise UsageError(
            "--exact runs the eager steps, bit-exact with generate; --compile runs compiled steps, whose outputs "
            "differ by float rounding: choose one"
        )
    if args.exact and args.cuda_graphs:
        raise UsageError(
            "--exact runs the eager steps, bit-exact with generate; --cuda-graphs replays decode steps padded to "
            "captured batch sizes, whose outputs differ by float rounding: choose one"
        )
    if args.exact and args.cpu_linear != "stock":
        raise UsageError(
            f"--exact keeps the model's own linear layers; --cpu-linear {args.cpu_linear} packs them, which changes "
            "outputs by float rounding: choose one"
        )
    if args.device is not None:
        _check_device(args.device)
    if args.cpu_linear == "onednn":
        _check_cpu_linear(args.device)
    if args.compile and args.cpu_linear != "stock":
        raise UsageError(
            f"--compile packs the linear weights itself (inductor's freezing); leave --cpu-linear {args.cpu_linear} "
            "out of it (--cpu-linear stock)"
        )
    if args.compile and args.tp > 1:
        raise UsageError(f"--compile runs one process's steps; with --tp {args.tp} leave it off (--no-compile)")
    if args.cuda_graphs and args.tp > 1:
        raise UsageError(f"--cuda-graphs runs one process's steps; with --tp {args.tp} leave it off")
    if args.cuda_graphs:
        _check_cuda_graphs(args.device)
    # the pool's own default where --block-size is not given (16; 64 for --kv-dtype int4-channel)
    given_block_size = args.block_size or PagedCacheConfig(kv_dtype=args.kv_dtype).block_size_on("cpu")
    if args.kernel not in (None, "auto", "gather"):
        _check_kernel(args.kernel, args.device, given_block_size)
    _check_kv_offload(args)
    config = _check_model_path(args.model_path, args.gguf_file)
    shapes = None if config is None else _kv_shapes(config)
    if args.kv_dtype is not None and shapes is not None:
        try:
            for head_dim in sorted({head_dim for _, head_dim in shapes}):
                kv_format(args.kv_dtype).check_head_dim(head_dim, f"model {args.model_path!r}")
        except ValueError as error:
            raise UsageError(f"--kv-dtype {args.kv_dtype}: {error}") from None
    if args.max_memory is not None and shapes is not None:
        block_size = 16 if given_block_size == "auto" else given_block_size  # "auto": at least 16 (a lower bound)
        _check_memory(args.max_memory, block_size, args.dtype, shapes, args.kv_dtype or "auto")


def kv_offload_options(args) -> dict | None:
    """The `kv_offload` dict of the `--kv-offload-*` options; `None` without any."""
    options = {
        "dir": args.kv_offload_dir,
        "disk_bytes": args.kv_offload_disk,
        "remote": args.kv_offload_remote,
        "remote_bytes": args.kv_offload_remote_bytes,
        "host_bytes": args.kv_offload_host,
    }
    options = {name: value for name, value in options.items() if value is not None}
    return options or None


def _check_kv_offload(args) -> None:
    """Refuse `--kv-offload-*` options that cannot work before the model loads: sizes without their tier, a
    directory that cannot be written, a Redis server that does not answer."""
    from ..offload.config import OffloadConfig
    from ..offload.stores import RedisStore, check_writable_directory

    options = kv_offload_options(args)
    if options is None:
        return
    if not args.prefix_caching:
        raise UsageError("--kv-offload-* keeps the prefix cache's blocks; with --no-prefix-caching there are none")
    if args.tp > 1:
        raise UsageError(f"--kv-offload-* is not supported with --tp {args.tp} yet (one process's pool only)")
    flags = {"disk_bytes": "--kv-offload-disk", "remote_bytes": "--kv-offload-remote-bytes", "dir": "--kv-offload-dir"}
    try:
        config = OffloadConfig.from_dict(options)
    except ValueError as error:
        message = str(error)
        for key, flag in {**flags, "remote": "--kv-offload-remote"}.items():
            message = message.replace(f"kv_offload {key}", flag).replace(f"'{key}'", flag)
        raise UsageError(message) from None
    try:
        if config.dir is not None:
            check_writable_directory(config.dir)
        if config.remote is not None:
            RedisStore(config.remote, config.resolved_remote_bytes, timeout=3.0).client.close()
    except (ValueError, ImportError) as error:
        message = (
            str(error)
            .replace("kv_offload dir=", "--kv-offload-dir ")
            .replace("kv_offload remote=", "--kv-offload-remote ")
        )
        raise UsageError(message) from None


def _check_cuda_graphs(device: str | None) -> None:
    """Refuse `--cuda-graphs` where the model will not be on a CUDA device."""
    import torch

    on = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(on).type != "cuda":
        where = f"--device {device}" if device else "this machine has no CUDA device"
        raise UsageError(f"--cuda-graphs needs a CUDA device; {where} (leave --cuda-graphs out)")


def _compile_now(engine) -> None:
    """Compile the engine's steps before the first request: two short requests of one token, generated to a few
    tokens (the first step runs eagerly, the next ones compile; the runner logs the compile time), then the same on
    the first LoRA adapter loaded (steps with adapters compile a forward of their own)."""
    logger.info("hf_paged: compiling the engine's steps before serving (about a minute for a 135M model on 2 CPU "
                "cores, a minute more with --lora; --exact or --no-compile serve eager steps uncompiled)")  # fmt: skip
    engine.generate([[engine.pad_token_id]] * 2, max_new_tokens=3)
    for adapter in engine.adapters.names[:1]:
        engine.generate([[engine.pad_token_id]] * 2, max_new_tokens=3, adapter=adapter)


def _check_kernel(name: str, device: str | None, block_size: int | str) -> None:
    import torch

    from ..kernels import auto_block_size, available_kernels, unavailable_reason

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    block_size = auto_block_size(device, name) if block_size == "auto" else block_size
    reason = unavailable_reason(name, device, block_size)
    if reason is not None:
        raise UsageError(
            f"--kernel {name} cannot run here: {reason}; kernels available on {device} with --block-size "
            f"{block_size}: {', '.join(available_kernels(device, block_size))}"
        )


def _check_cpu_linear(device: str | None) -> None:
    import torch

    from ..cpu_linear import onednn_available

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type != "cpu":
        raise UsageError(f"--cpu-linear onednn packs CPU weights, but the model goes to {device} (use stock)")
    if not onednn_available():
        raise UsageError(f"--cpu-linear onednn: torch {torch.__version__} here has no oneDNN CPU matmul")


def _check_device(name: str) -> None:
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as error:
        raise UsageError(f"--device {name!r} is not a device: {error}") from None
    if device.type == "cpu":
        return
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if device.type == "mps":
        available = torch.backends.mps.is_available
    if available is None or not available():
        raise UsageError(f"--device {name}: this machine has no {device.type.upper()} device (torch sees none)")
    count = getattr(backend, "device_count", None)
    if device.index is not None and count is not None and device.index >= count():
        raise UsageError(f"--device {name}: there is no device {device.index}; {count()} visible (0 to {count() - 1})")


def _check_model_path(path: str, gguf_file: str | None) -> dict | None:
    """The model folder's config.json (`None` where there is none to read: a Hub id, a GGUF file)."""
    folder = Path(path).expanduser()
    if not folder.exists():
        if path.startswith((".", "/", "~")) or ".." in path or "--" in path or not _HUB_ID.match(path):
            raise UsageError(f"model path {path!r}: no such folder, and not a Hugging Face Hub id (owner/name)")
        return None  # a Hub id: from_pretrained downloads it (or says it does not exist)
    if not folder.is_dir():
        raise UsageError(
            f"model path {path!r} is a file: give the folder that holds the model (a GGUF file: the folder, then "
            "--gguf-file NAME)"
        )
    if gguf_file is not None:
        if not (folder / gguf_file).is_file():
            raise UsageError(f"--gguf-file {gguf_file!r}: no such file in {path}")
        return None
    config = folder / "config.json"
    if not config.is_file():
        ggufs = sorted(p.name for p in folder.glob("*.gguf"))
        hint = f"; to load a GGUF file, add --gguf-file {ggufs[0]}" if ggufs else ""
        raise UsageError(f"model folder {path!r} has no config.json, so no model to load{hint}")
    try:
        return json.loads(config.read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"model folder {path!r}: its config.json cannot be read: {error}") from None


def _kv_shapes(config: dict) -> list[tuple[int, int]] | None:
    """`(KV heads, head dim)` of every layer of a model's config.json, as the pool reads them: a heterogeneous
    config's layers with their own values (transformers' `per_layer_config`, e.g. Gemma 4's full-attention layers);
    `None` for an unusual config (the pool says what it needs when it is sized)."""
    text = config.get("text_config") or config
    overrides = text.get("per_layer_config") or {}

    def read(values, *names):  # the usual name, then GPT-2's
        return next(values[name] for name in names if name in values)

    try:
        shapes = []
        for layer in range(int(read(text, "num_hidden_layers", "n_layer"))):
            values = {**text, **(overrides.get(str(layer)) or overrides.get(layer) or {})}
            heads = int(read(values, "num_attention_heads", "n_head"))
            kv_heads = int(values.get("num_key_value_heads") or heads)
            head_dim = int(values.get("head_dim") or int(read(values, "hidden_size", "n_embd")) // heads)
            shapes.append((kv_heads, head_dim))
    except (StopIteration, TypeError, ValueError, ZeroDivisionError, AttributeError):
        return None
    return shapes or None


def _check_memory(max_memory: str, block_size: int, dtype: str, shapes: list[tuple[int, int]], kv_dtype: str) -> None:
    """Refuse a `--max-memory` below one block of K and V in every layer (a lower bound of the pool's own
    figure: 2-byte values unless `--dtype float32`; quantized pages: their codes and scales)."""
    fmt = kv_format(kv_dtype)

    def head_bytes(head_dim: int) -> tuple[int, str]:
        if fmt.quantized:
            return fmt.bytes_per_head(head_dim, None), f"({head_dim} x {fmt.bits} bits + a 2-byte scale) bytes"
        return head_dim * _DTYPE_BYTES.get(dtype, 2), f"{head_dim} x {_DTYPE_BYTES.get(dtype, 2)} bytes"

    block_bytes = 2 * block_size * sum(kv_heads * head_bytes(head_dim)[0] for kv_heads, head_dim in shapes)
    budget = _size(max_memory)
    if budget >= block_bytes:
        return
    kinds = list(dict.fromkeys(shapes))  # the layers' shapes, in order of first appearance
    if len(kinds) == 1:
        (kv_heads, head_dim), layers = kinds[0], f"{len(shapes)} layers"
        terms = f"{layers} x K and V x {kv_heads} KV heads x {head_bytes(head_dim)[1]}"
    else:
        parts = [f"{shapes.count(k)} layers x {k[0]} KV heads x {head_bytes(k[1])[1]}" for k in kinds]
        terms = f"K and V x ({' + '.join(parts)})"
    raise UsageError(
        f"--max-memory {max_memory} ({budget} bytes) is less than one KV block of this model: {block_size} "
        f"tokens x {terms} = {block_bytes} bytes"
    )


def api_key(args) -> str | None:
    """`--api-key`, else `$HF_PAGED_API_KEY` (an empty value means no key)."""
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def load(args, tensor_parallel: bool = False):
    """`(model, tokenizer, served name)` from the command line options; a GGUF file is converted once and loaded
    from its cached copy afterwards (`gguf_cache.converted_gguf`). With `tensor_parallel`, every rank of the
    initialized process group loads its shard (`tp_plan="auto"`) on its own device."""
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .gguf_cache import converted_gguf

    path, extra = args.model_path, {}
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    if args.gguf_file:
        if dtype == "auto":
            dtype = torch.float32
        try:
            path = str(converted_gguf(args.model_path, args.gguf_file))
        except FileNotFoundError:  # not a local file (a Hub id): converted by transformers on every start
            logger.warning("hf_paged: %s is not a local file; it is converted without caching", args.gguf_file)
            extra = {"gguf_file": args.gguf_file}
    tokenizer = AutoTokenizer.from_pretrained(path, **extra)
    if tensor_parallel:
        from transformers.distributed import DistributedConfig

        extra["distributed_config"] = DistributedConfig(tp_plan="auto")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra)
    if not tensor_parallel:
        model.to(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.eval()
    name = args.served_model_name or Path(args.model_path).name
    return model, tokenizer, name


def serve(args) -> None:
    """Serve the model: in this process, or (in a rank `launcher.launch` started) as one rank of `--tp` ranks:
    rank 0 serves HTTP over a `DistributedEngine`, the others follow it."""
    import uvicorn

    from ..engine import Engine
    from ..engine.distributed import DistributedEngine, init_distributed
    from .launcher import launched_rank
    from .loop import EngineLoop
    from .server import create_app
    from .shutdown import GracefulServer

    rank = launched_rank()
    prefix = "" if rank is None else f"rank {rank}: "
    log_format = f"%(asctime)s %(levelname)s %(name)s: {prefix}%(message)s"
    logging.basicConfig(level=args.log_level.upper(), format=log_format)
    if rank is not None:
        init_distributed(args.tp_timeout)
    model, tokenizer, name = load(args, tensor_parallel=rank is not None)
    pool_options = {"block_size": args.block_size}
    if args.kernel is not None:
        pool_options["kernel"] = args.kernel
    if args.kv_dtype is not None:
        pool_options["kv_dtype"] = args.kv_dtype
    if args.num_blocks is not None:
        pool_options["num_blocks"] = args.num_blocks
    if args.max_memory is not None:
        pool_options["max_memory"] = args.max_memory
    if not args.prefix_caching:
        pool_options["prefix_caching"] = False
    if kv_offload_options(args) is not None:
        pool_options["kv_offload"] = kv_offload_options(args)
    try:
        engine = Engine(
            model,
            tokenizer,
            max_batch_size=args.max_batch_size,
            max_prefill_tokens=args.max_prefill_tokens,
            max_num_batched_tokens=args.max_num_batched_tokens,
            progress=False,
            adapters=dict(args.lora),
            max_adapters=args.max_loras,
            max_rank=args.max_lora_rank,
            cpu_linear=args.cpu_linear,
            compile="auto" if args.compile is None else args.compile,
            exact=args.exact,
            cuda_graphs="auto" if args.cuda_graphs is None else args.cuda_graphs,
            **pool_options,
        )
    except ValueError as error:  # a pool the options cannot size (--max-memory below one block, ...)
        raise UsageError(str(error)) from None
    if engine.runner.compile:
        _compile_now(engine)
    if rank is not None:
        import torch.distributed as dist

        engine = DistributedEngine(engine, timeout_s=args.tp_timeout, exit_on_failure=True)
        if rank != 0:
            if hasattr(signal, "SIGINT"):
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
            engine.follow()
            dist.destroy_process_group()
            return
    loop = EngineLoop(engine, model_name=name)
    app = create_app(loop, name, api_key(args), max_body_bytes=args.max_body_size, lora_paths=dict(args.lora))
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_grace + 5,  # a backstop: the engine loop aborts at the grace end
    )
    ranks = "" if rank is None else f", tensor parallel over {args.tp} ranks"
    logger.info("serving %s on http://%s:%d (pool: %r%s)", name, args.host, args.port, engine.pool, ranks)
    try:
        GracefulServer(config, loop, args.shutdown_grace).run()
    finally:
        loop.stop()  # closes the engine: with --tp, the followers are released and exit
        logger.info("hf_paged: stopped; %d KV blocks in use", engine.pool.stats().num_used)
    if rank is not None:
        import torch.distributed as dist

        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    from .launcher import check_tp_degree, launch, launched_rank

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    serve_parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    if args.command == "serve" and (problem := check_loras(args)) is not None:
        serve_parser.error(problem)
    try:
        check_serve_args(args)  # before any model loads: a usage error, not a traceback after minutes of loading
    except UsageError as error:
        serve_parser.error(str(error))
    try:
        if args.command == "serve" and args.tp > 1 and launched_rank() is None:
            logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            try:
                check_tp_degree(args.model_path, args.tp, gguf_file=args.gguf_file, device=args.device)
            except ValueError as error:
                serve_parser.error(str(error))
            return launch(argv, args.tp)
        if args.command == "serve":
            serve(args)
    except UsageError as error:  # found once the model is loaded (the pool's size for --max-memory, ...)
        serve_parser.error(str(error))
    except KeyboardInterrupt:  # before the server took over the signals (e.g. while the model loads)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
