"""`hf-paged`: command line entry point (`hf-paged serve MODEL_PATH ...`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..config import parse_memory

logger = logging.getLogger("hf_paged.serve")

API_KEY_ENV = "HF_PAGED_API_KEY"
DEFAULT_MAX_BODY = "4MiB"
DEFAULT_SHUTDOWN_GRACE_S = 10.0


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
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    serve.add_argument("--device", default=None, help="e.g. cuda:0 (default: cuda when available, else cpu)")
    serve.add_argument("--block-size", type=int, default=16)
    size = serve.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, help="KV blocks in the pool")
    size.add_argument("--max-memory", help='KV memory for the pool, e.g. "512MiB"')
    serve.add_argument("--max-batch-size", type=int, default=64)
    serve.add_argument(
        "--max-prefill-tokens", type=int, default=4096, help="tokens per prefill forward; longer prompts are chunked"
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
    serve.add_argument("--log-level", default="info")
    return parser


def _size(value: str) -> int:
    try:
        return parse_memory(int(value) if value.isdigit() else value)
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error).replace("max_memory", "size")) from None


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"the grace period must be >= 0 seconds, got {value}")
    return seconds


def api_key(args) -> str | None:
    """`--api-key`, else `$HF_PAGED_API_KEY` (an empty value means no key)."""
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def load(args):
    """`(model, tokenizer, served name)` from the command line options; a GGUF file is converted once and loaded
    from its cached copy afterwards (`gguf_cache.converted_gguf`)."""
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
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    name = args.served_model_name or Path(args.model_path).name
    return model, tokenizer, name


def serve(args) -> None:
    import uvicorn

    from ..engine import Engine
    from .loop import EngineLoop
    from .server import create_app
    from .shutdown import GracefulServer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model, tokenizer, name = load(args)
    pool_options = {"block_size": args.block_size}
    if args.num_blocks is not None:
        pool_options["num_blocks"] = args.num_blocks
    if args.max_memory is not None:
        pool_options["max_memory"] = args.max_memory
    engine = Engine(
        model,
        tokenizer,
        max_batch_size=args.max_batch_size,
        max_prefill_tokens=args.max_prefill_tokens,
        progress=False,
        **pool_options,
    )
    loop = EngineLoop(engine)
    app = create_app(loop, name, api_key(args), max_body_bytes=args.max_body_size)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_grace + 5,  # a backstop: the engine loop aborts at the grace end
    )
    logger.info("serving %s on http://%s:%d (pool: %r)", name, args.host, args.port, engine.pool)
    try:
        GracefulServer(config, loop, args.shutdown_grace).run()
    finally:
        loop.stop()
        logger.info("hf_paged: stopped; %d KV blocks in use", engine.pool.stats().num_used)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            serve(args)
    except KeyboardInterrupt:  # before the server took over the signals (e.g. while the model loads)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
