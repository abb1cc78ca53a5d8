"""Prometheus metrics for `GET /metrics`, named as vLLM names them where vLLM has one.

Pool and engine figures are read at scrape time from the engine's latest snapshot (a custom
collector: no gauge to keep in sync, and the block pool's hot paths stay free of metrics code);
the per-request histograms (`kvpool.server.request_metrics`: latencies, phases, inter-token
gaps, token counts) are observed by the server from what each output carries. Every app gets
its own `CollectorRegistry`, so several apps (tests, benchmarks) can live in one process.
Those with a vLLM twin are served under their `vllm:` name too (`vllm_metric_names.py`).

    gauges     kvpool:kv_cache_usage_perc, kvpool:num_{free,used,cached}_blocks, kvpool:num_blocks,
               kvpool:kv_cache_unfilled_slots, kvpool:num_requests_{running,waiting},
               kvpool:kv_pool_{online,max}_blocks
    counters   kvpool:prefix_cache_{queries,hits}_total (tokens),
               kvpool:prefix_cache_evictions_total, kvpool:num_preemptions_total,
               kvpool:{prompt,generation}_tokens_total,
               kvpool:block_{allocations,frees}_total, kvpool:engine_step_failures_total,
               kvpool:kv_pool_{grows,shrinks,migrated_blocks}_total,
               kvpool:request_success_total{finished_reason}
    histograms kvpool:{time_to_first_token,inter_token_latency,time_per_output_token,
               e2e_request_latency}_seconds, kvpool:request_{queue,prefill,decode,
               inference}_time_seconds, kvpool:request_time_per_output_token_seconds,
               kvpool:request_{prompt,generation}_tokens (request_metrics.py)
    tiers      kvpool:cpu_cache_usage_perc (vLLM V0's name: the host tier's used fraction),
               kvpool:host_{num_blocks,num_used_blocks,num_cached_blocks},
               kvpool:disk_cache_{bytes,capacity_bytes,files,enabled};
               kvpool:num_{swap,recompute}_preemptions_total,
               kvpool:swapped_{out,in}_{blocks,bytes}_total, kvpool:recompute_tokens_avoided_total,
               kvpool:kv_spilled_blocks_total, kvpool:kv_reloaded_blocks_total{source},
               kvpool:cached_tokens_total{source} (SGLang's: device, host, disk, shared),
               kvpool:disk_cache_{stored_blocks,rejected_files,evicted_files,write_errors}_total
    shared     kvpool:kv_shared_{up,pending_bytes}, kvpool:kv_shared_{stored_blocks,
               loaded_blocks,rejected_blocks,errors,dropped_writes,reconnects}_total
    transfer   (with kv_transfer_config) kvpool:kv_transfer_{blocks,bytes}_total{direction},
               kvpool:kv_transfer_failures_total{reason} (every reason, zeros too),
               kvpool:kv_transfer_leases_total{outcome}, kvpool:kv_transfer_seconds (loads),
               gauges kvpool:kv_transfer_{live_leases,leased_blocks,loads_in_flight}
    info       kvpool:cache_config_info{block_size, cache_dtype, num_gpu_blocks,
               bytes_per_block} = 1 (vLLM's cache_config_info; cache_dtype is the KV storage
               dtype, e.g. "int8" or "float8_e4m3fn")
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvpool.engine.async_engine import AsyncLLMEngine, EngineSnapshot
from kvpool.engine.kv_connector.stats import LOAD_SECONDS_BUCKETS, KVTransferStats
from kvpool.engine.requests.outputs import RequestOutput
from kvpool.memory.block_pool import BlockPoolStats
from kvpool.memory.tiers.redis_tier import SharedTierStats
from kvpool.server.request_metrics import RequestHistograms
from kvpool.server.vllm_metric_names import WithVllmNames


class EngineCollector(Collector):
    """Pool and engine figures from `AsyncLLMEngine.snapshot()`, read at each scrape."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        snapshot = self.engine.snapshot()
        memory, stats, kv_pool = snapshot.memory, snapshot.stats, snapshot.kv_pool
        gauges = [
            ("kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1).", memory.usage),
            ("num_blocks", "KV blocks in the pool.", memory.num_blocks),
            ("num_free_blocks", "KV blocks free and holding no cached prefix.",
             memory.num_free_blocks),
            ("num_used_blocks", "KV blocks held by running sequences.", memory.num_used_blocks),
            ("num_cached_blocks", "Unreferenced KV blocks keeping a reusable prefix.",
             memory.num_cached_blocks),
            ("kv_cache_unfilled_slots", "Token slots reserved in used blocks but not yet filled.",
             memory.num_unfilled_slots),
            ("num_requests_running", "Requests with sequences in the running batch.",
             snapshot.num_requests_running),
            ("num_requests_waiting", "Requests waiting for admission (or re-admission).",
             snapshot.num_requests_waiting),
            ("kv_pool_online_blocks", "KV blocks online (an elastic pool grows and shrinks).",
             kv_pool.num_online_blocks),
            ("kv_pool_max_blocks", "KV blocks the pool can hold at its largest.",
             kv_pool.max_num_blocks),
        ]
        for name, documentation, value in gauges:
            yield self._family(GaugeMetricFamily, name, documentation, value)
        counters = [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             memory.prefix_cache_queries_tokens),
            ("prefix_cache_hits", "Prompt tokens served by the prefix cache.",
             memory.prefix_cache_hits_tokens),
            ("prefix_cache_evictions", "Cached blocks evicted to make room.", memory.num_evictions),
            ("num_preemptions", "Sequences preempted (KV dropped, recomputed later).",
             stats.num_preemptions),
            ("prompt_tokens", "Prompt tokens of every request added.", stats.num_prompt_tokens),
            ("generation_tokens", "Tokens generated.", stats.num_generated_tokens),
            ("block_allocations", "KV blocks handed out by the pool.", memory.num_allocations),
            ("block_frees", "KV blocks returned to the pool.", memory.num_frees),
            ("engine_step_failures", "Engine steps that raised (their requests failed).",
             snapshot.num_failed_steps),
            ("kv_pool_grows", "Segments an elastic KV pool brought online.", kv_pool.num_grows),
            ("kv_pool_shrinks", "Segments an elastic KV pool gave back.", kv_pool.num_shrinks),
            ("kv_pool_migrated_blocks", "Used blocks copied elsewhere by shrinks.",
             kv_pool.num_migrated_blocks),
            ("spec_decode_num_drafts", "Speculative drafts verified (one per sequence and "
             "step that drafted).", stats.spec_decode.num_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens verified.",
             stats.spec_decode.num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
             stats.spec_decode.num_accepted_tokens),
        ]
        for name, documentation, value in counters:
            yield self._family(CounterMetricFamily, name, documentation, value)
        yield self._accepted_per_position(stats.spec_decode.num_accepted_tokens_per_pos)
        yield from self._tier_metrics(snapshot)
        if snapshot.kv_tiers.shared is not None:
            yield from self._shared_metrics(snapshot.kv_tiers.shared)
        if snapshot.kv_transfer is not None:
            yield from self._kv_transfer_metrics(snapshot.kv_transfer)
        yield self._cache_config(snapshot.memory)

    def _tier_metrics(self, snapshot: EngineSnapshot) -> Iterator[Metric]:
        """The host and disk tiers, swap preemption, and prompt tokens served per tier."""
        stats, tiers = snapshot.stats, snapshot.kv_tiers
        host, disk = tiers.host, tiers.disk
        gauges = []
        if host is not None:
            gauges += [("cpu_cache_usage_perc", "Fraction of the host tier's blocks in use (0 to "
                        "1).", host.num_used_blocks / host.num_blocks),
                       ("host_num_blocks", "KV blocks in the host tier.", host.num_blocks),
                       ("host_num_used_blocks", "Host blocks of swapped-out sequences (or "
                        "mid-copy).", host.num_used_blocks),
                       ("host_num_cached_blocks", "Host blocks keeping a spilled prefix.",
                        host.num_cached_blocks)]
        if disk is not None:
            gauges += [("disk_cache_bytes", "Bytes of KV files in the disk tier.", disk.num_bytes),
                       ("disk_cache_capacity_bytes", "The disk tier's byte budget.",
                        disk.capacity_bytes),
                       ("disk_cache_files", "KV block files in the disk tier.", disk.num_files),
                       ("disk_cache_enabled", "1 while the disk tier works, 0 once a write "
                        "failed (disk full) and it switched itself off.", int(disk.is_enabled))]
        for name, documentation, value in gauges:
            yield self._family(GaugeMetricFamily, name, documentation, value)
        counters = [
            ("num_swap_preemptions", "Preemptions whose KV went to the host tier.",
             stats.num_swap_preemptions),
            ("num_recompute_preemptions", "Preemptions whose KV was dropped.",
             stats.num_recompute_preemptions),
            ("swapped_out_blocks", "KV blocks swapped out to the host tier.",
             stats.num_swapped_out_blocks),
            ("swapped_out_bytes", "Bytes swapped out to the host tier.",
             stats.num_swapped_out_bytes),
            ("swapped_in_blocks", "KV blocks swapped back in.", stats.num_swapped_in_blocks),
            ("swapped_in_bytes", "Bytes swapped back in.", stats.num_swapped_in_bytes),
            ("recompute_tokens_avoided", "Computed tokens swapped sequences resumed with.",
             stats.num_recompute_tokens_avoided),
            ("kv_spilled_blocks", "Cached blocks the device evicted into the host tier.",
             tiers.num_spilled_blocks),
        ]
        if disk is not None:
            counters += [
                ("disk_cache_stored_blocks", "Blocks written to the disk tier.",
                 disk.num_stored_blocks),
                ("disk_cache_rejected_files", "Disk files found truncated, corrupt, foreign or "
                 "holding other tokens: skipped and deleted, never served.",
                 disk.num_rejected_files),
                ("disk_cache_evicted_files", "Disk files the LRU removed to stay in budget.",
                 disk.num_evicted_files),
                ("disk_cache_write_errors", "Disk tier writes that failed.", disk.num_write_errors),
            ]
        for name, documentation, value in counters:
            yield self._family(CounterMetricFamily, name, documentation, value)
        yield self._by_label("cached_tokens", "Prompt tokens served by the prefix cache of each "
                             "tier (device, host, disk, shared).", "source",
                             stats.cached_tokens_by_tier)
        yield self._by_label("kv_reloaded_blocks", "Prefix blocks copied up to the device, by "
                             "source tier.", "source", tiers.num_reloaded_blocks)

    def _shared_metrics(self, shared: SharedTierStats) -> Iterator[Metric]:
        """The shared tier (Redis): whether it is up, and what it wrote, served and refused."""
        yield self._family(GaugeMetricFamily, "kv_shared_up", "1 while the shared KV tier's "
                           "Redis answers, 0 while it is down or too slow.", int(shared.is_up))
        yield self._family(GaugeMetricFamily, "kv_shared_pending_bytes", "KV bytes queued for "
                           "writing to Redis.", shared.num_pending_bytes)
        counters = [
            ("stored_blocks", "Blocks written to Redis.", shared.num_stored_blocks),
            ("loaded_blocks", "Blocks read from Redis, validated and served.",
             shared.num_loaded_blocks),
            ("rejected_blocks", "Redis values found truncated, corrupt, foreign or holding other "
             "tokens: deleted, never served.", shared.num_rejected_blocks),
            ("errors", "Redis calls that failed (down, slower than the timeout, refused).",
             shared.num_errors),
            ("dropped_writes", "Blocks not written: Redis down, or the write queue full.",
             shared.num_dropped_writes),
            ("reconnects", "Times Redis answered again after being down.",
             shared.num_reconnects),
        ]
        for name, documentation, value in counters:
            yield self._family(CounterMetricFamily, f"kv_shared_{name}", documentation, value)

    def _kv_transfer_metrics(self, transfer: KVTransferStats) -> Iterator[Metric]:
        """The KV connector (disaggregated prefill and decode): what moved, what failed, the
        leases a producer holds and how long a consumer's loads took. The live-lease gauge is
        `live_leases`, since `kv_transfer_leases` is the lease counter's family name."""
        gauges = [("live_leases", "Leases a producer holds for decode workers.",
                   transfer.num_leases),
                  ("leased_blocks", "KV blocks those leases hold (a block counts once).",
                   transfer.num_leased_blocks),
                  ("loads_in_flight", "Handed-over prompts a consumer is loading.",
                   transfer.num_loading)]
        for name, documentation, value in gauges:
            yield self._family(GaugeMetricFamily, f"kv_transfer_{name}", documentation, value)
        yield self._by_label("kv_transfer_blocks", "KV blocks handed over: sent (leases their "
                             "reader released) and received (loaded here).", "direction",
                             {"sent": transfer.num_sent_blocks,
                              "received": transfer.num_received_blocks})
        yield self._by_label("kv_transfer_bytes", "KV bytes handed over, sent and received.",
                             "direction", {"sent": transfer.num_sent_bytes,
                                           "received": transfer.num_received_bytes})
        yield self._by_label("kv_transfer_failures", "KV loads that failed, by reason "
                             "(kvpool.engine.kv_connector.errors).", "reason",
                             transfer.failures_by_reason)
        yield self._by_label("kv_transfer_leases", "Leases a producer granted, and how they "
                             "ended.", "outcome", {"granted": transfer.num_leases_granted,
                                                   "released": transfer.num_leases_released,
                                                   "expired": transfer.num_leases_expired})
        yield self._load_seconds(transfer)

    def _load_seconds(self, transfer: KVTransferStats) -> Metric:
        """The load-latency histogram, its per-bucket counts made cumulative (Prometheus')."""
        bounds = [*map(floatToGoString, LOAD_SECONDS_BUCKETS), "+Inf"]
        cumulative = itertools.accumulate(transfer.load_seconds_counts)
        family = HistogramMetricFamily("kvpool:kv_transfer_seconds", "Seconds a consumer took "
                                       "to load a handed-over prompt's blocks (successful "
                                       "loads).", labels=["model_name"])
        family.add_metric([self.model_name], list(zip(bounds, cumulative, strict=True)),
                          transfer.load_seconds_sum)
        return family

    def _accepted_per_position(self, counts: tuple[int, ...]) -> Metric:
        family = CounterMetricFamily("kvpool:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the draft.",
                                     labels=["model_name", "position"])
        for position, count in enumerate(counts):
            family.add_metric([self.model_name, str(position)], count)
        return family

    def _by_label(self, name: str, documentation: str, label: str,
                  values: dict[str, int]) -> Metric:
        """A counter with one sample per value of `label` (`values`: label value -> count)."""
        family = CounterMetricFamily(f"kvpool:{name}", documentation,
                                     labels=["model_name", label])
        for key, value in values.items():
            family.add_metric([self.model_name, key], value)
        return family

    def _cache_config(self, memory: BlockPoolStats) -> Metric:
        labels = {"block_size": memory.block_size, "cache_dtype": memory.kv_cache_dtype,
                  "num_gpu_blocks": memory.num_blocks, "bytes_per_block": memory.bytes_per_block}
        family = GaugeMetricFamily("kvpool:cache_config_info", "KV cache configuration.",
                                   labels=["model_name", *labels])
        family.add_metric([self.model_name, *map(str, labels.values())], 1)
        return family

    def _family(self, kind: type, name: str, documentation: str, value: float) -> Metric:
        family = kind(f"kvpool:{name}", documentation, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family


class ServerMetrics:
    """The app's registry: the engine collector plus the per-request histograms."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))
        self.requests = RequestHistograms(self.registry, model_name, engine.max_model_len)

    def observe_output(self, output: RequestOutput) -> None:
        """Every output of a request, as it passes: its inter-token gaps."""
        self.requests.observe_output(output)

    def observe_finished(self, output: RequestOutput, num_tokens: dict[int, int]) -> None:
        """A finished request's final output; `num_tokens`: each completion's length."""
        self.requests.observe_finished(output, num_tokens)

    def render(self) -> bytes:
        return generate_latest(WithVllmNames(self.registry))
