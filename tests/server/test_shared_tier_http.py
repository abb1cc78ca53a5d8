"""Two real servers (replicas) over SmolLM2 and one real redis-server: a prompt completed by
one is served by the other from the shared tier, as the OpenAI usage, /metrics and
/v1/kv/stats all tell, with the same greedy completion."""

from __future__ import annotations

import pytest

from tests.server.conftest import MODEL, scrape, serve

pytestmark = pytest.mark.slow

PROMPT = ("Harbour rules: every vessel reports to the harbour office on arrival, keeps to the "
          "starboard side of the channel, and waits for the pilot at the fairway buoy. ") * 2


def complete(server) -> object:
    return server.client().completions.create(
        model=MODEL, prompt=PROMPT + "Summarise the rules:", max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True})


def test_the_second_replica_is_served_the_first_ones_prefix_from_redis(smollm2, redis_server):
    options = {"num_gpu_blocks": 64, "kv_shared_redis": redis_server.url}
    with serve(smollm2, **options) as first, serve(smollm2, **options) as second:
        cold = complete(first)
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        assert first.engine.engine.kv_tiers.shared.flush(timeout=10)  # its writes have landed
        warm = complete(second)
        assert warm.choices[0].text == cold.choices[0].text
        cached = warm.usage.prompt_tokens_details.cached_tokens
        assert cached == (cold.usage.prompt_tokens - 1) // 16 * 16 > 0
        stats = second.wait_until_idle()["kv_tiers"]
        assert stats["shared"]["is_up"] and stats["shared"]["num_loaded_blocks"] == cached // 16
        samples = scrape(second)
        assert samples["kvpool:cached_tokens_total{source=shared}"] == cached
        assert samples["kvpool:kv_shared_up"] == 1
        assert samples["kvpool:kv_shared_loaded_blocks_total"] == cached // 16
        assert samples["kvpool:kv_shared_rejected_blocks_total"] == 0
        assert scrape(first)["kvpool:kv_shared_stored_blocks_total"] > 0
