"""`/metrics`: every documented metric is exported, and its value agrees with the requests
sent and with `/v1/kv/stats`; each app has its own registry."""

from __future__ import annotations

from tests.server.conftest import MODEL, scrape

PROMPT = "A long prompt about lighthouses and the keepers who lit them every night. " * 3

GAUGES = ("kv_cache_usage_perc", "num_blocks", "num_free_blocks", "num_used_blocks",
          "num_cached_blocks", "kv_cache_unfilled_slots", "num_requests_running",
          "num_requests_waiting", "kv_pool_online_blocks", "kv_pool_max_blocks")
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_evictions",
            "num_preemptions", "prompt_tokens", "generation_tokens", "block_allocations",
            "block_frees", "engine_step_failures", "kv_pool_grows", "kv_pool_shrinks",
            "kv_pool_migrated_blocks", "request_success")
HISTOGRAMS = ("time_to_first_token_seconds", "time_per_output_token_seconds",
              "e2e_request_latency_seconds")


def test_every_metric_is_exported(make_server) -> None:
    samples = scrape(make_server())
    for name in GAUGES:
        assert f"kvpool:{name}" in samples
    for name in COUNTERS[:-1]:
        assert f"kvpool:{name}_total" in samples
    for name in HISTOGRAMS:
        assert f"kvpool:{name}_count" in samples


def test_values_agree_with_the_requests_and_the_pool(make_server) -> None:
    server = make_server(num_gpu_blocks=32)
    client = server.client()
    completions = [
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens,
                                  extra_body={"ignore_eos": True})
        for max_tokens in (1, 5, 3)
    ]
    server.wait_until_idle()
    samples, stats = scrape(server), server.kv_stats()
    assert samples["kvpool:prompt_tokens_total"] == sum(c.usage.prompt_tokens for c in completions)
    assert samples["kvpool:generation_tokens_total"] == 1 + 5 + 3
    assert samples["kvpool:request_success_total{finished_reason=length}"] == 3
    assert samples["kvpool:time_to_first_token_seconds_count"] == 3
    assert samples["kvpool:e2e_request_latency_seconds_count"] == 3
    assert samples["kvpool:time_per_output_token_seconds_count"] == 2  # one-token requests: none
    cached = sum(c.usage.prompt_tokens_details.cached_tokens for c in completions)
    assert samples["kvpool:prefix_cache_hits_total"] == stats["prefix_cache_hits_tokens"] == cached
    assert cached > 0
    assert samples["kvpool:prefix_cache_queries_total"] == stats["prefix_cache_queries_tokens"]
    assert samples["kvpool:num_blocks"] == stats["num_blocks"] == 32
    assert samples["kvpool:num_used_blocks"] == samples["kvpool:kv_cache_usage_perc"] == 0
    assert samples["kvpool:num_free_blocks"] + samples["kvpool:num_cached_blocks"] == 32
    assert samples["kvpool:block_allocations_total"] == stats["num_allocations"] > 0
    assert samples["kvpool:block_frees_total"] == stats["num_frees"]
    assert samples["kvpool:num_requests_running"] == samples["kvpool:num_requests_waiting"] == 0


def test_each_app_has_its_own_registry(make_server) -> None:
    first, second = make_server(), make_server()
    first.client().completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert scrape(first)["kvpool:time_to_first_token_seconds_count"] == 1
    assert scrape(second)["kvpool:time_to_first_token_seconds_count"] == 0


def test_a_stream_is_timed_over_all_its_tokens(make_server) -> None:
    """A stream's outputs are deltas: the per-token latency counts the tokens of all of them,
    not only the last one's (a one-token final delta would skip the observation)."""
    server = make_server()
    chunks = list(server.client().completions.create(
        model=MODEL, prompt="hi", max_tokens=5, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"
    samples = scrape(server)
    assert samples["kvpool:time_per_output_token_seconds_count"] == 1
    assert samples["kvpool:e2e_request_latency_seconds_count"] == 1


def test_a_quantized_pool_reports_its_kv_dtype(make_server) -> None:
    """int8 KV through the server: completions run, and /v1/kv/stats and the
    cache_config_info metric name the storage dtype and its bytes per block (scales in)."""
    server = make_server(kv_cache_dtype="int8")
    completion = server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 4
    stats = server.wait_until_idle()
    layout = server.engine.engine.kv_memory.layout
    assert stats["kv_cache_dtype"] == "int8" and stats["bytes_per_block"] == layout.bytes_per_block
    assert stats["kv_pool"]["bytes_per_block"] == layout.bytes_per_block
    info = ("kvpool:cache_config_info{block_size=16}{bytes_per_block="
            f"{layout.bytes_per_block}}}{{cache_dtype=int8}}{{num_gpu_blocks=128}}")
    assert scrape(server)[info] == 1


TIER_GAUGES = ("cpu_cache_usage_perc", "host_num_blocks", "host_num_used_blocks",
               "host_num_cached_blocks", "disk_cache_bytes", "disk_cache_capacity_bytes",
               "disk_cache_files", "disk_cache_enabled")
TIER_COUNTERS = ("num_swap_preemptions", "num_recompute_preemptions", "swapped_out_blocks",
                 "swapped_out_bytes", "swapped_in_blocks", "swapped_in_bytes",
                 "recompute_tokens_avoided", "kv_spilled_blocks", "disk_cache_stored_blocks",
                 "disk_cache_rejected_files", "disk_cache_evicted_files",
                 "disk_cache_write_errors")


def test_tier_metrics_agree_with_kv_stats(make_server, tmp_path) -> None:
    """A pressured pool with a host tier (swap) and a disk tier: the swaps, spills and
    per-tier cached tokens on /metrics are /v1/kv/stats' figures."""
    server = make_server(num_gpu_blocks=12, swap_space=0.01, preemption_mode="swap",
                         kv_disk_cache=str(tmp_path))
    client = server.client()
    for index in range(2):  # the second asks for the first's prompt: a prefix hit
        client.completions.create(model=MODEL, prompt=[PROMPT, PROMPT + str(index)] * 3,
                                  max_tokens=24, extra_body={"ignore_eos": True})
    tiers = server.wait_until_idle()["kv_tiers"]
    samples = scrape(server)
    for name in TIER_GAUGES:
        assert f"kvpool:{name}" in samples
    for name in TIER_COUNTERS:
        assert f"kvpool:{name}_total" in samples
    assert tiers["num_swap_preemptions"] > 0
    assert samples["kvpool:num_swap_preemptions_total"] == tiers["num_swap_preemptions"]
    assert samples["kvpool:swapped_out_bytes_total"] == tiers["num_swapped_out_bytes"] > 0
    assert samples["kvpool:host_num_blocks"] == tiers["host"]["num_blocks"]
    for source, value in tiers["cached_tokens_by_tier"].items():
        assert samples[f"kvpool:cached_tokens_total{{source={source}}}"] == value
    assert sum(tiers["cached_tokens_by_tier"].values()) > 0
    assert samples["kvpool:disk_cache_enabled"] == 1
