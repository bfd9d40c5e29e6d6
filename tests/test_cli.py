"""`hf-paged` command line: defaults and refusals (the server itself is exercised in test_server.py)."""

from __future__ import annotations

import time

import pytest
import transformers

from hf_paged.serve.cli import build_parser


def test_serve_defaults_to_loopback():
    args = build_parser().parse_args(["serve", "some/model"])
    assert (args.model_path, args.host, args.port, args.block_size, args.api_key) == (
        "some/model",
        "127.0.0.1",
        8000,
        None,  # the pool's default: 16, or 64 for --kv-dtype int4-channel
        None,
    )


def test_engine_limits_are_options():
    args = build_parser().parse_args(["serve", "m", "--max-batch-size", "8", "--max-prefill-tokens", "512"])
    assert (args.max_batch_size, args.max_prefill_tokens) == (8, 512)
    assert build_parser().parse_args(["serve", "m"]).max_prefill_tokens == 4096
    assert build_parser().parse_args(["serve", "m"]).max_num_batched_tokens == 512
    assert build_parser().parse_args(["serve", "m", "--max-num-batched-tokens", "128"]).max_num_batched_tokens == 128
    assert build_parser().parse_args(["serve", "m"]).cpu_linear == "stock"
    assert build_parser().parse_args(["serve", "m", "--cpu-linear", "onednn"]).cpu_linear == "onednn"
    assert build_parser().parse_args(["serve", "m"]).prefix_caching is True
    assert build_parser().parse_args(["serve", "m", "--no-prefix-caching"]).prefix_caching is False


def test_block_size_may_be_auto():
    assert build_parser().parse_args(["serve", "m", "--block-size", "auto"]).block_size == "auto"


def test_num_blocks_and_max_memory_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--num-blocks", "8", "--max-memory", "1GiB"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_command_is_required(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([])
    assert "serve" in capsys.readouterr().err


def test_body_limit_and_shutdown_grace_are_options(capsys):
    defaults = build_parser().parse_args(["serve", "m"])
    assert (defaults.max_body_size, defaults.shutdown_grace) == (4 * 2**20, 10.0)
    args = build_parser().parse_args(["serve", "m", "--max-body-size", "512KiB", "--shutdown-grace", "2.5"])
    assert (args.max_body_size, args.shutdown_grace) == (512 * 1024, 2.5)
    assert build_parser().parse_args(["serve", "m", "--max-body-size", "1000"]).max_body_size == 1000
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--max-body-size", "lots"])
    assert "is not a memory size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--shutdown-grace", "-1"])
    assert "the grace period must be >= 0 seconds, got -1" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- refusals
@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A model folder as far as the checks read it: a tiny Llama's config.json (2 layers, 4 KV heads of 16)."""
    from hf_paged.reference_models import tiny_model

    folder = tmp_path_factory.mktemp("model")
    tiny_model("llama").config.save_pretrained(folder)
    return folder


BAD_OPTIONS = {
    "block-size-0": (["--block-size", "0"], "argument --block-size: must be an integer >= 1, got 0"),
    "num-blocks-0": (["--num-blocks", "0"], "argument --num-blocks: must be an integer >= 1, got 0"),
    "max-batch-size-0": (["--max-batch-size", "0"], "argument --max-batch-size: must be an integer >= 1, got 0"),
    "max-prefill-tokens-0": (["--max-prefill-tokens", "0"], "argument --max-prefill-tokens: must be an integer >= 1"),
    "max-batched-tokens-x": (["--max-num-batched-tokens", "x"],
                             "argument --max-num-batched-tokens: must be an integer >= 1, got 'x'"),
    "max-memory-abc": (["--max-memory", "abc"], "argument --max-memory: 'abc' is not a memory size"),
    "max-memory-0": (["--max-memory", "0"], "argument --max-memory: size must be > 0 bytes"),
    # one block: 16 tokens x 2 layers x K and V x 2 KV heads x 16 x 4 bytes (float32) = 8,192 bytes
    "max-memory-1KiB": (["--max-memory", "1KiB", "--dtype", "float32"],
                        "--max-memory 1KiB (1024 bytes) is less than one KV block of this model: 16 tokens x 2 layers "
                        "x K and V x 2 KV heads x 16 x 4 bytes = 8192 bytes"),
    "batched-below-batch": (["--max-batch-size", "64", "--max-num-batched-tokens", "32"],
                            "--max-num-batched-tokens 32 is below --max-batch-size 64: a step holds one token of "
                            "every running request"),
    "not-a-device": (["--device", "gpu0"], "--device 'gpu0' is not a device"),
    "port": (["--port", "70000"], "argument --port: must be a port number in [0, 65535], got 70000"),
    "kernel": (["--kernel", "fast"], "argument --kernel: invalid choice: 'fast'"),
    "kernel-not-here": (["--kernel", "flash", "--device", "cpu"],
                        "--kernel flash cannot run here: it needs the flash-attn package, which is not installed: "
                        "pip install 'hf_paged[flash]'; kernels available on cpu with --block-size 16: auto, gather"),
    "kv-dtype": (["--kv-dtype", "fp4"], "argument --kv-dtype: invalid choice: 'fp4'"),
    "cpu-linear": (["--cpu-linear", "mkl"], "argument --cpu-linear: invalid choice: 'mkl'"),
    # int8 pages: 16 tokens x 2 layers x K and V x 2 KV heads x (16 + 2) bytes = 2,304 bytes
    "max-memory-int8": (["--max-memory", "2KiB", "--kv-dtype", "int8"],
                        "--max-memory 2KiB (2048 bytes) is less than one KV block of this model: 16 tokens x 2 layers "
                        "x K and V x 2 KV heads x (16 x 8 bits + a 2-byte scale) bytes = 2304 bytes"),
    "log-level": (["--log-level", "loud"], "argument --log-level: must be one of critical, error, warning, info"),
}  # fmt: skip


def refused(argv: list[str], monkeypatch, capsys) -> str:
    """Run `hf-paged ARGV` in this process; returns its one error line after checking it exits with status 2 within
    3 s, before any model is loaded, without a traceback."""
    from hf_paged.serve import cli

    def load(*_, **__):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(cli, "load", load)
    start = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and elapsed < 3, (exit_info.value.code, elapsed, err)
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and err.startswith("usage: hf-paged serve") and "Traceback" not in err, err
    return errors[0].removeprefix("hf-paged serve: error: ")


@pytest.mark.parametrize("case", BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_bad_options_are_usage_errors_before_the_model_loads(model_folder, monkeypatch, capsys, case):
    options, message = case
    assert refused(["serve", str(model_folder), *options], monkeypatch, capsys).startswith(message)


def test_a_device_this_machine_lacks_is_a_usage_error(model_folder, monkeypatch, capsys):
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        message = refused(["serve", str(model_folder), "--device", f"cuda:{count}"], monkeypatch, capsys)
        assert message.startswith(f"--device cuda:{count}: there is no device {count}; {count} visible")
    else:
        message = refused(["serve", str(model_folder), "--device", "cuda"], monkeypatch, capsys)
        assert message == "--device cuda: this machine has no CUDA device (torch sees none)"


def test_packed_cpu_linears_this_torch_or_device_cannot_run_are_usage_errors(model_folder, monkeypatch, capsys):
    import torch

    from hf_paged import cpu_linear

    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA machine: the model would go there
        message = refused(["serve", str(model_folder), "--cpu-linear", "onednn"], monkeypatch, capsys)
        assert message == "--cpu-linear onednn packs CPU weights, but the model goes to cuda (use stock)"
        monkeypatch.undo()
    monkeypatch.setattr(cpu_linear, "onednn_available", lambda: False)
    message = refused(["serve", str(model_folder), "--cpu-linear", "onednn", "--device", "cpu"], monkeypatch, capsys)
    assert message == f"--cpu-linear onednn: torch {torch.__version__} here has no oneDNN CPU matmul"


def test_a_model_path_that_holds_no_model_is_a_usage_error(model_folder, tmp_path, monkeypatch, capsys):
    path = str(tmp_path / "no-such-model")
    missing = refused(["serve", path], monkeypatch, capsys)
    assert missing == f"model path {path!r}: no such folder, and not a Hugging Face Hub id (owner/name)"
    assert "no such folder" in refused(["serve", "./my-model"], monkeypatch, capsys)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert "--gguf-file model.gguf" in refused(["serve", str(tmp_path)], monkeypatch, capsys)  # no config.json
    assert "is a file" in refused(["serve", str(tmp_path / "model.gguf")], monkeypatch, capsys)
    assert "no such file" in refused(["serve", str(tmp_path), "--gguf-file", "other.gguf"], monkeypatch, capsys)


def test_max_memory_is_checked_layer_by_layer_as_the_pool_sizes_a_heterogeneous_config(tmp_path, monkeypatch, capsys):
    """Gemma 4 with a full-attention layer of 1 KV head of 16 where its sliding layers have 2 (transformers'
    `per_layer_config`): one block is what the pool says it is, not the global head counts times the layers (which
    refused a --max-memory the pool holds)."""
    from hf_paged.pool import KVShape
    from hf_paged.reference_models import tiny_model
    from hf_paged.serve import cli

    config = tiny_model("gemma4").config.to_dict()
    config["per_layer_config"] = {"2": {"head_dim": 16, "num_key_value_heads": 1}}
    config = transformers.Gemma4TextConfig.from_dict(config)
    config.save_pretrained(tmp_path)
    block_bytes = KVShape.from_model(transformers.Gemma4ForCausalLM(config)).bytes_per_token * 16  # fp32, 16 tokens
    assert block_bytes == 10240  # 16 tokens x K and V x (2 x 2 x 16 + 1 x 16) x 4 bytes; the globals say 12288
    options = ["serve", str(tmp_path), "--dtype", "float32", "--block-size", "16"]
    cli.check_serve_args(cli.build_parser().parse_args([*options, "--max-memory", str(block_bytes)]))
    message = refused([*options, "--max-memory", str(block_bytes - 1)], monkeypatch, capsys)
    assert message == (
        "--max-memory 10239 (10239 bytes) is less than one KV block of this model: 16 tokens x K and V x (2 layers x "
        "2 KV heads x 16 x 4 bytes + 1 layers x 1 KV heads x 16 x 4 bytes) = 10240 bytes"
    )


def test_int4_pages_of_an_odd_head_dim_are_a_usage_error(tmp_path, monkeypatch, capsys):
    from hf_paged.reference_models import tiny_model

    tiny_model("gpt2", n_embd=36, n_head=4).config.save_pretrained(tmp_path)  # head_dim 9
    message = refused(["serve", str(tmp_path), "--kv-dtype", "int4"], monkeypatch, capsys)
    assert message.startswith("--kv-dtype int4: kv_dtype='int4' packs 2 values a byte and needs an even head_dim")
    assert "head_dim=9" in message


def test_the_help_states_the_batched_tokens_rule():
    help_text = " ".join(build_parser()._actions[-1].choices["serve"].format_help().split())
    assert "at least --max-batch-size" in help_text


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--lora", "no-equals-sign"], "expected NAME=PATH, got 'no-equals-sign'"),
        (["--lora", "=path"], "expected NAME=PATH, got '=path'"),
        (["--lora", "a=/no/such/adapter"], "'/no/such/adapter' is no PEFT adapter directory"),
        (["--lora", "a={adapter}", "--lora", "a={adapter}"], "the name 'a' is given twice"),
        (["--lora", "m={adapter}"], "'m' is the base model's name"),
        (["--lora", "a={adapter}", "--lora", "b={adapter}", "--max-loras", "1"], "2 adapters, above --max-loras 1"),
        (["--lora", "a={adapter}", "--tp", "2"], "--lora cannot be combined with --tp"),
    ],
)
def test_malformed_lora_options_are_usage_errors_before_the_model_loads(tmp_path, capsys, options, message):
    from hf_paged.serve.cli import main

    (tmp_path / "adapter_config.json").write_text("{}")
    options = [option.format(adapter=tmp_path) for option in options]
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "/no/such/model/m", *options])  # the model path is never read
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_compile_with_tensor_parallel_ranks_is_a_usage_error_before_the_model_loads(capsys):
    from hf_paged.serve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "/no/such/model/m", "--compile", "--tp", "2"])  # the model path is never read
    assert exit_info.value.code == 2
    assert "--compile runs one process's steps; with --tp 2 leave it off (--no-compile)" in capsys.readouterr().err


def test_compile_with_packed_cpu_linear_layers_is_a_usage_error_before_the_model_loads(capsys):
    from hf_paged.serve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "/no/such/model/m", "--compile", "--cpu-linear", "onednn"])
    assert exit_info.value.code == 2
    assert "--compile packs the linear weights itself" in capsys.readouterr().err


def test_compile_defaults_to_auto_and_exact_to_off():
    parse = build_parser().parse_args
    assert (parse(["serve", "m"]).compile, parse(["serve", "m"]).exact) == (None, False)  # None: Engine's "auto"
    assert parse(["serve", "m", "--compile"]).compile is True
    assert parse(["serve", "m", "--no-compile"]).compile is False
    assert parse(["serve", "m", "--exact"]).exact is True
    assert parse(["serve", "m"]).cuda_graphs is None and parse(["serve", "m", "--cuda-graphs"]).cuda_graphs is True


@pytest.mark.parametrize(
    "options, message",
    [
        (["--cuda-graphs", "--device", "cpu"], "--cuda-graphs needs a CUDA device; --device cpu"),
        (["--cuda-graphs", "--tp", "2"], "--cuda-graphs runs one process's steps; with --tp 2 leave it off"),
        (["--cuda-graphs", "--exact"], "--exact runs the eager steps, bit-exact with generate; --cuda-graphs"),
    ],
)
def test_cuda_graphs_conflicts_are_usage_errors_before_the_model_loads(options, message, capsys):
    from hf_paged.serve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "/no/such/model/m", *options])  # the model path is never read
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "options, message",
    [
        (["--exact", "--compile"], "--exact runs the eager steps, bit-exact with generate; --compile runs compiled"),
        (["--exact", "--cpu-linear", "onednn"], "--exact keeps the model's own linear layers; --cpu-linear onednn"),
    ],
)
def test_exact_with_an_inexact_option_is_a_usage_error_before_the_model_loads(options, message, capsys):
    from hf_paged.serve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "/no/such/model/m", *options])  # the model path is never read
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "options, message",
    [
        (["--kv-offload-dir", "{file}/kv"], "--kv-offload-dir '{file}/kv' cannot be written"),
        (["--kv-offload-disk", "20GiB"], "--kv-offload-disk"),
        (["--kv-offload-disk", "lots", "--kv-offload-dir", "{tmp}"], "argument --kv-offload-disk"),
        (["--kv-offload-remote", "http://localhost:6379"], "is not a Redis URL"),
        (["--kv-offload-remote", "redis://127.0.0.1:{port}/0"], "cannot be reached"),
        (["--kv-offload-dir", "{tmp}", "--no-prefix-caching"], "with --no-prefix-caching there are none"),
    ],
)
def test_kv_offload_options_are_checked_before_the_model_loads(tmp_path, capsys, options, message):
    import socket

    pytest.importorskip("redis")
    from hf_paged.serve.cli import main

    (tmp_path / "file").write_text("not a directory")
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    fill = {"file": tmp_path / "file", "tmp": tmp_path, "port": port}
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "/no/such/model/m", *[option.format(**fill) for option in options]])  # never read
    assert exit_info.value.code == 2
    assert message.format(**fill) in capsys.readouterr().err


def test_kv_offload_options_become_the_engines_kv_offload():
    from hf_paged.serve.cli import kv_offload_options

    args = build_parser().parse_args(["serve", "m", "--kv-offload-dir", "/tmp/kv", "--kv-offload-disk", "2GiB"])
    assert kv_offload_options(args) == {"dir": "/tmp/kv", "disk_bytes": "2GiB"}
    assert kv_offload_options(build_parser().parse_args(["serve", "m"])) is None
