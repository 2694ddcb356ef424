"""Prometheus metrics of an engine server, named ``raypaged:*`` and labelled by ``model_name``.

Latency histograms and token counters are fed from the engine thread after every
step; gauges and engine counters are read from each engine's stats at scrape time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psutil
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from raypaged.outputs import RequestOutput

disable_created_metrics()  # no *_created series: the gateway re-exposes engine metrics as parsed text

PREFIX = "raypaged:"
LABEL = "model_name"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)

# (metric suffix, help, stats key) read from engine stats at scrape time
_GAUGES = (
    ("num_requests_running", "Requests in the running batch.", "num_requests_running"),
    ("num_requests_waiting", "Requests waiting to be scheduled.", "num_requests_waiting"),
    ("num_requests_swapped", "Requests whose KV blocks are swapped out to CPU memory.", "num_requests_swapped"),
    ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", "kv_cache_usage"),
)
_COUNTERS = (
    ("num_preemptions", "Preemptions of running requests.", "num_preemptions"),
    ("prefix_cache_hits", "Prompt blocks found in the prefix cache.", "prefix_cache_hits"),
)


@dataclass(slots=True)
class _Progress:
    arrival_time: float
    last_time: float
    num_tokens: int = 0


class RequestObserver:
    """Feeds one model's latency histograms and token counters from its engine's outputs."""

    def __init__(self, metrics: ServerMetrics, model_name: str) -> None:
        self._ttft = metrics.ttft.labels(model_name)
        self._itl = metrics.itl.labels(model_name)
        self._e2e = metrics.e2e.labels(model_name)
        self._prompt_tokens = metrics.prompt_tokens.labels(model_name)
        self._generation_tokens = metrics.generation_tokens.labels(model_name)
        self._progress: dict[str, _Progress] = {}

    def on_outputs(self, outputs: list[RequestOutput], arrival_times: dict[str, float], now: float) -> None:
        for output in outputs:
            num_tokens = output.num_generated_tokens  # never decreases: every sampled token counts once
            progress = self._progress.get(output.request_id)
            if progress is None:
                arrival = arrival_times.get(output.request_id, now)
                self._ttft.observe(now - arrival)
                self._prompt_tokens.inc(len(output.prompt_token_ids))
                progress = self._progress[output.request_id] = _Progress(arrival, now)
            else:
                self._itl.observe(now - progress.last_time)
                progress.last_time = now
            self._generation_tokens.inc(num_tokens - progress.num_tokens)
            progress.num_tokens = num_tokens
            if output.finished:
                self._e2e.observe(now - progress.arrival_time)
                del self._progress[output.request_id]

    def on_abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._progress.pop(request_id, None)


class ServerMetrics:
    """The registry of one engine server: per-request histograms plus stats read at scrape time.

    ``stats_sources`` maps each served model name to a function returning its
    engine's stats (``LLMEngine.stats()`` keys; missing keys read as 0).
    """

    def __init__(self, stats_sources: dict[str, Callable[[], dict[str, int | float]]], device: str) -> None:
        self.registry = CollectorRegistry()
        labels = [LABEL]
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prefilled prompt tokens.", labels, registry=self.registry)
        self.generation_tokens = Counter(
            f"{PREFIX}generation_tokens", "Generated tokens.", labels, registry=self.registry
        )
        self.ttft = Histogram(
            f"{PREFIX}time_to_first_token_seconds", "Seconds from arrival to the first token.", labels,
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.itl = Histogram(
            f"{PREFIX}inter_token_latency_seconds", "Seconds between a request's consecutive steps.", labels,
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            f"{PREFIX}e2e_request_latency_seconds", "Seconds from arrival to the last token.", labels,
            buckets=_E2E_BUCKETS, registry=self.registry,
        )
        self.registry.register(_StatsCollector(stats_sources, device))

    def observer(self, model_name: str) -> RequestObserver:
        return RequestObserver(self, model_name)

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()


class _StatsCollector(Collector):
    def __init__(self, stats_sources: dict[str, Callable[[], dict[str, int | float]]], device: str) -> None:
        self._sources = stats_sources
        self._device = device
        self._process = psutil.Process(os.getpid())
        self._process.cpu_percent(None)  # starts the measuring interval

    def collect(self) -> Iterator[Metric]:
        stats = {name: source() for name, source in self._sources.items()}
        for suffix, doc, key in _GAUGES:
            family = GaugeMetricFamily(f"{PREFIX}{suffix}", doc, labels=[LABEL])
            for name, values in stats.items():
                family.add_metric([name], float(values.get(key, 0)))
            yield family
        for suffix, doc, key in _COUNTERS:
            family = CounterMetricFamily(f"{PREFIX}{suffix}", doc, labels=[LABEL])
            for name, values in stats.items():
                family.add_metric([name], float(values.get(key, 0)))
            yield family
        utilization, memory = self._device_usage()
        util_family = GaugeMetricFamily(
            f"{PREFIX}gpu_utilization", "Device utilization (0 to 1); on CPU the process's share of all cores.",
            labels=[LABEL],
        )
        memory_family = GaugeMetricFamily(
            f"{PREFIX}gpu_memory_usage_bytes", "Device memory in use; on CPU the process's resident memory.",
            labels=[LABEL],
        )
        for name in stats:
            util_family.add_metric([name], utilization)
            memory_family.add_metric([name], memory)
        yield util_family
        yield memory_family

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
