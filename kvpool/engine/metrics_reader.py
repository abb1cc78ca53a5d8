"""`LLM.get_metrics()`: the engine's counters as vLLM's metric records (`Counter`, `Gauge`,
`Histogram` with `name`, `tags` and values, as `vllm.v1.metrics.reader` has them), under the
`vllm:` names vLLM's Prometheus metrics and Grafana dashboards use for the same facts.

Every value is read from the engine's own records (`LLMEngine.stats()`, the block pool's
snapshot, the scheduler's counts) when called: nothing is kept here, so the reader costs the
engine nothing between calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.engine.engine import LLMEngine


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
class Histogram(Metric):
    """Observations: their count, sum and cumulative counts per upper bound ("+Inf" last)."""

    count: int = 0
    sum: float = 0.0
    buckets: dict[str, int] = field(default_factory=dict)


def read_metrics(engine: LLMEngine, model_name: str) -> list[Metric]:
    """The engine's metrics now, vLLM-named."""
    tags = {"model_name": model_name, "engine": "0"}
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
        Counter("kvpool:num_steps", tags, stats.num_steps),
        Gauge("kvpool:peak_used_blocks", tags, float(stats.peak_used_blocks)),
    ]
