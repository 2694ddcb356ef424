"""vLLM command-line flags: honoured, or refused by name before any model loads."""

import re

import httpx
import pytest

from raypaged.entrypoints.cli import build_parser, engine_configs, main
from raypaged.entrypoints.server_args import gateway_options
from raypaged.entrypoints.vllm_options import LEGACY_FLAGS
from raypaged.serving.engine_server import EngineServer
from raypaged.structured.config import StructuredOutputsConfig
from tests.serving.conftest import Stack, tiny_config, tiny_model_dir  # noqa: F401  (session fixture)


def configs(*argv: str):
    return engine_configs(build_parser().parse_args(["serve", *argv]))


def test_vllm_style_flags_are_accepted(tiny_model_dir):
    [config] = configs(
        str(tiny_model_dir),
        "-tp",
        "1",
        "--trust-remote-code",
        "--disable-log-stats",
        "--enable-chunked-prefill",
        "--kv-cache-dtype",
        "auto",
        "--max-model-len",
        "256",
        # taken at the values raypaged has, or at any value where they change nothing here
        "--disable-custom-all-reduce",
        "--max-seq-len-to-capture",
        "8192",
        "--max-log-len",
        "100",
        "--code-revision",
        "main",
        "--max-parallel-loading-workers",
        "2",
        "--disable-sliding-window",
        "--limit-mm-per-prompt",
        '{"image": 0, "video": {"count": 0}}',
        "--task",
        "generate",
        "--runner",
        "generate",
        "-O0",
        "--model-impl",
        "auto",
        "--config-format",
        "hf",
        "--chat-template-content-format",
        "string",
        "--prefix-caching-hash-algo",
        "sha256",
    )
    assert (config.tensor_parallel_size, config.max_model_len) == (1, 256)
    assert config.chat_template_content_format == "string"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--quantization", "awq"],
            "--quantization awq needs a checkpoint quantized with awq, but the model's "
            "config.json has no quantization_config",
        ),
        (
            ["-q", "bitsandbytes"],
            "--quantization bitsandbytes is not supported (supported: awq, compressed-tensors, fp8, gptq)",
        ),
        (
            ["--kv-cache-dtype", "fp8", "--attention-backend", "cuda"],
            "--kv-cache-dtype fp8 runs in the torch attention backend: --attention-backend cuda reads a cache of the "
            "model's dtype (and an fp8 e4m3 one with RAYPAGED_FP8_KV_KERNELS=1)",
        ),
        (
            ["--kv-cache-dtype", "fp8_e5m2", "--attention-backend", "cpu"],
            "--kv-cache-dtype fp8_e5m2 runs in the torch attention backend: --attention-backend cpu reads float32 and "
            "fp8 e4m3 caches (--kv-cache-dtype fp8 or fp8_e4m3)",
        ),
        (
            ["--calculate-kv-scales"],
            "--calculate-kv-scales sets an fp8 KV cache's scales: it needs --kv-cache-dtype fp8 (the cache is the "
            "model's dtype, which takes no scales)",
        ),
        (
            ["-O3"],
            "--compilation-config 3 is not supported: the model is not compiled with torch.compile (level 0); "
            "CUDA graphs are on unless --enforce-eager",
        ),
        (
            ["--task", "reward"],
            "--task reward is not supported: --task is vLLM's older spelling of --runner and --convert: embed, "
            "classify and score are taken (as --runner pooling), generate and auto as they are; no reward or "
            "transcription task",
        ),
        (
            ["--task", "embed", "--convert", "classify"],
            "--task embed asks for --runner pooling with --convert embed, but --runner auto and --convert classify "
            "were given",
        ),
        (
            ["--enable-sleep-mode", "--enable-cumem-allocator"],
            "--enable-cumem-allocator is not supported: --enable-sleep-mode releases the weights and the KV cache by "
            "freeing them, and wake_up reads the weights back from the checkpoint (no cumem allocator)",
        ),
        (
            ["--skip-tokenizer-init"],
            "--skip-tokenizer-init is not supported: the engine tokenizes prompts and detokenizes outputs itself",
        ),
        (
            ["--model-impl", "transformers"],
            "--model-impl transformers is not supported: raypaged runs its own "
            "implementation of each supported architecture",
        ),
        (
            ["--limit-mm-per-prompt", '{"image": 1}'],
            "--limit-mm-per-prompt image: 1 is not supported: the model reads text only",
        ),
        (
            ["--prefix-caching-hash-algo", "builtin"],
            "--prefix-caching-hash-algo builtin is not supported: "
            "prefix-cache blocks are keyed by sha256 of their parent's key and their token ids",
        ),
        (
            ["--no-enable-chunked-prefill"],
            "--disable-chunked-prefill is not supported: long prefills are always "
            "chunked within --max-num-batched-tokens",
        ),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(tiny_model_dir, argv, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        configs(str(tiny_model_dir), *argv)


def test_quantization_and_kv_cache_dtype_flags_reach_the_engine_config(tiny_model_dir):
    [config] = configs(str(tiny_model_dir), "-q", "fp8", "--kv-cache-dtype", "fp8")
    assert (config.quantization, config.quant_config.name, config.quant_config.serialized) == ("fp8", "fp8", False)
    assert (config.kv_cache_dtype, config.resolved_kv_cache_dtype) == ("fp8", "float8_e4m3fn")
    [config] = configs(str(tiny_model_dir))
    assert (config.quant_config, config.resolved_kv_cache_dtype) == (None, config.resolved_dtype)


def test_structured_outputs_flags_set_the_engines_grammar_backend(tiny_model_dir):
    [config] = configs(
        str(tiny_model_dir),
        "--structured-outputs-config",
        '{"backend": "auto", "disable_any_whitespace": false, "max_whitespace": 2}',
    )
    assert config.structured_outputs_config == StructuredOutputsConfig(disable_any_whitespace=False, max_whitespace=2)
    [config] = configs(str(tiny_model_dir), "--guided-decoding-backend", "xgrammar")
    assert config.structured_outputs_config == StructuredOutputsConfig(backend="xgrammar")
    [config] = configs(str(tiny_model_dir), "--guided-decoding-backend", "guidance", "--reasoning-parser", "qwen3")
    assert config.structured_outputs_config == StructuredOutputsConfig(backend="guidance", reasoning_parser="qwen3")


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--guided-decoding-backend", "outlines"],
            "structured outputs backend 'outlines' is not supported (not built into raypaged); "
            "supported: auto, xgrammar, guidance",
        ),
        (
            ["--structured-outputs-config", '{"backend": "xgrammar", "enable_in_thinking": true}'],
            "--structured-outputs-config: unknown field 'enable_in_thinking'; allowed: backend, cache_mb, "
            "cache_size, disable_any_whitespace, enable_in_reasoning, max_compile_s, max_grammar_ms, "
            "max_whitespace, reasoning_parser",
        ),
    ],
)
def test_structured_outputs_flags_refuse_what_they_cannot_honour(tiny_model_dir, argv, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        configs(str(tiny_model_dir), *argv)


def test_metrics_prefix_vllm_exports_vllms_names(tiny_model_dir):
    assert build_parser().parse_args(["serve", "--metrics-prefix", "vllm"]).metrics_prefix == "vllm"
    stack = Stack([tiny_config(tiny_model_dir, "tiny")], metrics_prefix="vllm:")
    try:
        text = httpx.get(f"{stack.url}/metrics").text
    finally:
        stack.close()
    assert 'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0' in text
    assert "raypaged:" not in text


def test_a_bad_metrics_prefix_fails_before_any_model_loads(tiny_model_dir):
    with pytest.raises(ValueError, match=re.escape("metric prefix 'v-llm:' is not a Prometheus name followed by ':'")):
        EngineServer([tiny_config(tiny_model_dir, "tiny")], metrics_prefix="v-llm:")


def test_request_logging_is_off_unless_enabled():

    def logs(*argv: str) -> bool:
        return gateway_options(build_parser().parse_args(["serve", *argv])).log_requests

    assert (logs(), logs("--enable-log-requests"), logs("--enable-log-requests", "--disable-log-requests")) == (
        False,
        True,
        False,
    )


def test_chat_flags_reach_the_engine_and_the_gateway(tiny_model_dir, tmp_path):

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    args = build_parser().parse_args(
        [
            "serve",
            str(tiny_model_dir),
            "--chat-template",
            str(template),
            "--default-chat-template-kwargs",
            '{"enable_thinking": false}',
            "--trust-request-chat-template",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "pythonic",
            "--response-role",
            "bot",
        ]
    )
    [config] = engine_configs(args)
    assert (config.chat_template_text, config.default_chat_template_kwargs, config.trust_request_chat_template) == (
        "{% for m in messages %}{{ m.content }}{% endfor %}",
        {"enable_thinking": False},
        True,
    )
    options = gateway_options(args)
    assert (options.enable_auto_tool_choice, options.tool_call_parser, options.response_role) == (
        True,
        "pythonic",
        "bot",
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--chat-template", "no-such-file.jinja"],
            "--chat-template 'no-such-file.jinja' is neither a file nor a Jinja template",
        ),
        (["--default-chat-template-kwargs", "[1]"], "--default-chat-template-kwargs must be a JSON object, got [1]"),
    ],
)
def test_chat_flags_refuse_bad_values(tiny_model_dir, argv, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        configs(str(tiny_model_dir), *argv)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--enable-auto-tool-choice"],
            "--enable-auto-tool-choice needs --tool-call-parser (how the model writes its calls)",
        ),
        (
            ["--tool-call-parser", "qwen9"],
            "--tool-call-parser 'qwen9' is not supported; supported: deepseek_v3, deepseek_v31, glm45, granite, "
            "hermes, kimi_k2, llama3_json, llama4_pythonic, mistral, openai, phi4_mini_json, pythonic, qwen3_coder",
        ),
    ],
)
def test_tool_flags_refuse_what_they_cannot_honour(argv, message):

    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        gateway_options(build_parser().parse_args(["serve", *argv]))


def test_lora_flags_as_vllm(tiny_model_dir):
    from raypaged.entrypoints.cli import lora_modules

    argv = [
        "serve",
        str(tiny_model_dir),
        "--enable-lora",
        "--max-loras",
        "3",
        "--max-lora-rank",
        "32",
        "--max-cpu-loras",
        "5",
        "--lora-modules",
        "sql=/a/sql",
        '{"name": "chat", "path": "/a/chat"}',
    ]
    args = build_parser().parse_args(argv)
    [config] = engine_configs(args)
    assert (config.enable_lora, config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (True, 3, 32, 5)
    assert lora_modules(args) == {"sql": ("/a/sql", ""), "chat": ("/a/chat", "")}
    [plain] = configs(str(tiny_model_dir))
    assert plain.lora_config is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "a"], "--lora-modules takes name=path or JSON, got 'a'"),
        (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "--lora-modules names 'a' twice"),
        (
            ["--enable-lora", "--max-cpu-loras", "0"],
            "--max-cpu-loras 0 is below --max-loras 1: every adapter on the device is also kept on the CPU",
        ),
    ],
)
def test_lora_flags_refuse_what_they_cannot_honour(tiny_model_dir, argv, message):
    from raypaged.entrypoints.cli import lora_modules

    args = build_parser().parse_args(["serve", str(tiny_model_dir), *argv])
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        lora_modules(args)
        engine_configs(args)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--distributed-executor-backend", "mp"],
            "--distributed-executor-backend mp is not supported: shards are Ray actors (ray)",
        ),
        (
            ["--max-long-partial-prefills", "2"],
            "--max-long-partial-prefills 2 is not supported: long prompts are not limited apart from the others: "
            "each is cut at --long-prefill-token-threshold",
        ),
        (["--cpu-offload-gb", "4"], "--cpu-offload-gb 4.0 is not supported: weights stay on the device"),
    ],
)
def test_vllm_flags_taken_only_at_their_default(tiny_model_dir, argv, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        configs(str(tiny_model_dir), *argv)
    configs(
        str(tiny_model_dir),
        "-pp",
        "1",
        "-dp",
        "1",
        "--distributed-executor-backend",
        "ray",
        "--tokenizer-mode",
        "auto",
        "--long-prefill-token-threshold",
        "0",
    )


def test_flags_spelled_with_underscores_are_the_dashed_flags(tiny_model_dir):
    """As vLLM's parser (Mistral's model cards write --tokenizer_mode mistral): the flag's name, not its value."""
    [config] = configs(
        str(tiny_model_dir),
        "--max_model_len",
        "256",
        "--tokenizer_mode=hf",
        "--served_model_name",
        "my_model",
        "--block_size=8",
    )
    assert (config.max_model_len, config.tokenizer_mode, config.block_size) == (256, "hf", 8)
    assert config.served_model_name == "my_model"
    with pytest.raises(SystemExit):  # argparse refuses an unknown flag however it is spelled
        configs(str(tiny_model_dir), "--no_such_flag", "1")
    with pytest.raises(SystemExit):
        configs(str(tiny_model_dir), "--tokenizer_mode", "slow")


def test_ssl_ca_certs_and_cert_reqs_require_client_certificates(tiny_model_dir, tmp_path):
    """--ssl-cert-reqs 2 with --ssl-ca-certs: a client without a certificate the CA signed is turned away."""
    import ssl

    from tests.entrypoints.test_cli_startup_flags import self_signed_certificate

    cert, key = self_signed_certificate(tmp_path)
    args = build_parser().parse_args(
        [
            "serve",
            "--ssl-certfile",
            str(cert),
            "--ssl-keyfile",
            str(key),
            "--ssl-ca-certs",
            str(cert),
            "--ssl-cert-reqs",
            "2",
        ]
    )

    options = gateway_options(args)
    assert (options.ssl_ca_certs, options.ssl_cert_reqs) == (str(cert), ssl.CERT_REQUIRED)
    stack = Stack(
        [tiny_config(tiny_model_dir, "tiny")],
        ssl_certfile=str(cert),
        ssl_keyfile=str(key),
        ssl_ca_certs=str(cert),
        ssl_cert_reqs=ssl.CERT_REQUIRED,
    )
    url = stack.url.replace("http://", "https://")
    try:
        trusted = ssl.create_default_context(cafile=str(cert))
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            httpx.get(f"{url}/v1/models", verify=trusted, timeout=10)
        trusted.load_cert_chain(str(cert), str(key))
        assert httpx.get(f"{url}/v1/models", verify=trusted, timeout=10).status_code == 200
    finally:
        stack.close()
    with pytest.raises(ValueError, match=re.escape("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile")):
        gateway_options(build_parser().parse_args(["serve", "--ssl-ca-certs", str(cert)]))


def test_disable_fastapi_docs_drops_the_openapi_document(tiny_model_dir):
    """vLLM's --disable-fastapi-docs: no /openapi.json (the Swagger and ReDoc pages are never served)."""
    args = build_parser().parse_args(["serve", str(tiny_model_dir), "--disable-fastapi-docs"])
    assert gateway_options(args).openapi_docs is False
    for openapi_docs, status in ((False, 404), (True, 200)):
        stack = Stack([tiny_config(tiny_model_dir, "tiny")], openapi_docs=openapi_docs)
        try:
            with stack.client() as client:
                assert client.get("/openapi.json").status_code == status
                assert client.get("/docs").status_code == client.get("/redoc").status_code == 404
        finally:
            stack.close()


def test_a_sliding_window_caps_the_context_as_disable_sliding_window_asks(tiny_model_dir):
    """Attention always spans the whole context, so a model's sliding window is its longest context: what vLLM's
    --disable-sliding-window does (the flag is accepted; without it the window caps the context too)."""
    window = ["--hf-overrides", '{"sliding_window": 100}']
    for extra in ([], ["--disable-sliding-window"]):
        [config] = configs(str(tiny_model_dir), *window, *extra)
        assert config.resolved_max_model_len == 100
    with pytest.raises(
        ValueError,
        match=re.escape(
            "max_model_len 200 exceeds the model's sliding_window (attention here spans the whole context) 100"
        ),
    ):
        configs(str(tiny_model_dir), *window, "--max-model-len", "200")


def test_kv_cache_memory_bytes_sizes_the_kv_cache(tiny_model_dir):
    """vLLM's --kv-cache-memory-bytes: that many bytes of whole KV blocks per shard, on any device, in place of
    --gpu-memory-utilization's profiling and of --kv-cache-space."""
    from raypaged.config import EngineConfig
    from raypaged.worker.worker import Worker

    [config] = configs(str(tiny_model_dir), "--kv-cache-memory-bytes", "123456")
    assert config.kv_cache_memory_bytes == 123456
    per_block = Worker(config, None).bytes_per_block()
    sized = EngineConfig(model=str(tiny_model_dir), device="cpu", kv_cache_memory_bytes=10 * per_block + per_block // 2)
    assert Worker(sized, None).determine_num_blocks()[0] == 10
    tiny = EngineConfig(model=str(tiny_model_dir), device="cpu", kv_cache_memory_bytes=per_block - 1)
    with pytest.raises(
        ValueError, match=re.escape(f"--kv-cache-memory-bytes {per_block - 1} is less than one KV block")
    ):
        Worker(tiny, None).determine_num_blocks()
    for other in ({"kv_cache_space": 1.0}, {"num_gpu_blocks_override": 8}):
        name = next(iter(other))
        with pytest.raises(ValueError, match=f"give one of kv_cache_memory_bytes and {name}: both size the KV cache"):
            EngineConfig(model=str(tiny_model_dir), kv_cache_memory_bytes=per_block, **other)


def test_vllms_older_task_flag_is_its_runner_and_convert(tiny_model_dir):  # noqa: F811
    """``--task embed`` (and ``LLM(task="embed")``) as ``--runner pooling --convert embed``, as older vLLM command
    lines spell an embedding model."""
    from raypaged import LLM

    [config] = configs(str(tiny_model_dir), "--task", "embed", "--max-model-len", "256")
    assert (config.runner, config.convert, config.pooler is not None) == ("pooling", "embed", True)
    llm = LLM(model=str(tiny_model_dir), task="embed", device="cpu", max_model_len=256, num_gpu_blocks_override=64)
    try:
        assert llm.llm_engine.config.pooler is not None and len(llm.embed("hi", use_tqdm=False)[0].outputs.embedding)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("flag", sorted(LEGACY_FLAGS))
def test_flags_vllm_no_longer_takes_are_refused_with_what_replaced_them(flag, capsys):
    """Older vLLM command lines (multi-step scheduling, the v2 block manager, --speculative-model, ...)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", "m", flag.replace("-", "_").replace("__", "--", 1) + "=1"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error == f"raypaged: error: {flag} is no longer a vLLM flag: {LEGACY_FLAGS[flag]}"
