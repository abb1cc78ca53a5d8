"""The router's own Prometheus metrics (`GET /metrics` on the router), in a registry per app.

    counters   kvpool_router_requests_total{replica, reason}   routing decisions: "prefix"
                   (the replica held part of the prompt), "load" (nothing matched within the
                   load cap, or the prompt could not be hashed; every decode worker's),
                   "round_robin"
               kvpool_router_stage_requests_total{stage}   the same decisions by the stage
                   they were for: "both" (a plain replica), "prefill", "decode"
               kvpool_router_load_capped_total   decisions that passed over a replica holding
                   more of the prompt because of its load
               kvpool_router_retries_total   requests sent again to another replica because the
                   first failed before its first byte
               kvpool_router_upstream_errors_total{replica, kind}   "connect" (refused, reset
                   or closed before the response began), "stream" (broken after it began),
                   "timeout", "status" (a prefill worker's 5xx, tried elsewhere)
               kvpool_router_no_replica_total   requests answered 503: no replica was in
               kvpool_router_prompt_tokens_total, kvpool_router_prefix_matched_tokens_total
                   tokens of the hashed prompts, and of those the chosen replica held
                   (their ratio is the routed hit rate the router expects)
    histogram  kvpool_router_prefill_duration_seconds   a disaggregated request's prefill hop,
                   from its first send to its answer read whole (a retry included), by the
                   time-to-first-token buckets: it is the decode's first token's wait
    gauges     kvpool_router_replica_healthy{replica}, kvpool_router_replica_in_flight{replica},
               kvpool_router_replica_indexed_blocks{replica}   read from the replicas at each
                   scrape (no gauge to keep in sync)
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool.engine.observability.latency_buckets import TIME_TO_FIRST_TOKEN_BUCKETS
from kvpool.router.policy import Choice
from kvpool.router.prompt_tokens import PromptKey
from kvpool.router.replicas import ReplicaSet, Role

UPSTREAM_ERROR_KINDS = ("connect", "stream", "timeout", "status")


class ReplicaCollector(Collector):
    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "healthy": ("1 while the replica is routed to, 0 while it is out.",
                        lambda replica: float(replica.is_healthy)),
            "in_flight": ("Requests forwarded to the replica whose response has not ended.",
                          lambda replica: replica.num_in_flight),
            "indexed_blocks": ("Blocks the replica holds, as its KV events tell.",
                               lambda replica: len(replica.events.index) if replica.events
                               else 0),
        }
        for name, (documentation, read) in gauges.items():
            family = GaugeMetricFamily(f"kvpool_router_replica_{name}", documentation,
                                       labels=["replica"])
            for replica in self.replicas:
                family.add_metric([replica.url], read(replica))
            yield family


class RouterMetrics:
    def __init__(self, replicas: ReplicaSet) -> None:
        self.registry = CollectorRegistry()
        counter = self._counter
        self.requests = counter("requests", "Routing decisions, by replica and reason.",
                                ["replica", "reason"])
        self.stage_requests = counter("stage_requests", "Routing decisions, by the stage of "
                                      "the request they were for.", ["stage"])
        self.load_capped = counter("load_capped", "Decisions that passed over a replica "
                                   "holding more of the prompt because of its load.")
        self.retries = counter("retries", "Requests sent again to another replica after the "
                               "first failed before its first byte.")
        self.upstream_errors = counter("upstream_errors", "Failed exchanges with a replica.",
                                       ["replica", "kind"])
        self.no_replica = counter("no_replica", "Requests refused: no replica was in.")
        self.prompt_tokens = counter("prompt_tokens", "Tokens of the prompts routed by hash.")
        self.matched_tokens = counter("prefix_matched_tokens", "Prompt tokens the chosen "
                                      "replica held, by its KV events.")
        self.prefill_seconds = Histogram(
            "kvpool_router_prefill_duration_seconds", "A disaggregated request's prefill hop, "
            "from its first send to its whole answer.", registry=self.registry,
            buckets=TIME_TO_FIRST_TOKEN_BUCKETS)
        self.registry.register(ReplicaCollector(replicas))
        for replica in replicas:  # every series exists from the start, at 0
            self.stage_requests.labels(replica.role)
            for kind in UPSTREAM_ERROR_KINDS:
                self.upstream_errors.labels(replica.url, kind)

    def _counter(self, name: str, documentation: str, labels: list[str] | None = None
                 ) -> Counter:
        return Counter(f"kvpool_router_{name}", documentation, labels or [],
                       registry=self.registry)

    def record_choice(self, choice: Choice, role: Role, key: PromptKey,
                      block_size: int | None) -> None:
        self.requests.labels(choice.name, choice.reason).inc()
        self.stage_requests.labels(role).inc()
        self.load_capped.inc(choice.is_load_capped)
        if key.num_prompt_tokens:
            self.prompt_tokens.inc(key.num_prompt_tokens)
            self.matched_tokens.inc(choice.num_matched_blocks * (block_size or 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
