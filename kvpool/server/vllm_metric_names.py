"""`/metrics` under vLLM's names too, so existing vLLM dashboards and alerts work unchanged.

Every kvpool metric that has a vLLM equivalent (same meaning, same unit, same kind) is served
twice: as `kvpool:<name>` and as `vllm:<vllm name>`, with the same type, labels (`model_name`,
plus `finished_reason` or `le` where the metric has them) and values. The copies are made at
scrape time from the registry's own families, so the two can never disagree and nothing is
observed twice. kvpool metrics with no vLLM counterpart (block counts, tiers, the shared
tier) keep their `kvpool:` name only; vLLM metrics kvpool does not measure are not invented.

    kvpool:<name>                           vllm:<name>
    kv_cache_usage_perc                     kv_cache_usage_perc, gpu_cache_usage_perc (V0's)
    cpu_cache_usage_perc                    cpu_cache_usage_perc (V0's; with a host tier)
    num_requests_{running,waiting}          the same
    prefix_cache_{queries,hits}_total       the same (tokens)
    num_preemptions_total                   the same
    {prompt,generation}_tokens_total        the same
    spec_decode_*_total                     the same (drafts, draft and accepted tokens,
                                            accepted per position)
    request_success_total{finished_reason}  the same
    cache_config_info                       the same
    the per-request histograms              the same (request_metrics.py)
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

KVPOOL_PREFIX = "kvpool:"
VLLM_PREFIX = "vllm:"

# kvpool family name (without prefix; counters without `_total`) -> its vLLM names.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    **{name: (name,) for name in (
        "cpu_cache_usage_perc", "num_requests_running", "num_requests_waiting",
        "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
        "generation_tokens", "request_success", "cache_config_info",
        "time_to_first_token_seconds", "inter_token_latency_seconds",
        "time_per_output_token_seconds", "request_time_per_output_token_seconds",
        "e2e_request_latency_seconds", "request_queue_time_seconds",
        "request_prefill_time_seconds", "request_decode_time_seconds",
        "request_inference_time_seconds", "request_prompt_tokens",
        "request_generation_tokens", "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens_per_pos")},
}


class WithVllmNames(Collector):
    """A view of `registry` for exposition: each family, then its vLLM-named copies."""

    def __init__(self, registry: Collector) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            yield family
            for vllm_name in vllm_names(family.name):
                yield renamed(family, vllm_name)


def vllm_names(name: str) -> tuple[str, ...]:
    """The full vLLM names of the kvpool family `name` (none if vLLM has no such metric)."""
    if not name.startswith(KVPOOL_PREFIX):
        return ()
    return tuple(VLLM_PREFIX + vllm for vllm in VLLM_NAMES.get(name[len(KVPOOL_PREFIX):], ()))


def renamed(family: Metric, name: str) -> Metric:
    """A copy of `family` named `name`: each sample keeps its suffix (`_total`, `_bucket`,
    `_count`, `_sum`, `_created`), labels and value."""
    copy = Metric(name, family.documentation, family.type, family.unit)
    copy.samples = [sample._replace(name=name + sample.name[len(family.name):])
                    for sample in family.samples]
    return copy
