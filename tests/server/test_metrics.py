"""`/metrics`: every documented metric is exported, and its value agrees with the requests
sent and with `/v1/kv/stats`; each app has its own registry; the per-request histograms mean
what vLLM's mean; /metrics is guarded like the other routes unless a metrics key or the
unauthenticated flag says otherwise."""

from __future__ import annotations

import httpx
import pytest

from kvpool.openai.auth import METRICS_TENANT, ApiKeyTable
from kvpool.server.config import ServerConfig
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
              "e2e_request_latency_seconds", "inter_token_latency_seconds",
              "request_time_per_output_token_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_inference_time_seconds", "request_prompt_tokens",
              "request_generation_tokens")


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
    assert samples["kvpool:time_per_output_token_seconds_count"] == 0 + 4 + 2  # one per gap
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
    """A stream's outputs are deltas: the inter-token gaps of all of them are counted, not
    only the last one's."""
    server = make_server()
    chunks = list(server.client().completions.create(
        model=MODEL, prompt="hi", max_tokens=5, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"
    samples = scrape(server)
    assert samples["kvpool:time_per_output_token_seconds_count"] == 4
    assert samples["kvpool:inter_token_latency_seconds_count"] == 4
    assert samples["kvpool:request_time_per_output_token_seconds_count"] == 1
    assert samples["kvpool:request_generation_tokens_sum"] == 5
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


def approx(value: float) -> object:
    return pytest.approx(value, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_each_request_histogram_counts_a_request(make_server, stream: bool) -> None:
    """Two requests of 4 and 6 tokens: sizes, counts and sums of every per-request histogram,
    and the intervals fitting together as vLLM defines them (queue + prefill + decode = e2e
    for a request finished by its last token; the gaps add up to the decode time)."""
    server = make_server(max_model_len=256)
    client = server.client()
    prompt_tokens = []
    options = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    for max_tokens in (4, 6):
        response = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=max_tokens, extra_body={"ignore_eos": True},
            **options)
        usage = list(response)[-1].usage if stream else response.usage
        assert usage.completion_tokens == max_tokens
        prompt_tokens.append(usage.prompt_tokens)
    samples = scrape(server)

    def total(name: str) -> float:
        return samples[f"kvpool:{name}_sum"]

    per_gap = {"inter_token_latency_seconds", "time_per_output_token_seconds"}
    for name in HISTOGRAMS:
        assert samples[f"kvpool:{name}_count"] == (3 + 5 if name in per_gap else 2), name
    assert total("request_prompt_tokens") == sum(prompt_tokens)
    assert total("request_generation_tokens") == 4 + 6
    assert samples["kvpool:request_generation_tokens_bucket{le=5.0}"] == 1  # 1-2-5 buckets
    assert samples["kvpool:request_generation_tokens_bucket{le=10.0}"] == 2
    assert samples["kvpool:request_prompt_tokens_bucket{le=200.0}"] == 2
    assert "kvpool:request_prompt_tokens_bucket{le=500.0}" not in samples  # past max_model_len
    phases = total("request_queue_time_seconds") + total("request_prefill_time_seconds")
    assert phases + total("request_decode_time_seconds") == approx(
        total("e2e_request_latency_seconds"))
    assert total("request_inference_time_seconds") == approx(
        total("request_prefill_time_seconds") + total("request_decode_time_seconds"))
    assert total("inter_token_latency_seconds") == approx(total("request_decode_time_seconds"))
    assert total("time_per_output_token_seconds") == total("inter_token_latency_seconds")
    assert total("time_to_first_token_seconds") == approx(
        total("request_queue_time_seconds") + total("request_prefill_time_seconds"))


def test_time_per_output_token_means_what_vllms_means(make_server) -> None:
    """vLLM's `time_per_output_token_seconds` was one sample per inter-token gap (it is now
    `inter_token_latency_seconds`); the per-request mean is
    `request_time_per_output_token_seconds`: decode time / (tokens - 1), 0 for one token."""
    server = make_server()
    client = server.client()
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                              extra_body={"ignore_eos": True})
    samples = scrape(server)
    decode = samples["kvpool:request_decode_time_seconds_sum"]
    assert samples["kvpool:time_per_output_token_seconds_count"] == 4
    assert samples["kvpool:time_per_output_token_seconds_sum"] == approx(decode)
    assert samples["kvpool:request_time_per_output_token_seconds_sum"] == approx(decode / 4)
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                              extra_body={"ignore_eos": True})
    samples = scrape(server)
    assert samples["kvpool:request_time_per_output_token_seconds_count"] == 2
    assert samples["kvpool:request_time_per_output_token_seconds_sum"] == approx(decode / 4)
    assert samples["kvpool:time_per_output_token_seconds_count"] == 4  # no gap in one token


def test_parallel_samples_are_one_request(make_server) -> None:
    """n = 2: one request, its generation tokens summed over both completions, one gap per
    engine step (not per completion)."""
    server = make_server()
    server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=2,
                                       extra_body={"ignore_eos": True})
    samples = scrape(server)
    assert samples["kvpool:request_generation_tokens_count"] == 1
    assert samples["kvpool:request_generation_tokens_sum"] == 6
    assert samples["kvpool:inter_token_latency_seconds_count"] == 2


# ------------------------------------------------------------------ who may scrape
TENANT_KEYS = ApiKeyTable.from_keys([("alice", "key-alice")])


def status(server, path: str, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.get(f"{server.base_url}{path}", headers=headers, timeout=30).status_code


def test_metrics_need_a_key_whenever_the_other_routes_do(make_server) -> None:
    server = make_server(ServerConfig(served_model_names=(MODEL,), api_keys=TENANT_KEYS))
    assert status(server, "/metrics") == status(server, "/metrics", "nope") == 401
    assert status(server, "/metrics", "key-alice") == 200
    assert status(make_server(), "/metrics") == 200  # no keys at all: nothing is guarded


def test_a_metrics_key_opens_metrics_only(make_server) -> None:
    metrics_keys = ApiKeyTable.from_keys([(METRICS_TENANT, "key-prometheus")])
    server = make_server(ServerConfig(served_model_names=(MODEL,), api_keys=TENANT_KEYS,
                                      metrics_api_keys=metrics_keys))
    assert status(server, "/metrics", "key-prometheus") == 200
    assert status(server, "/metrics", "key-alice") == 200  # tenants' keys still work
    assert status(server, "/metrics") == 401
    assert status(server, "/v1/models", "key-prometheus") == 401
    assert status(server, "/v1/kv/stats", "key-prometheus") == 401
    alone = make_server(ServerConfig(served_model_names=(MODEL,), metrics_api_keys=metrics_keys))
    assert status(alone, "/metrics") == 401  # a metrics key alone guards /metrics only
    assert status(alone, "/metrics", "key-prometheus") == 200
    assert status(alone, "/v1/models") == 200


def test_unauthenticated_metrics_open_metrics_only(make_server) -> None:
    server = make_server(ServerConfig(served_model_names=(MODEL,), api_keys=TENANT_KEYS,
                                      allow_unauthenticated_metrics=True))
    assert status(server, "/metrics") == 200
    assert status(server, "/v1/models") == 401
    with pytest.raises(ValueError, match="not both"):
        ServerConfig(metrics_api_keys=ApiKeyTable.from_keys([(METRICS_TENANT, "k")]),
                     allow_unauthenticated_metrics=True)
