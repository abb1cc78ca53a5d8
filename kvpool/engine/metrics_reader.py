"""`LLM.get_metrics()`: the engine's counters as vLLM's metric records (`Counter`, `Gauge`,
`Histogram` with `name`, `tags` and values, as `vllm.v1.metrics.reader` has them), under the
`vllm:` names vLLM's Prometheus metrics and Grafana dashboards use for the same facts.

Every value is read from the engine's own records (`LLMEngine.stats()`, the block pool's
snapshot, the scheduler's counts) when called: nothing is kept here, so the reader costs the
engine nothing between calls. The request-latency histograms are the exception: the engine
keeps no per-request history, so `LLM` records each finished request it hands back
(`LatencyRecorder`), and only requests run through that `LLM` are counted.

Facts vLLM has no metric for keep the `kvpool:` name `/metrics` gives them (without a
counter's `_total`): the step count, the peak of used blocks and, for an engine with a KV
connector (`kv_transfer_config`), the handovers: `kvpool:kv_transfer_{blocks,bytes}`
(tag `direction`: sent, received), `kvpool:kv_transfer_failures` (tag `reason`, every one),
`kvpool:kv_transfer_leases` (tag `outcome`: granted, released, expired), the gauges
`kvpool:kv_transfer_{live_leases,leased_blocks,loads_in_flight}` and the load-latency
histogram `kvpool:kv_transfer_seconds`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpool.engine.kv_connector.stats import LOAD_SECONDS_BUCKETS, KVTransferStats
from kvpool.engine.observability.latency_buckets import (
    REQUEST_LATENCY_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
)

if TYPE_CHECKING:
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.requests.outputs import RequestMetrics


@dataclass(frozen=True)
class Metric:
    """A metric's name and labels (vLLM's `tags`, e.g. {"model_name": ...})."""

    name: str
    tags: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Counter(Metric):
    """A total that only grows (between `reset_stats` calls)."""

    value: int = 0


@dataclass(frozen=True)
class Gauge(Metric):
    """A value now."""

    value: float = 0.0


@dataclass(frozen=True)
class Vector(Metric):
    """Totals by position (vLLM's `Vector`: acceptances per draft position)."""

    values: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Histogram(Metric):
    """Observations: their count, sum and cumulative counts per upper bound ("+Inf" last)."""

    count: int = 0
    sum: float = 0.0
    buckets: dict[str, int] = field(default_factory=dict)


class LatencyRecorder:
    """Time to first token and end-to-end latency of the finished requests `LLM` hands back
    (the engine keeps no per-request history): counts per bucket, their count and sum."""

    def __init__(self) -> None:
        self.observations: dict[str, list[float]] = {
            "vllm:time_to_first_token_seconds": [], "vllm:e2e_request_latency_seconds": []}

    def record(self, metrics: RequestMetrics | None) -> None:
        if metrics is None:
            return
        if metrics.first_token_time is not None:
            ttft = metrics.first_token_time - metrics.arrival_time
            self.observations["vllm:time_to_first_token_seconds"].append(ttft)
        if metrics.finish_time is not None:
            e2e = metrics.finish_time - metrics.arrival_time
            self.observations["vllm:e2e_request_latency_seconds"].append(e2e)

    def histograms(self, tags: dict[str, str]) -> list[Histogram]:
        bounds = {"vllm:time_to_first_token_seconds": TIME_TO_FIRST_TOKEN_BUCKETS,
                  "vllm:e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS}
        return [_histogram(name, tags, values, bounds[name])
                for name, values in self.observations.items()]


def _histogram(name: str, tags: dict[str, str], values: list[float],
               bounds: tuple[float, ...]) -> Histogram:
    buckets = {str(bound): sum(value <= bound for value in values) for bound in bounds}
    buckets["+Inf"] = len(values)
    return Histogram(name, tags, len(values), sum(values), buckets)


def read_metrics(engine: LLMEngine, model_name: str,
                 latencies: LatencyRecorder | None = None) -> list[Metric]:
    """The engine's metrics now, vLLM-named; with `latencies`, its histograms too."""
    tags = {"model_name": model_name, "engine": "0"}
    histograms = [] if latencies is None else latencies.histograms(tags)
    stats = engine.stats()
    pool = engine.memory_stats()
    num_running, num_waiting = engine.request_counts()
    return [
        Gauge("vllm:num_requests_running", tags, float(num_running)),
        Gauge("vllm:num_requests_waiting", tags, float(num_waiting)),
        Gauge("vllm:kv_cache_usage_perc", tags, pool.usage),
        Counter("vllm:prefix_cache_queries", tags, pool.prefix_cache_queries_tokens),
        Counter("vllm:prefix_cache_hits", tags, pool.prefix_cache_hits_tokens),
        Counter("vllm:num_preemptions", tags, stats.num_preemptions),
        Counter("vllm:prompt_tokens", tags, stats.num_prompt_tokens),
        Counter("vllm:generation_tokens", tags, stats.num_generated_tokens),
        Counter("vllm:spec_decode_num_drafts", tags, stats.spec_decode.num_drafts),
        Counter("vllm:spec_decode_num_draft_tokens", tags, stats.spec_decode.num_draft_tokens),
        Counter("vllm:spec_decode_num_accepted_tokens", tags,
                stats.spec_decode.num_accepted_tokens),
        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", tags,
               list(stats.spec_decode.num_accepted_tokens_per_pos)),
        Counter("kvpool:num_steps", tags, stats.num_steps),
        Gauge("kvpool:peak_used_blocks", tags, float(stats.peak_used_blocks)),
        *_kv_transfer_metrics(engine.kv_connector.stats(), tags),
        *histograms,
    ]


def _kv_transfer_metrics(transfer: KVTransferStats | None,
                         tags: dict[str, str]) -> list[Metric]:
    """The KV connector's handovers (module docstring); none without a connector."""
    if transfer is None:
        return []

    def by(name: str, tag: str, values: dict[str, int]) -> list[Metric]:
        return [Counter(f"kvpool:kv_transfer_{name}", {**tags, tag: key}, value)
                for key, value in values.items()]

    cumulative = itertools.accumulate(transfer.load_seconds_counts)
    bounds = [*map(str, LOAD_SECONDS_BUCKETS), "+Inf"]
    buckets = dict(zip(bounds, cumulative, strict=True))
    return [
        *by("blocks", "direction", {"sent": transfer.num_sent_blocks,
                                    "received": transfer.num_received_blocks}),
        *by("bytes", "direction", {"sent": transfer.num_sent_bytes,
                                   "received": transfer.num_received_bytes}),
        *by("failures", "reason", transfer.failures_by_reason),
        *by("leases", "outcome", {"granted": transfer.num_leases_granted,
                                  "released": transfer.num_leases_released,
                                  "expired": transfer.num_leases_expired}),
        Gauge("kvpool:kv_transfer_live_leases", tags, float(transfer.num_leases)),
        Gauge("kvpool:kv_transfer_leased_blocks", tags, float(transfer.num_leased_blocks)),
        Gauge("kvpool:kv_transfer_loads_in_flight", tags, float(transfer.num_loading)),
        Histogram("kvpool:kv_transfer_seconds", tags, buckets["+Inf"],
                  transfer.load_seconds_sum, buckets),
    ]
