"""Every flag of vLLM's ``vllm serve`` (``vllm_serve_flags.txt``: vLLM 0.34's, one flag a line: its name, its
other long names, then its short aliases; a switch's other long names are the spellings that turn it off) is a
flag of ``raypaged serve``: honoured, taken where it changes nothing here, or refused by name with the reason,
before any model loads."""

import argparse
import functools
import re
from pathlib import Path

import pytest

from raypaged import LLM
from raypaged.entrypoints.cli import build_parser, engine_configs
from raypaged.human_int import human_int
from raypaged.worker.graph_sizes import capture_sizes
from tests.serving.conftest import tiny_model_dir  # noqa: F401  (session fixture)

VLLM_FLAGS = [line.split() for line in (Path(__file__).parent / "vllm_serve_flags.txt").read_text().splitlines()]


@functools.cache
def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def configs(*argv: str):
    return engine_configs(build_parser().parse_args(["serve", *argv]))


def test_every_vllm_serve_flag_is_a_flag_of_raypaged_serve():
    known = set(serve_parser()._option_string_actions)
    assert len(VLLM_FLAGS) == 327
    assert [name for names in VLLM_FLAGS for name in names if name not in known] == []
    assert {"--enable-bf16x3-router-gemm", "--token-level-profiling"} <= known  # vLLM 0.29's, for older lines


@pytest.mark.parametrize("names", [names for names in VLLM_FLAGS if len(names) > 1], ids=lambda names: names[0])
def test_every_spelling_of_a_vllm_flag_sets_its_value_as_vllm_does(names):
    """A line's spellings are one flag: a short alias is its first name; a switch's other long names (vLLM 0.34's
    --disable-x of --enable-x, --enable-x of --disable-x, --no-x) turn it off, as vLLM's do."""
    parser = serve_parser()
    action = parser._option_string_actions[names[0]]
    assert [parser._option_string_actions[name] for name in names] == [action] * len(names)
    if action.nargs == 0:
        got = [getattr(parser.parse_args([name]), action.dest) for name in names]
        assert got == [name == names[0] or not name.startswith("--") for name in names]


@pytest.mark.parametrize(
    "text, value",
    [("8192", 8192), ("1k", 1000), ("1K", 1024), ("25.6k", 25600), ("32K", 32768), ("2m", 2_000_000), ("1G", 2**30)],
)
def test_human_readable_integers_read_as_vllm_reads_them(text, value):
    assert human_int(text) == value


@pytest.mark.parametrize(
    "text, message",
    [
        ("2.5K", "'2.5K': K counts 1,024s and takes whole numbers; 2.5k counts 1,000s"),
        ("lots", "'lots' is not an integer (a number, or one with k/m/g/t for 1,000s or K/M/G/T for 1,024s)"),
    ],
)
def test_human_readable_integers_refuse_what_is_not_one(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match="^" + re.escape(message) + "$"):
        human_int(text)


def test_length_and_budget_flags_take_human_readable_integers(tiny_model_dir):
    [config] = configs(str(tiny_model_dir), "--max-model-len", "0.25k", "--max-num-batched-tokens", "1K")
    assert (config.max_model_len, config.max_num_batched_tokens) == (250, 1024)
    [config] = configs(str(tiny_model_dir), "--kv-cache-memory-bytes", "2M", "--device", "cpu")
    assert config.kv_cache_memory_bytes == 2 * 2**20


def test_the_step_budget_defaults_to_512_tokens_on_cpu_and_8192_on_cuda(tiny_model_dir):
    """A step prefills at most the budget; on a CPU an 8192-token step took 7.6 s, and every stream waited it out."""
    [config] = configs(str(tiny_model_dir), "--device", "cpu")
    assert config.max_num_batched_tokens == 512
    [config] = configs(str(tiny_model_dir), "--device", "cpu", "--max-num-seqs", "600")
    assert config.max_num_batched_tokens == 600  # a step holds a token of every running sequence
    [config] = configs(str(tiny_model_dir), "--device", "cuda")
    assert config.max_num_batched_tokens == 8192


@pytest.mark.parametrize(
    "argv",
    [
        ["--tokenizer-mode", "hf"],
        ["--ignore-patterns", "original/**/*"],
        ["--safetensors-load-strategy", "lazy"],
        ["--stream-interval", "1"],
        ["--stream-interval", "8"],
        ["--no-scheduler-reserve-full-isl"],
        ["--skip-mm-profiling", "--language-model-only", "--disable-cascade-attn", "--no-use-tqdm-on-load"],
        ["--show-hidden-metrics-for-version", "0.28"],
        ["-asc", "1", "--no-headless"],
        ["-dp", "1", "-dpl", "1", "-dpn", "0"],
        ["--optimization-level", "0"],
        ["--logprobs-mode", "raw_logprobs"],
    ],
)
def test_vllm_flags_at_the_values_raypaged_has_are_taken(tiny_model_dir, argv):
    [config] = configs(str(tiny_model_dir), *argv)
    assert config.model == str(tiny_model_dir)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--kv-transfer-config", '{"kv_connector": "NixlConnector"}'],
            '--kv-transfer-config {"kv_connector": "NixlConnector"} is not supported: prefill and decode run in the '
            "same engine (no KV transfer)",
        ),
        (
            ["--ignore-patterns", "*.bin", "extra/*"],
            "--ignore-patterns *.bin extra/* is not supported: the weights are the *.safetensors files at the top "
            "of the model folder (nothing under original/ is read)",
        ),
        (
            ["--scheduler-reserve-full-isl"],
            "--scheduler-reserve-full-isl is not supported: a request is admitted when its first chunk's blocks fit; "
            "later chunks take blocks as they run",
        ),
        (
            ["-dpn", "1"],
            "--data-parallel-rank 1 is not supported: `raypaged serve` runs its data-parallel ranks as engine "
            "processes on its own node (--data-parallel-size); for ranks on other nodes run `raypaged engine` on each "
            "and name every one on `raypaged gateway` (--engine NAME=host:port, once per rank)",
        ),
        (
            ["-cc", "3"],
            "--compilation-config 3 is not supported: the model is not compiled with torch.compile "
            "(level 0); CUDA graphs are on unless --enforce-eager",
        ),
        (
            ["--enable-lora", "--lora-dtype", "bfloat16"],
            "--lora-dtype bfloat16 is not supported: adapters run in the base model's dtype (auto)",
        ),
        (
            ["--max-num-scheduled-tokens", "2048"],
            "--max-num-scheduled-tokens 2048 is not supported: a step schedules up to --max-num-batched-tokens "
            "tokens: set that instead",
        ),
    ],
)
def test_vllm_engine_flags_raypaged_cannot_honour_are_refused_by_name(tiny_model_dir, argv, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        configs(str(tiny_model_dir), *argv)


def test_vllm_engine_options_are_refused_by_name_as_llm_keywords_too():
    with pytest.raises(ValueError) as info:
        LLM(model="/no/such/model", kv_transfer_config={"kv_connector": "NixlConnector"})
    assert str(info.value) == (
        "kv_transfer_config={'kv_connector': 'NixlConnector'} is not supported: prefill and decode run in the "
        "same engine (no KV transfer)"
    )


def test_spec_shortcuts_set_keys_of_the_speculative_config(tiny_model_dir):
    [config] = configs(str(tiny_model_dir), "--spec-method", "ngram", "--spec-tokens", "3")
    spec = config.parsed_speculative_config
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)
    [config] = configs(str(tiny_model_dir), "-sc", '{"method": "ngram", "prompt_lookup_max": 2}', "--spec-tokens", "2")
    spec = config.parsed_speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 2, 2)
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape(
            "--spec-tokens and --speculative-config's 'num_speculative_tokens' both set "
            "num_speculative_tokens: give one of them"
        )
        + "$",
    ):
        configs(str(tiny_model_dir), "-sc", '{"method": "ngram", "num_speculative_tokens": 4}', "--spec-tokens", "2")


def test_hf_token_is_taken_bare_or_with_a_value_and_kept_out_of_the_configs_repr(tiny_model_dir):
    args = build_parser().parse_args(["serve", str(tiny_model_dir), "--hf-token"])
    assert args.hf_token is True
    [config] = configs(str(tiny_model_dir), "--hf-token", "hf_secret_value")
    assert config.hf_token == "hf_secret_value"
    assert "hf_secret_value" not in repr(config)


def test_hf_token_authenticates_hub_downloads(monkeypatch, tmp_path):
    import huggingface_hub

    from raypaged.model import hub

    seen = {}

    def snapshot_download(repo_id, **kwargs):  # the Hub cannot be reached from the test machine
        seen.update(kwargs, repo_id=repo_id)
        return str(tmp_path)

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert hub.resolve_model_files("org/private-model", None, None, token="hf_x") == tmp_path
    assert (seen["repo_id"], seen["token"]) == ("org/private-model", "hf_x")


@pytest.mark.parametrize(
    "sizes, max_size, expected",
    [
        (None, None, ([1, 2, 4, 8, 16, 24, 32], [8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512])),
        (None, 16, ([1, 2, 4, 8, 16], [8, 16])),
        (None, 1024, ([1, 2, 4, 8, 16, 24, 32], [8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024])),
        ([64, 1, 8, 8, 2048], None, ([1, 8], [1, 8, 64, 2048])),
        ([1, 4, 32], 32, ([1, 4, 32], [1, 4, 32])),
    ],
)
def test_cuda_graph_sizes_follow_vllms_capture_flags(sizes, max_size, expected):
    assert capture_sizes(32, 2048, sizes, max_size) == expected


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--cudagraph-capture-sizes", "8", "16", "--max-cudagraph-capture-size", "32"],
            "--max-cudagraph-capture-size 32 is not the largest of --cudagraph-capture-sizes (16): give one of the "
            "two, or both in agreement",
        ),
        (
            ["--cudagraph-capture-sizes", "512", "--max-num-seqs", "64"],
            "--cudagraph-capture-sizes 512: none is at most --max-num-seqs 64, so no decode step could replay a graph",
        ),
        (["--cudagraph-capture-sizes", "0", "8"], "--cudagraph-capture-sizes takes sizes of at least 1, got [0, 8]"),
        (["--max-cudagraph-capture-size", "0"], "--max-cudagraph-capture-size must be at least 1, got 0"),
    ],
)
def test_bad_cuda_graph_sizes_fail_before_any_model_loads(tiny_model_dir, argv, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        configs(str(tiny_model_dir), *argv)


def test_cuda_graph_size_flags_reach_the_engine_config(tiny_model_dir):
    [config] = configs(str(tiny_model_dir), "--cudagraph-capture-sizes", "4", "1", "96", "--max-num-seqs", "8")
    assert config.cuda_graph_sizes == ([1, 4], [1, 4, 96])


def test_max_model_len_auto_is_the_models_length_or_what_the_kv_cache_holds(tiny_model_dir):
    from raypaged import SamplingParams

    [config] = configs(str(tiny_model_dir), "--max-model-len", "auto")
    assert (config.fit_max_model_len, config.max_model_len) == (True, config.hf_config.max_position_embeddings)
    llm = LLM(str(tiny_model_dir), max_model_len=-1, num_gpu_blocks_override=64)
    try:  # the model's 512 tokens fit 64 blocks of 16: they stay
        assert llm.llm_engine.config.max_model_len == config.hf_config.max_position_embeddings == 512
    finally:
        llm.shutdown()
    llm = LLM(str(tiny_model_dir), max_model_len="auto", num_gpu_blocks_override=4)
    try:  # 4 blocks of 16 tokens: one sequence may be 64 tokens long
        assert llm.llm_engine.config.max_model_len == 64
        [out] = llm.generate([{"prompt_token_ids": [1] * 60}], SamplingParams(max_tokens=None, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 4  # what is left of the 64-token context
        with pytest.raises(ValueError, match="^This model's maximum context length is 64 tokens. However, you "):
            llm.generate([{"prompt_token_ids": [1] * 60}], SamplingParams(max_tokens=10))
    finally:
        llm.shutdown()


def test_logprobs_mode_processed_logprobs_shows_the_distribution_each_token_was_drawn_from(tiny_model_dir):
    import math

    from raypaged import SamplingParams

    [config] = configs(str(tiny_model_dir), "--logprobs-mode", "processed_logprobs")
    assert config.logprobs_mode == "processed_logprobs"
    llm = LLM(str(tiny_model_dir), logprobs_mode="processed_logprobs", num_gpu_blocks_override=64)
    try:
        params = SamplingParams(temperature=0.8, top_k=2, logprobs=2, max_tokens=6, seed=3, ignore_eos=True)
        [out] = llm.generate(["Hello there"], params)
    finally:
        llm.shutdown()
    completion = out.outputs[0]
    for token, position in zip(completion.token_ids, completion.logprobs):
        top_two = sorted(position.values(), key=lambda entry: entry.rank)[:2]
        assert token in position and sum(math.exp(e.logprob) for e in top_two) == pytest.approx(1.0, abs=1e-5)


def gateway(*argv: str):
    from raypaged.entrypoints.server_args import gateway_options

    return gateway_options(build_parser().parse_args(["serve", *argv]))


def test_vllm_034s_negative_forms_and_aliases_reach_the_engine_and_the_gateway(tiny_model_dir):
    [config] = configs(
        str(tiny_model_dir),
        "--disable-prefix-caching",
        "--no-enforce-eager",
        "--disable-lora",
        "--device-memory-utilization",
        "0.5",
    )
    assert (config.enable_prefix_caching, config.enforce_eager, config.enable_lora) == (False, False, False)
    assert config.gpu_memory_utilization == 0.5
    [config] = configs(str(tiny_model_dir), "--enforce-eager", "--enable-lora", "--no-enable-prefix-caching")
    assert (config.enable_prefix_caching, config.enforce_eager, config.enable_lora) == (False, True, True)
    on = gateway("--disable-uvicorn-access-log", "--enable-uvicorn-access-log", "--enable-log-requests")
    off = gateway(
        "--disable-uvicorn-access-log", "--enable-log-requests", "--disable-log-requests", "--disable-fastapi-docs"
    )
    assert (on.access_log, on.log_requests, on.openapi_docs) == (True, True, True)
    assert (off.access_log, off.log_requests, off.openapi_docs) == (False, False, False)
    both = gateway(
        "--enable-auto-tool-choice", "--disable-auto-tool-choice", "--allow-credentials", "--no-allow-credentials"
    )
    assert (both.enable_auto_tool_choice, both.allow_credentials) == (False, False)


@pytest.mark.parametrize(
    "argv",
    [
        ["--sleep-mode-backend", "cumem", "--no-sleep-mode-offload-cudagraph", "--disable-nccl-comm-suspend"],
        ["--no-checkpoint-prepare-on-startup", "--no-shuffle-safetensors-files", "--disable-hc-sp"],
        ["--disable-shm-tensor-arena", "--dp-sync-interval", "16", "--disable-extensible-kv-cache", "--no-monokernel"],
        [
            "--swa-bounded-replay",
            "--disable-mamba-shared-prefix-checkpoint",
            "--no-long-prefill-token-threshold-adaptive",
        ],
        ["--cache-aware-admission-window", "0", "--cache-aware-admission-threshold", "0.9"],
        ["--sparse-indexer-topk-backend", "auto", "--disable-hybrid-kv-cache-manager", "--enable-custom-all-reduce"],
        ["--enable-sliding-window", "--enable-cascade-attn", "--enable-chunked-mm-input", "--disable-eplb"],
        ["--disable-flashinfer-autotune", "--enable-nccl-for-dp-synchronization", "--disable-expert-parallel"],
    ],
)
def test_vllm_034_flags_at_the_values_raypaged_has_are_taken(tiny_model_dir, argv):
    [config] = configs(str(tiny_model_dir), *argv)
    assert config.model == str(tiny_model_dir)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--disable-chunked-prefill"],
            "--disable-chunked-prefill is not supported: long prefills are always chunked within "
            "--max-num-batched-tokens",
        ),
        (
            ["--enable-hybrid-kv-cache-manager"],
            "--enable-hybrid-kv-cache-manager is not supported: every layer's KV cache is paged the same way",
        ),
        (
            ["--sleep-mode-backend", "criu"],
            "--sleep-mode-backend criu is not supported: --enable-sleep-mode releases the weights and the KV cache "
            "by freeing them, and wake_up reads the weights back from the checkpoint (no cumem allocator)",
        ),
        (
            ["--cache-aware-admission-window", "8"],
            "--cache-aware-admission-window 8 is not supported: waiting requests are admitted in "
            "--scheduling-policy's order",
        ),
        (
            ["--max-num-inflight-kv-loads", "4"],
            "--max-num-inflight-kv-loads 4 is not supported: prefill and decode run in the same engine "
            "(no KV transfer)",
        ),
        (["--monokernel"], "--monokernel is not supported: raypaged's kernels are chosen per device"),
        (
            ["--enable-flashinfer-autotune"],
            "--enable-flashinfer-autotune is not supported: raypaged's kernels are chosen per device (no FlashInfer)",
        ),
        (
            ["--watermark-config", '{"key": 7}'],
            '--watermark-config {"key": 7} is not supported: generated text is not watermarked',
        ),
        (
            ["--watchdog-config", '{"dump_dir": "/tmp/stacks"}'],
            '--watchdog-config {"dump_dir": "/tmp/stacks"} is not supported: no thread stacks are dumped: a stalled '
            "shard is found by the step timeout ($RAYPAGED_STEP_TIMEOUT_S) and its group restarted",
        ),
        (["--max-num-active-seqs", "300"], "--max-num-active-seqs must be from 1 to --max-num-seqs 256, got 300"),
        (["--max-num-queued-reqs", "-1"], "--max-num-queued-reqs must be at least 0, got -1"),
        (
            ["--custom-histogram-buckets", '{"request_num_preemptions": [1, 2]}'],
            "--custom-histogram-buckets: request_num_preemptions is not supported: raypaged exports none of its "
            "histograms",
        ),
        (
            ["--custom-histogram-buckets", '{"ttft": [1]}'],
            "--custom-histogram-buckets: unknown histogram family 'ttft'; families: request_latency, "
            "time_to_first_token, inter_token_latency, iteration_tokens, request_params_n, request_tokens",
        ),
        (
            ["--custom-histogram-buckets", '{"request_latency": [1, 0.5]}'],
            "--custom-histogram-buckets: request_latency's bounds must increase, got [1, 0.5]",
        ),
        (
            ["--custom-histogram-buckets", '{"request_latency": [0, true]}'],
            "--custom-histogram-buckets: request_latency takes a non-empty list of finite bounds above 0, got "
            "[0, True]",
        ),
    ],
)
def test_vllm_034_engine_flags_raypaged_cannot_honour_are_refused_by_name(tiny_model_dir, argv, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        configs(str(tiny_model_dir), *argv)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--tool-strict-level", "parameter"],
            "--tool-strict-level parameter is not supported: tool calls of tool_choice auto are parsed from the "
            "model's text (--tool-call-parser), not constrained; tool_choice required or a named function "
            "constrains the call and its arguments",
        ),
        (
            ["--headless-client-handshake-address", "tcp://10.0.0.1:5000"],
            "--headless-client-handshake-address tcp://10.0.0.1:5000 is not supported: the server always runs its "
            "HTTP API beside its engines",
        ),
        (
            ["--disable-offline-docs", "--enable-offline-docs"],
            "--enable-offline-docs is not supported: no Swagger or ReDoc page is served (only /openapi.json)",
        ),
        (
            ["--reasoning-effort-map", '{"huge": "max"}'],
            "--reasoning-effort-map: 'huge' is not a reasoning effort (efforts: none, minimal, low, medium, high, "
            "xhigh, max)",
        ),
        (
            ["--reasoning-effort-map", '{"low": 1}'],
            "--reasoning-effort-map takes a JSON object of reasoning efforts and the chat template's names for them, "
            'got {"low": 1}',
        ),
    ],
)
def test_vllm_034_server_flags_raypaged_cannot_honour_are_refused_by_name(argv, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        gateway(*argv)


def test_vllm_034_server_flags_at_the_values_raypaged_has_are_taken():
    options = gateway("--tool-strict-level", "auto", "--trust-request-mm-kwargs", "--disable-flash-late-interaction")
    assert options.anthropic_disabled_thinking_effort == "auto"
    options = gateway("--reasoning-effort-map", '{"xhigh": "max"}', "--anthropic-disabled-thinking-effort", "low")
    assert (options.reasoning_effort_map, options.anthropic_disabled_thinking_effort) == ({"xhigh": "max"}, "low")


def test_queue_limits_and_histogram_buckets_are_a_servers_and_refused_offline(tiny_model_dir):
    from raypaged.entrypoints.run_batch import BatchJob

    [config] = configs(
        str(tiny_model_dir),
        "--max-num-queued-reqs",
        "8",
        "--max-num-queued-tokens",
        "2k",
        "--custom-histogram-buckets",
        '{"iteration_tokens": [1, 64]}',
    )
    assert (config.max_num_queued_reqs, config.max_num_queued_tokens) == (8, 2000)
    assert config.custom_histogram_buckets == {"iteration_tokens": [1, 64]}
    with pytest.raises(ValueError) as info:
        LLM(str(tiny_model_dir), max_num_queued_reqs=8)
    assert str(info.value) == (
        "max_num_queued_reqs=8 is not supported: LLM runs every prompt it is given: the queue limits refuse a "
        "server's requests (raypaged serve)"
    )
    batch = build_parser().parse_args(
        ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--max-num-queued-tokens", "4k"]
    )
    with pytest.raises(ValueError) as info:
        BatchJob.from_args(batch)
    assert str(info.value) == (
        "--max-num-queued-tokens 4000 is not supported: a batch answers every request (the queue limits refuse a "
        "server's; --max-num-seqs caps each step)"
    )


def test_max_num_active_seqs_caps_the_running_batch_below_max_num_seqs(tiny_model_dir):
    from raypaged import SamplingParams

    llm = LLM(str(tiny_model_dir), max_num_active_seqs=2, max_num_seqs=8, num_gpu_blocks_override=64)
    try:
        engine = llm.llm_engine
        for prompt in ("a", "b", "c", "d"):
            engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        engine.step()
        assert (engine.stats().num_requests_running, engine.stats().num_requests_waiting) == (2, 2)
        assert engine.config.cuda_graph_sizes[0][-1] == 8  # the graphs are still max_num_seqs'
    finally:
        llm.shutdown()
