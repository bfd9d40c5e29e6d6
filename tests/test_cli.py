"""`hf-paged` command line: defaults and refusals (the server itself is exercised in test_server.py)."""

from __future__ import annotations

import pytest

from hf_paged.serve.cli import build_parser


def test_serve_defaults_to_loopback():
    args = build_parser().parse_args(["serve", "some/model"])
    assert (args.model_path, args.host, args.port, args.block_size, args.api_key) == (
        "some/model",
        "127.0.0.1",
        8000,
        16,
        None,
    )


def test_engine_limits_are_options():
    args = build_parser().parse_args(["serve", "m", "--max-batch-size", "8", "--max-prefill-tokens", "512"])
    assert (args.max_batch_size, args.max_prefill_tokens) == (8, 512)
    assert build_parser().parse_args(["serve", "m"]).max_prefill_tokens == 4096
    assert build_parser().parse_args(["serve", "m"]).max_num_batched_tokens == 512
    assert build_parser().parse_args(["serve", "m", "--max-num-batched-tokens", "128"]).max_num_batched_tokens == 128


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
