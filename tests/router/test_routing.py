"""Routing decisions over real replicas: a chat's next turn goes to the replica that served
its first (the conversation so far is a prefix of the next prompt), counted as a prefix choice
with the tokens it matched; under `--policy round-robin` the same turns alternate instead."""

from __future__ import annotations

from tests.router.conftest import start_router, wait_for_blocks
from tests.server.conftest import MODEL

FIRST_TURN = [{"role": "user", "content": "Name three rivers in Europe and say where each "
                                          "one begins and ends, please."}]


def next_turn(reply: str) -> list[dict[str, str]]:
    return [*FIRST_TURN, {"role": "assistant", "content": reply},
            {"role": "user", "content": "Which of them is the longest?"}]


def test_a_chats_next_turn_lands_where_its_first_did(make_replica, fast_model) -> None:
    replicas = [make_replica(), make_replica()]
    with start_router([replica.base_url for replica in replicas],
                      fast_model.tokenizer) as router:
        client = router.client()
        first = client.chat.completions.create(model=MODEL, messages=FIRST_TURN,
                                               max_tokens=8, temperature=0)
        [(served, reason)] = router.decisions()
        assert reason == "load"
        wait_for_blocks(router, served, first.usage.prompt_tokens // 16)
        second = client.chat.completions.create(
            model=MODEL, messages=next_turn(first.choices[0].message.content), max_tokens=8,
            temperature=0, stream=True, stream_options={"include_usage": True})
        *_, last = second
        num_full_block_tokens = 16 * (first.usage.prompt_tokens // 16)
        cached = last.usage.prompt_tokens_details.cached_tokens
        assert router.decisions() == {(served, "load"): 1, (served, "prefix"): 1}
        matched = router.metrics()["kvpool_router_prefix_matched_tokens_total"]
        assert num_full_block_tokens <= matched <= cached  # the replica may know more


def test_round_robin_alternates_whatever_the_prefix(make_replica, fast_model) -> None:
    replicas = [make_replica(), make_replica()]
    urls = [replica.base_url for replica in replicas]
    with start_router(urls, fast_model.tokenizer, policy="round-robin") as router:
        client = router.client()
        first = client.chat.completions.create(model=MODEL, messages=FIRST_TURN,
                                               max_tokens=8, temperature=0)
        second = client.chat.completions.create(
            model=MODEL, messages=next_turn(first.choices[0].message.content), max_tokens=8,
            temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens == 0
        assert router.decisions() == {(urls[0], "round_robin"): 1,
                                      (urls[1], "round_robin"): 1}
        assert router.metrics()["kvpool_router_prompt_tokens_total"] == 0  # never hashed
