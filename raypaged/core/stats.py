"""The scheduler's counters as one typed, read-only record (``LLM.stats()``, ``/metrics``, gRPC Metrics)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields


@dataclass(frozen=True, slots=True, eq=False)
class SchedulerStats(Mapping):
    """A snapshot of the KV pools, the queues and the cumulative counters.

    Typed attributes for code (``stats.num_gpu_blocks_free``), and a read-only mapping by the
    same names for callers that treat stats as a dict (``stats["num_gpu_blocks_free"]``,
    ``dict(stats)``, equality with a dict); speculative decoding's counters are keys too
    (``spec_decode_*``; the accepted ones also by position, one key per speculative token).
    """

    num_gpu_blocks_total: int
    num_gpu_blocks_free: int
    num_cpu_blocks_total: int
    num_cpu_blocks_free: int
    kv_cache_usage: float  # the device pool's share of blocks in use, 0-1
    num_requests_running: int
    num_requests_waiting: int
    num_requests_swapped: int
    num_preemptions: int
    num_swap_outs: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec_decode: dict[str, int] = field(default_factory=dict)  # the spec_decode_* keys and their counts

    def __getitem__(self, key: str) -> int | float:
        if key in _FIELDS:
            return getattr(self, key)
        return self.spec_decode[key]

    def __iter__(self) -> Iterator[str]:
        yield from _FIELDS
        yield from self.spec_decode

    def __len__(self) -> int:
        return len(_FIELDS) + len(self.spec_decode)


_FIELDS = tuple(f.name for f in fields(SchedulerStats) if f.name != "spec_decode")
