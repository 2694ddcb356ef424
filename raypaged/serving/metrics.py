"""Prometheus metrics of an engine server: vLLM V1's set, named ``raypaged:*`` by default.

Names, types, label names (``model_name``, ``engine``) and bucket bounds are vLLM's, so a
``prefix="vllm:"`` registry serves dashboards, autoscalers and gateways written for vLLM
unchanged. Request histograms and token counters are fed from the engine thread after
every step (``RequestObserver``); gauges, engine counters and ``cache_config_info`` are
read from each engine's stats at scrape time. Process metrics (``process_*``,
``python_*``) are unprefixed, as in vLLM. Each served model is one engine: ``engine="0"``; with
data parallelism (``-dp``), rank R's series carry ``engine="R"``.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil
from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from raypaged.core.scheduler import ACCEPTED_PER_POS
from raypaged.outputs import FinishReason, RequestOutput
from raypaged.serving.buckets import TOKEN_COUNTS, buckets

if TYPE_CHECKING:
    from raypaged.config import EngineConfig

disable_created_metrics()  # no *_created series: the gateway re-exposes engine metrics as parsed text

PREFIX = "raypaged:"
LABELS = ("model_name", "engine")
FINISH_REASONS = tuple(FinishReason)
_PREFIX_PATTERN = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*:")
_UNKNOWN_MAX_MODEL_LEN = 1 << 20  # token-count buckets when no engine config is given

ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")  # the limits a request may be refused by

# (metric suffix, help, stats key) read from engine stats at scrape time
_GAUGES = (
    ("num_requests_running", "Requests in the running batch.", "num_requests_running"),
    ("num_requests_waiting", "Requests waiting to be scheduled.", "num_requests_waiting"),
    ("num_requests_swapped", "Requests whose KV blocks are swapped out to CPU memory.", "num_requests_swapped"),
    ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", "kv_cache_usage"),
)
_COUNTERS = (
    ("num_preemptions", "Preemptions of running requests.", "num_preemptions"),
    ("prefix_cache_queries", "Prefix-cache queries, in prompt tokens looked up.", "prefix_cache_queries"),
    ("prefix_cache_hits", "Prefix-cache hits, in prompt tokens found cached.", "prefix_cache_hits"),
)
# speculative decoding's, exported for the models that speculate (as vLLM)
_SPEC_COUNTERS = (
    (
        "spec_decode_num_drafts",
        "Verifications of draft tokens (one per sequence per step with drafts).",
        "spec_decode_num_drafts",
    ),
    ("spec_decode_num_draft_tokens", "Draft tokens verified.", "spec_decode_num_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", "spec_decode_num_accepted_tokens"),
)
# (metric suffix, help): seconds per request, observed when it finishes
_REQUEST_TIMES = (
    ("e2e_request_latency_seconds", "Seconds from arrival to the last token."),
    ("request_queue_time_seconds", "Seconds queued before first scheduled."),
    ("request_prefill_time_seconds", "Seconds from first scheduled to the first token."),
    ("request_decode_time_seconds", "Seconds from the first token to the last."),
    ("request_inference_time_seconds", "Seconds from first scheduled to the last token."),
)


@dataclass(slots=True)
class _Progress:
    arrival_time: float  # when the server got it
    last_time: float  # when its previous output came
    num_tokens: int = 0


class RequestObserver:
    """Feeds one model's request histograms and token counters from its engine's outputs."""

    def __init__(self, metrics: ServerMetrics, model_name: str) -> None:
        labels = (model_name, metrics.engine)
        self._ttft = metrics.ttft.labels(*labels)
        self._itl = metrics.itl.labels(*labels)
        self._tpot = metrics.tpot.labels(*labels)
        self._request_tpot = metrics.request_tpot.labels(*labels)
        self._iteration_tokens = metrics.iteration_tokens.labels(*labels)
        self._prompt_tokens = metrics.prompt_tokens.labels(*labels)
        self._generation_tokens = metrics.generation_tokens.labels(*labels)
        self._request_prompt_tokens = metrics.request_prompt_tokens.labels(*labels)
        self._request_generation_tokens = metrics.request_generation_tokens.labels(*labels)
        self._max_generation_tokens = metrics.request_max_num_generation_tokens.labels(*labels)
        self._params_n = metrics.request_params_n.labels(*labels)
        self._params_max_tokens = metrics.request_params_max_tokens.labels(*labels)
        self._times = {suffix: histogram.labels(*labels) for suffix, histogram in metrics.request_times.items()}
        self._success = {reason: metrics.request_success.labels(*labels, reason) for reason in FINISH_REASONS}
        self._rejections = {
            reason: metrics.admission_rejections.labels(model_name, reason) for reason in ADMISSION_REASONS
        }
        self._progress: dict[str, _Progress] = {}

    def on_outputs(self, outputs: list[RequestOutput], arrival_times: dict[str, float], now: float) -> None:
        """One step's outputs; ``now`` is when the step ended, ``arrival_times`` when the server got each."""
        num_step_tokens = 0  # vLLM's iteration tokens: prompts whose prefill ended, plus new tokens
        for output in outputs:
            progress = self._progress.get(output.request_id)
            if progress is None:
                arrival = arrival_times.get(output.request_id, now)
                self._ttft.observe(now - arrival)
                self._prompt_tokens.inc(output.num_prompt_tokens)
                num_step_tokens += output.num_prompt_tokens
                progress = self._progress[output.request_id] = _Progress(arrival, now)
            else:
                self._itl.observe(now - progress.last_time)
                self._tpot.observe(now - progress.last_time)
                progress.last_time = now
            num_new = output.num_generated_tokens - progress.num_tokens  # every sampled token counts once
            self._generation_tokens.inc(num_new)
            num_step_tokens += num_new
            progress.num_tokens = output.num_generated_tokens
            if output.finished:
                del self._progress[output.request_id]
                self._finished(output, now - progress.arrival_time)
        if num_step_tokens:
            self._iteration_tokens.observe(num_step_tokens)

    def on_abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._progress.pop(request_id, None)
            self._success[FinishReason.ABORT].inc()

    def on_refused(self, reason: str) -> None:
        """A request refused by the queue limit ``reason`` (one of ``ADMISSION_REASONS``)."""
        self._rejections[reason].inc()

    def _finished(self, output: RequestOutput, e2e: float) -> None:
        self._success[_finish_reason(output)].inc()
        self._request_prompt_tokens.observe(output.num_prompt_tokens)
        self._request_generation_tokens.observe(output.num_generated_tokens)
        self._times["e2e_request_latency_seconds"].observe(e2e)
        metrics = output.metrics
        if metrics is None:  # a beam search: no timeline
            return
        self._max_generation_tokens.observe(metrics.max_num_generation_tokens)
        self._params_n.observe(metrics.n)
        self._params_max_tokens.observe(metrics.max_tokens)
        intervals = (
            ("request_queue_time_seconds", metrics.queue_time),
            ("request_prefill_time_seconds", metrics.prefill_time),
            ("request_decode_time_seconds", metrics.decode_time),
            ("request_inference_time_seconds", metrics.inference_time),
        )
        for suffix, seconds in intervals:
            if seconds is not None:
                self._times[suffix].observe(seconds)
        if metrics.decode_time is not None and metrics.max_num_generation_tokens > 1:
            self._request_tpot.observe(metrics.decode_time / (metrics.max_num_generation_tokens - 1))


def _finish_reason(output: RequestOutput) -> FinishReason:
    """Why a finished request ended: its first completion's reason, ``error`` when it failed."""
    if output.error is not None or not output.outputs:
        return FinishReason.ERROR
    reason = output.outputs[0].finish_reason
    assert reason is not None, f"request {output.request_id} finished without a finish reason"
    return reason


def _custom_buckets(configs: Mapping[str, EngineConfig]) -> dict[str, list[float]] | None:
    """The models' ``custom_histogram_buckets``: one registry holds every model's histograms, so one setting."""
    given = [config.custom_histogram_buckets for config in configs.values()]
    if any(custom != given[0] for custom in given):
        raise ValueError("models served together share their histograms: give them the same custom_histogram_buckets")
    return given[0] if given else None


class ServerMetrics:
    """The registry of one engine server: per-request histograms plus stats read at scrape time.

    ``stats_sources`` maps each served model name to a function returning its engine's
    ``LLMEngine.stats()`` (every key read must be there); ``configs`` maps the same names
    to their ``EngineConfig``: ``cache_config_info``, the token-count buckets, 1-2-5 up
    to the largest ``max_model_len`` (without configs: no ``cache_config_info`` series and
    buckets up to 2**20), and the ``custom_histogram_buckets`` over vLLM's bounds (``buckets.py``).
    ``prefix`` starts every metric name: ``raypaged:``, ``vllm:`` ...
    """

    def __init__(
        self,
        stats_sources: dict[str, Callable[[], dict[str, int | float]]],
        device: str,
        prefix: str = PREFIX,
        configs: Mapping[str, EngineConfig] | None = None,
        lora_sources: Mapping[str, Callable[[], tuple[list[str], list[str]]]] | None = None,
        engine_index: int = 0,
    ) -> None:
        """``lora_sources``: per model with LoRA, its running and waiting adapters (``lora_requests_info``).
        ``engine_index``: the server's data-parallel rank, its series' ``engine`` label (vLLM numbers a model's
        engines so); the process metrics are the first engine's only, so that ranks' expositions add up."""
        if not _PREFIX_PATTERN.fullmatch(prefix):
            raise ValueError(
                f"metric prefix {prefix!r} is not a Prometheus name followed by ':'; --metrics-prefix takes a "
                "name of letters, digits and underscores, like vllm"
            )
        self.prefix = prefix
        self.engine = str(engine_index)
        self.registry = registry = CollectorRegistry()
        configs = configs or {}
        max_len = max((c.resolved_max_model_len for c in configs.values()), default=_UNKNOWN_MAX_MODEL_LEN)
        custom = _custom_buckets(configs)

        def counter(suffix: str, doc: str, extra: tuple[str, ...] = (), labels: tuple[str, ...] = LABELS) -> Counter:
            return Counter(f"{prefix}{suffix}", doc, labels + extra, registry=registry)

        def histogram(suffix: str, doc: str, family: str) -> Histogram:
            bounds = buckets(family, custom, max_len)
            return Histogram(f"{prefix}{suffix}", doc, LABELS, buckets=bounds, registry=registry)

        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.request_success = counter("request_success", "Finished requests, by finish reason.", ("finished_reason",))
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Tokens per engine step: prompts whose prefill ended plus new tokens.",
            "iteration_tokens",
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Seconds from arrival to the first token.", "time_to_first_token"
        )
        gap = "inter_token_latency"
        self.itl = histogram("inter_token_latency_seconds", "Seconds between a request's consecutive steps.", gap)
        self.tpot = histogram(
            "time_per_output_token_seconds", "Seconds between a request's consecutive steps (vLLM's older name).", gap
        )
        self.request_tpot = histogram(
            "request_time_per_output_token_seconds",
            "Per finished request: decode seconds per token after the first.",
            gap,
        )
        self.request_times = {suffix: histogram(suffix, doc, "request_latency") for suffix, doc in _REQUEST_TIMES}
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_COUNTS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request, all its sequences.", TOKEN_COUNTS
        )
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Tokens of the longest sequence of each finished request.",
            TOKEN_COUNTS,
        )
        self.request_params_n = histogram("request_params_n", "The n of each finished request.", "request_params_n")
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens of each finished request, resolved.", TOKEN_COUNTS
        )
        self.admission_rejections = counter(
            "admission_rejections", "Requests refused by a queue limit, by the limit.", labels=("model_name", "reason")
        )
        registry.register(_StatsCollector(prefix, stats_sources, configs, device, lora_sources or {}, self.engine))
        if engine_index == 0:
            ProcessCollector(registry=registry)
            PlatformCollector(registry=registry)
            GCCollector(registry=registry)

    def observer(self, model_name: str) -> RequestObserver:
        return RequestObserver(self, model_name)

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()


class _StatsCollector(Collector):
    def __init__(
        self,
        prefix: str,
        stats_sources: dict[str, Callable[[], dict[str, int | float]]],
        configs: Mapping[str, EngineConfig],
        device: str,
        lora_sources: Mapping[str, Callable[[], tuple[list[str], list[str]]]],
        engine: str,
    ) -> None:
        self._prefix = prefix
        self._engine = engine
        self._sources = stats_sources
        self._lora_sources = lora_sources
        self._configs = configs
        self._device = device
        self._process = psutil.Process(os.getpid())
        self._process.cpu_percent(None)  # starts the measuring interval

    def collect(self) -> Iterator[Metric]:
        prefix = self._prefix
        stats = {name: source() for name, source in self._sources.items()}
        for suffix, doc, key in _GAUGES:
            family = GaugeMetricFamily(f"{prefix}{suffix}", doc, labels=LABELS)
            for name, values in stats.items():
                family.add_metric([name, self._engine], float(values[key]))
            yield family
        for suffix, doc, key in _COUNTERS:
            counter = CounterMetricFamily(f"{prefix}{suffix}", doc, labels=LABELS)
            for name, values in stats.items():
                counter.add_metric([name, self._engine], float(values[key]))
            yield counter
        speculating = {
            name: values
            for name, values in stats.items()
            if name in self._configs and self._configs[name].speculative_config is not None
        }
        if speculating:
            yield from self._spec_decode(speculating)
        yield self._cache_config(stats)
        if self._lora_sources:
            yield self._lora_requests_info()
        utilization, memory = self._device_usage()
        util_family = GaugeMetricFamily(
            f"{prefix}gpu_utilization",
            "Device utilization (0 to 1); on CPU the process's share of all cores.",
            labels=LABELS,
        )
        memory_family = GaugeMetricFamily(
            f"{prefix}gpu_memory_usage_bytes",
            "Device memory in use; on CPU the process's resident memory.",
            labels=LABELS,
        )
        for name in stats:
            util_family.add_metric([name, self._engine], utilization)
            memory_family.add_metric([name, self._engine], memory)
        yield util_family
        yield memory_family

    def _spec_decode(self, stats: dict[str, dict[str, int | float]]) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters, accepted drafts also by their position in the run."""
        for suffix, doc, key in _SPEC_COUNTERS:
            counter = CounterMetricFamily(f"{self._prefix}{suffix}", doc, labels=LABELS)
            for name, values in stats.items():
                counter.add_metric([name, self._engine], float(values[key]))
            yield counter
        per_pos = CounterMetricFamily(
            f"{self._prefix}{ACCEPTED_PER_POS}", "Draft tokens accepted, by position.", labels=(*LABELS, "position")
        )
        for name, values in stats.items():
            spec = self._configs[name].parsed_speculative_config
            assert spec is not None  # only speculating models report accepted drafts by position
            for pos in range(spec.num_speculative_tokens):
                per_pos.add_metric([name, self._engine, str(pos)], float(values[f"{ACCEPTED_PER_POS}_{pos}"]))
        yield per_pos

    def _cache_config(self, stats: dict[str, dict[str, int | float]]) -> GaugeMetricFamily:
        """1 per model, its KV-cache configuration in the labels (vLLM's ``cache_config_info``)."""
        keys = (
            "block_size",
            "enable_prefix_caching",
            "gpu_memory_utilization",
            "num_gpu_blocks",
            "num_gpu_blocks_override",
            "num_cpu_blocks",
            "swap_space",
        )
        family = GaugeMetricFamily(
            f"{self._prefix}cache_config_info",
            "KV-cache configuration of each model, in its labels.",
            labels=LABELS + keys,
        )
        for name, config in self._configs.items():
            values = (
                config.block_size,
                config.enable_prefix_caching,
                config.gpu_memory_utilization,
                int(stats[name]["num_gpu_blocks_total"]),
                config.num_gpu_blocks_override,
                int(stats[name]["num_cpu_blocks_total"]),
                config.resolved_swap_space,
            )
            family.add_metric([name, self._engine, *map(str, values)], 1.0)
        return family

    def _lora_requests_info(self) -> GaugeMetricFamily:
        """vLLM's ``lora_requests_info``: the adapters running and waiting, comma-separated in the labels;
        the value is when it was read (seconds since the epoch)."""
        family = GaugeMetricFamily(
            f"{self._prefix}lora_requests_info",
            "Running stats on LoRA requests.",
            labels=("running_lora_adapters", "waiting_lora_adapters", "max_lora"),
        )
        for name, source in self._lora_sources.items():
            running, waiting = source()
            family.add_metric([",".join(running), ",".join(waiting), str(self._configs[name].max_loras)], time.time())
        return family

    def _device_usage(self) -> tuple[float, float]:
        if self._device == "cuda":
            import torch

            if not torch.cuda.is_available():  # a driver on a GPU-less Ray head: the shards hold the devices
                return float("nan"), float("nan")
            try:
                utilization = torch.cuda.utilization() / 100.0
            except Exception:  # no NVML (nvidia-ml-py missing): unknown, and the other metrics still export
                utilization = float("nan")
            return utilization, float(torch.cuda.memory_reserved())
        cores = psutil.cpu_count() or 1
        return self._process.cpu_percent(None) / (100.0 * cores), float(self._process.memory_info().rss)
