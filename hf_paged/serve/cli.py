"""`hf-paged`: command line entry point (`hf-paged serve MODEL_PATH ...`)."""

from __future__ import annotations

import argparse
import logging
import sys

logger = logging.getLogger("hf_paged.serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-paged", description="PagedAttention for Hugging Face transformers")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model with an OpenAI-compatible API on the paged Engine")
    serve.add_argument("model_path", help="a folder (or Hub id) that AutoModelForCausalLM.from_pretrained loads")
    serve.add_argument("--gguf-file", help="a GGUF file inside MODEL_PATH to load (converted to the dtype below)")
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
    serve.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1/* routes")
    serve.add_argument("--log-level", default="info")
    return parser


def load(args):
    """`(model, tokenizer)` from the command line options."""
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    extra = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    if args.gguf_file and dtype == "auto":
        dtype = torch.float32
    tokenizer = AutoTokenizer.from_pretrained(args.model_path, **extra)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype, **extra)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    name = args.served_model_name or Path(args.model_path).name
    return model, tokenizer, name


def serve(args) -> None:
    import uvicorn

    from ..engine import Engine
    from .loop import EngineLoop
    from .server import create_app

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
    logger.info("serving %s on http://%s:%d (pool: %r)", name, args.host, args.port, engine.pool)
    try:
        uvicorn.run(create_app(loop, name, args.api_key), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        loop.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        serve(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
