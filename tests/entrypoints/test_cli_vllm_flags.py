"""vLLM command-line flags: honoured, or refused by name before any model loads."""

import pytest

from raypaged.entrypoints.cli import build_parser, engine_configs
from tests.serving.conftest import tiny_model_dir  # noqa: F401  (session fixture)


def configs(*argv: str):
    return engine_configs(build_parser().parse_args(["serve", *argv]))


def test_vllm_style_flags_are_accepted(tiny_model_dir):
    [config] = configs(str(tiny_model_dir), "-tp", "1", "--trust-remote-code", "--disable-log-stats",
                       "--enable-chunked-prefill", "--kv-cache-dtype", "auto", "--max-model-len", "256")
    assert (config.tensor_parallel_size, config.max_model_len) == (1, 256)


@pytest.mark.parametrize("argv, message", [
    (["--quantization", "awq"], "--quantization awq is not supported: raypaged runs unquantized fp32/fp16/bf16 "
                                "weights only"),
    (["-q", "fp8"], "--quantization fp8 is not supported"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 is not supported: the KV cache keeps the model's dtype"),
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill is not supported: long prefills are always "
                                      "chunked within --max-num-batched-tokens"),
])
def test_what_cannot_be_honoured_is_refused_by_name(tiny_model_dir, argv, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        configs(str(tiny_model_dir), *argv)
