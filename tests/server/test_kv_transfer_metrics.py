"""`/metrics` of a KV producer and a KV consumer (`LoopbackConnector`, two servers in one
process): one handover counted exactly on both sides (blocks, bytes, the load histogram,
leases granted and released), a handover of another prompt counted as a "prompt" failure
while the answer stays the one computed without it, and no transfer metric on a server
without a connector."""

from __future__ import annotations

from typing import Any

from kvpool.engine.kv_connector.errors import FAILURE_REASONS
from kvpool.engine.kv_connector.stats import LOAD_SECONDS_BUCKETS
from kvpool.engine.sampling_params import SamplingParams
from tests.engine.kv_connector.loopback_pair import (
    CONSUMER,
    NUM_HANDED_OVER,
    PRODUCER,
    PROMPT,
)
from tests.server.conftest import MODEL, RunningServer, offline_generate, scrape

MAX_TOKENS = 8


def complete(server: RunningServer, max_tokens: int,
             kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """A greedy /v1/completions of PROMPT carrying `kv_transfer_params`."""
    with server.http() as http:
        response = http.post("/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "kv_transfer_params": kv_transfer_params})
    response.raise_for_status()
    return response.json()


def hand_over(producer: RunningServer) -> dict[str, Any]:
    """Prefill PROMPT on the producer; the handover its answer carries."""
    handover = complete(producer, 1, {"do_remote_decode": True})["kv_transfer_params"]
    assert len(handover["remote_block_ids"]) == NUM_HANDED_OVER
    return handover


def transfer_samples(server: RunningServer) -> dict[str, float]:
    return {name: value for name, value in scrape(server).items()
            if name.startswith("kvpool:kv_transfer_")}


def test_one_handover_is_counted_exactly_on_both_sides(make_server) -> None:
    producer = make_server(kv_transfer_config=PRODUCER)
    consumer = make_server(kv_transfer_config=CONSUMER)
    handover = hand_over(producer)
    live = transfer_samples(producer)
    assert live["kvpool:kv_transfer_live_leases"] == 1
    assert live["kvpool:kv_transfer_leased_blocks"] == NUM_HANDED_OVER

    answer = complete(consumer, MAX_TOKENS, handover)
    block_size = producer.engine.engine.kv_memory.layout.block_size
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == (
        NUM_HANDED_OVER * block_size)  # the loaded blocks served as a prefix hit
    producer.wait_until_idle()  # its idle loop ticks: the released lease ends
    sent, received = transfer_samples(producer), transfer_samples(consumer)
    num_bytes = NUM_HANDED_OVER * producer.engine.engine.kv_memory.layout.bytes_per_block
    assert sent["kvpool:kv_transfer_blocks_total{direction=sent}"] == NUM_HANDED_OVER
    assert received["kvpool:kv_transfer_blocks_total{direction=received}"] == NUM_HANDED_OVER
    assert sent["kvpool:kv_transfer_bytes_total{direction=sent}"] == num_bytes
    assert received["kvpool:kv_transfer_bytes_total{direction=received}"] == num_bytes
    assert sent["kvpool:kv_transfer_blocks_total{direction=received}"] == 0
    assert received["kvpool:kv_transfer_blocks_total{direction=sent}"] == 0
    assert [sent[f"kvpool:kv_transfer_leases_total{{outcome={outcome}}}"]
            for outcome in ("granted", "released", "expired")] == [1, 1, 0]
    assert sent["kvpool:kv_transfer_live_leases"] == sent["kvpool:kv_transfer_leased_blocks"] == 0
    assert received["kvpool:kv_transfer_seconds_count"] == 1
    assert received["kvpool:kv_transfer_seconds_bucket{le=+Inf}"] == 1
    assert received["kvpool:kv_transfer_seconds_sum"] > 0
    buckets = [value for name, value in received.items()
               if name.startswith("kvpool:kv_transfer_seconds_bucket")]
    assert buckets == sorted(buckets)  # cumulative
    assert len(buckets) == len(LOAD_SECONDS_BUCKETS) + 1  # and +Inf
    assert sent["kvpool:kv_transfer_seconds_count"] == 0
    for samples in (sent, received):
        assert {reason: samples[f"kvpool:kv_transfer_failures_total{{reason={reason}}}"]
                for reason in FAILURE_REASONS} == dict.fromkeys(FAILURE_REASONS, 0)
        assert samples["kvpool:kv_transfer_loads_in_flight"] == 0


def test_a_handover_of_another_prompt_fails_as_prompt_and_is_recomputed(
        make_server, fast_model) -> None:
    producer = make_server(kv_transfer_config=PRODUCER)
    consumer = make_server(kv_transfer_config=CONSUMER)
    handover = {**hand_over(producer), "remote_token_digest": "0" * 32}
    answer = complete(consumer, MAX_TOKENS, handover)  # policy "recompute", the default
    reference = offline_generate(fast_model, PROMPT, SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert answer["choices"][0]["text"] == reference.outputs[0].text
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    received = transfer_samples(consumer)
    assert {reason: received[f"kvpool:kv_transfer_failures_total{{reason={reason}}}"]
            for reason in FAILURE_REASONS} == {**dict.fromkeys(FAILURE_REASONS, 0), "prompt": 1}
    assert received["kvpool:kv_transfer_blocks_total{direction=received}"] == 0
    assert received["kvpool:kv_transfer_seconds_count"] == 0
    producer.wait_until_idle()  # the consumer gave the lease back unread
    sent = transfer_samples(producer)
    assert [sent[f"kvpool:kv_transfer_leases_total{{outcome={outcome}}}"]
            for outcome in ("granted", "released", "expired")] == [1, 1, 0]
    assert sent["kvpool:kv_transfer_live_leases"] == 0


def test_a_server_without_a_connector_exports_no_transfer_metrics(make_server) -> None:
    assert transfer_samples(make_server()) == {}
