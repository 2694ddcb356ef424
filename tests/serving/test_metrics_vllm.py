"""vLLM V1's Prometheus metrics: every name, type, label and bucket bound, under ``raypaged:``
through the gateway and under ``vllm:`` for dashboards, autoscalers and gateways built for vLLM.

The expected set is written from vLLM's metrics documentation (names, types, labels, buckets)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from raypaged.core.request import Request, RequestStatus
from raypaged.engine.async_llm_engine import AsyncLLMEngine
from raypaged.engine.llm_engine import LLMEngine
from raypaged.outputs import RequestOutput
from raypaged.sampling_params import RequestOutputKind, SamplingParams
from raypaged.serving.metrics import ServerMetrics
from tests.serving.conftest import Stack, tiny_config

# fmt: off
TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
        160.0, 640.0, 2560.0)
TOKEN_GAP = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0)
# fmt: on
ITERATION = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SIZES_256 = (1, 2, 5, 10, 20, 50, 100, 200)  # vLLM's 1-2-5 series up to max_model_len (256 here)

# family name after the prefix -> (type, label names besides model_name and engine, bucket bounds)
V1_METRICS: dict[str, tuple[str, tuple[str, ...], tuple[float, ...] | None]] = {
    "num_requests_running": ("gauge", (), None),
    "num_requests_waiting": ("gauge", (), None),
    "kv_cache_usage_perc": ("gauge", (), None),
    "num_preemptions": ("counter", (), None),
    "prefix_cache_queries": ("counter", (), None),
    "prefix_cache_hits": ("counter", (), None),
    "prompt_tokens": ("counter", (), None),
    "generation_tokens": ("counter", (), None),
    "request_success": ("counter", ("finished_reason",), None),
    "iteration_tokens_total": ("histogram", (), ITERATION),
    "time_to_first_token_seconds": ("histogram", (), TTFT),
    "inter_token_latency_seconds": ("histogram", (), TOKEN_GAP),
    "time_per_output_token_seconds": ("histogram", (), TOKEN_GAP),
    "request_time_per_output_token_seconds": ("histogram", (), TOKEN_GAP),
    "e2e_request_latency_seconds": ("histogram", (), REQUEST),
    "request_queue_time_seconds": ("histogram", (), REQUEST),
    "request_inference_time_seconds": ("histogram", (), REQUEST),
    "request_prefill_time_seconds": ("histogram", (), REQUEST),
    "request_decode_time_seconds": ("histogram", (), REQUEST),
    "request_prompt_tokens": ("histogram", (), SIZES_256),
    "request_generation_tokens": ("histogram", (), SIZES_256),
    "request_max_num_generation_tokens": ("histogram", (), SIZES_256),
    "request_params_n": ("histogram", (), (1, 2, 5, 10, 20)),
    "request_params_max_tokens": ("histogram", (), SIZES_256),
    "cache_config_info": (
        "gauge",
        (
            "block_size",
            "enable_prefix_caching",
            "gpu_memory_utilization",
            "num_gpu_blocks",
            "num_gpu_blocks_override",
            "num_cpu_blocks",
            "swap_space",
        ),
        None,
    ),
}
# the series vLLM's example Grafana dashboard queries, the one KEDA scales on, the one inference gateways read
VLLM_DASHBOARD_SERIES = (
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_requests_swapped",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_bucket",
)
PROCESS_SERIES = (
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_start_time_seconds",
    "python_info",
    "python_gc_collections_total",
)


def families(text: str) -> dict[str, object]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(scraped: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    return scraped[(name, frozenset({"model_name": "tiny", "engine": "0", **labels}.items()))]


def assert_v1_schema(found: dict, prefix: str) -> None:
    """Every vLLM V1 family exists under ``prefix`` with vLLM's type and label names."""
    for suffix, (kind, extra, _) in V1_METRICS.items():
        family = found.get(prefix + suffix)
        assert family is not None, f"{prefix}{suffix} is not exported"
        assert family.type == kind, f"{prefix}{suffix} is a {family.type}, vLLM's is a {kind}"
        label_names = {name for sample in family.samples for name in sample.labels} - {"le"}
        if family.samples:
            assert label_names == {"model_name", "engine", *extra}, f"{prefix}{suffix}: {sorted(label_names)}"


# ---- raypaged: through the real server stack --------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tiny_model_dir) -> Iterator[Stack]:
    stack = Stack([tiny_config(tiny_model_dir, "tiny")])
    yield stack
    stack.close()


def scrape(stack: Stack) -> str:
    with stack.client() as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    return response.text


def test_the_gateway_exports_vllms_v1_set_under_raypaged_and_process_metrics(stack):
    text = scrape(stack)
    assert_v1_schema(families(text), "raypaged:")
    names = {name for name, _ in samples(text)}
    assert set(PROCESS_SERIES) <= names
    assert not any(name.startswith("vllm:") for name in names)


def test_a_completion_moves_every_request_metric_once(stack):
    before = samples(scrape(stack))
    with stack.client() as client:
        response = client.post(
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": [7] * 20,
                "max_tokens": 5,
                "n": 2,
                "ignore_eos": True,
                "temperature": 1,
            },
        )
    assert response.status_code == 200, response.text
    after = samples(scrape(stack))

    def moved(name: str, **labels: str) -> float:
        return value(after, "raypaged:" + name, **labels) - value(before, "raypaged:" + name, **labels)

    assert moved("request_success_total", finished_reason="length") == 1
    assert moved("request_success_total", finished_reason="stop") == 0
    assert moved("prompt_tokens_total") == 20
    assert moved("generation_tokens_total") == 10  # both samples
    assert moved("prefix_cache_queries_total") == 20
    assert (moved("request_prompt_tokens_count"), moved("request_prompt_tokens_sum")) == (1, 20)
    assert moved("request_generation_tokens_sum") == 10
    assert moved("request_max_num_generation_tokens_sum") == 5
    assert moved("request_params_n_sum") == 2
    assert moved("request_params_max_tokens_sum") == 5
    assert moved("iteration_tokens_total_sum") == 30  # the prompt once its prefill ended, then every new token
    assert moved("time_to_first_token_seconds_count") == 1
    assert moved("inter_token_latency_seconds_count") == 4 == moved("time_per_output_token_seconds_count")
    assert moved("request_time_per_output_token_seconds_count") == 1
    phases = (
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "e2e_request_latency_seconds",
    )
    for phase in phases:
        assert moved(f"{phase}_count") == 1, phase
    queue, prefill, decode, inference, e2e = (moved(f"{phase}_sum") for phase in phases)
    assert min(queue, prefill, decode) >= 0 and decode > 0
    assert math.isclose(inference, prefill + decode, rel_tol=1e-9)
    assert e2e >= queue + inference


def test_a_client_that_leaves_counts_one_aborted_request(stack):
    aborted = (
        "raypaged:request_success_total",
        frozenset({"model_name": "tiny", "engine": "0", "finished_reason": "abort"}.items()),
    )
    before = samples(scrape(stack))[aborted]
    with (
        stack.client() as client,
        client.stream(
            "POST",
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": [7] * 8,
                "max_tokens": 200,
                "ignore_eos": True,
                "stream": True,
            },
        ) as response,
    ):
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.monotonic() + 5
    while (now := samples(scrape(stack))[aborted]) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert now == before + 1


# ---- vllm: on a real engine, its outputs fed to a compat-prefixed registry --------------------------------------


@pytest.fixture(scope="module")
def compat(tiny_model_dir) -> tuple[str, list[RequestOutput]]:
    """Two requests through a real ``AsyncLLMEngine`` that runs one at a time (the second waits in the
    queue), observed by a ``vllm:`` registry; the exposition once the engine stopped, and their final outputs."""
    config = tiny_config(tiny_model_dir, "tiny", max_num_seqs=1)
    engines: dict[str, AsyncLLMEngine] = {}
    metrics = ServerMetrics({"tiny": lambda: engines["tiny"].stats()}, "cpu", prefix="vllm:", configs={"tiny": config})
    engine = engines["tiny"] = AsyncLLMEngine(LLMEngine(config), metrics.observer("tiny"))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def last(request_id: str) -> RequestOutput:
        outputs = [output async for output in engine.stream(request_id)]
        return outputs[-1]

    async def run() -> list[RequestOutput]:
        first = await engine.add_request(None, params, "first", prompt_token_ids=[7] * 10)
        second = await engine.add_request(None, params, "second", prompt_token_ids=[9] * 12)
        return list(await asyncio.gather(last(first), last(second)))

    try:
        outputs = asyncio.run(run())
    finally:
        engine.shutdown()  # its stats are the final step's from here on
    return metrics.exposition(), outputs


def test_every_series_vllms_dashboard_queries_exists_under_the_compat_prefix(compat):
    text, _ = compat
    names = {name for name, labels in samples(text) if ("model_name", "tiny") in labels}
    missing = [name for name in VLLM_DASHBOARD_SERIES if name not in names]
    assert not missing
    assert "raypaged:" not in text


def test_the_compat_prefix_has_vllms_types_labels_and_bucket_bounds(compat):
    text, _ = compat
    found = families(text)
    assert_v1_schema(found, "vllm:")
    for suffix, (_, _, bounds) in V1_METRICS.items():
        if bounds is None:
            continue
        exported = [float(s.labels["le"]) for s in found["vllm:" + suffix].samples if s.name.endswith("_bucket")]
        assert exported == [*map(float, bounds), math.inf], suffix


def test_cache_config_info_states_the_kv_cache_configuration(compat):
    text, _ = compat
    (sample,) = families(text)["vllm:cache_config_info"].samples
    assert sample.value == 1
    assert sample.labels == {
        "model_name": "tiny",
        "engine": "0",
        "block_size": "16",
        "enable_prefix_caching": "True",
        "gpu_memory_utilization": "0.9",
        "num_gpu_blocks": "64",
        "num_gpu_blocks_override": "64",
        "num_cpu_blocks": "0",
        "swap_space": "0.0",
    }


def test_the_compat_registry_counts_both_requests_exactly(compat):
    text, _ = compat
    scraped = samples(text)
    assert value(scraped, "vllm:request_success_total", finished_reason="length") == 2
    for reason in ("stop", "abort", "error"):
        assert value(scraped, "vllm:request_success_total", finished_reason=reason) == 0
    assert value(scraped, "vllm:prompt_tokens_total") == 22
    assert value(scraped, "vllm:generation_tokens_total") == 12
    assert value(scraped, "vllm:iteration_tokens_total_sum") == 34
    assert value(scraped, "vllm:request_params_max_tokens_sum") == 12
    assert value(scraped, "vllm:request_params_n_sum") == 2
    assert value(scraped, "vllm:inter_token_latency_seconds_count") == 10
    assert value(scraped, "vllm:request_queue_time_seconds_count") == 2
    assert value(scraped, "vllm:num_requests_waiting") == 0
    assert value(scraped, "vllm:kv_cache_usage_perc") == 0


def test_request_metrics_show_the_second_request_queued_behind_the_first(compat):
    text, (first, second) = compat
    for output in (first, second):
        metrics = output.metrics
        assert (metrics.n, metrics.max_tokens, metrics.max_num_generation_tokens) == (1, 6, 6)
        assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time
        assert metrics.first_token_time < metrics.last_token_time
    assert second.metrics.first_scheduled_time > first.metrics.last_token_time  # max_num_seqs=1: it waited
    queued = value(samples(text), "vllm:request_queue_time_seconds_sum")
    assert math.isclose(queued, first.metrics.queue_time + second.metrics.queue_time, rel_tol=1e-9)


def test_a_request_keeps_its_first_scheduled_time_when_preempted():
    request = Request("r", [1, 2, 3], SamplingParams(), 4, None)
    assert request.first_scheduled_time is None and request.status is RequestStatus.WAITING
    request.status = RequestStatus.RUNNING
    first = request.first_scheduled_time
    assert first is not None
    request.status = RequestStatus.PREEMPTED
    request.status = RequestStatus.RUNNING
    assert request.first_scheduled_time == first and request.status is RequestStatus.RUNNING


def test_a_prefix_that_is_not_a_prometheus_name_is_refused():
    for prefix in ("vllm", "v-llm:", "1vllm:"):
        with pytest.raises(ValueError, match="--metrics-prefix takes a name of letters, digits and underscores"):
            ServerMetrics({}, "cpu", prefix=prefix)
