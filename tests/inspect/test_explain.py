"""`explain_prompt` and `explain_from_snapshot` on a real SmolLM2 engine: exact verdicts per
block for hits, a shared first block, another salt, evictions (lost, or spilled to the host
tier), a block-aligned prompt and a partial tail; the snapshot agrees with the live engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import LLMEngine
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.setup import build_engine_parts
from kvpool.inspect.explain import (
    AFTER_MISS,
    EVICTED,
    HIT,
    HOST,
    NEVER_SEEN,
    PARTIAL,
    SALT_DIFFERS,
    PrefixExplanation,
    _classify,
    _explain,
    _Lookup,
    explain_from_snapshot,
    explain_prompt,
)

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def prompt(first: int, num_tokens: int) -> list[int]:
    """`num_tokens` distinct token ids from `first` on (distinct prompts never share blocks)."""
    return list(range(first, first + num_tokens))


def run(engine: LLMEngine, token_ids: list[int], cache_salt: str | None = None) -> None:
    engine.add_request({"prompt_token_ids": token_ids}, ONE_TOKEN, cache_salt=cache_salt)
    while engine.has_unfinished_requests():
        engine.step()


def verdicts(explanation: PrefixExplanation) -> list[str]:
    return [verdict.verdict for verdict in explanation.verdicts]


def new_engine(smollm2, **options) -> LLMEngine:
    config = EngineConfig(enable_warmup=False, **options)
    return LLMEngine(config, build_engine_parts(config, smollm2))


@pytest.fixture(scope="module")
def engine(smollm2) -> Iterator[LLMEngine]:
    """One roomy engine for the module; each test uses prompts of its own token range."""
    engine = new_engine(smollm2, num_gpu_blocks=64)
    yield engine
    engine.close()


def test_the_same_prompt_hits_every_full_block_and_never_the_partial_tail(engine) -> None:
    tokens = prompt(1000, 57)
    run(engine, tokens)
    explanation = explain_prompt(engine, tokens, None)
    assert verdicts(explanation) == [HIT, HIT, HIT, PARTIAL]
    assert explanation.num_hit_tokens == 48 and explanation.num_prompt_tokens == 57
    assert explanation.verdicts[-1].num_tokens == 9 and explanation.verdicts[-1].short_hash is None
    assert explanation.summary.startswith("48 of 57 prompt tokens would be served from cache")
    assert "the last 9 tokens fill a partial block" in explanation.summary
    assert PrefixExplanation.from_json(explanation.to_json()) == explanation


def test_a_prompt_sharing_only_its_first_block_misses_from_the_second(engine) -> None:
    tokens = prompt(2000, 57)
    run(engine, tokens)
    other = tokens[:16] + prompt(2100, 41)
    explanation = explain_prompt(engine, other, None)
    assert verdicts(explanation) == [HIT, NEVER_SEEN, AFTER_MISS, PARTIAL]
    assert explanation.num_hit_tokens == 16
    assert "block 1 (tokens 16-31) was never cached" in explanation.summary
    assert "after it cannot hit" in explanation.summary


def test_another_salt_is_named_only_when_the_caller_may_know(engine) -> None:
    tokens = prompt(3000, 40)
    run(engine, tokens, cache_salt="acme")
    assert verdicts(explain_prompt(engine, tokens, "acme")) == [HIT, HIT, PARTIAL]
    hidden = explain_prompt(engine, tokens, "globex")
    assert verdicts(hidden) == [NEVER_SEEN, AFTER_MISS, PARTIAL]
    assert "salt" not in hidden.summary.replace("under this salt", "")
    revealed = explain_prompt(engine, tokens, "globex", reveal_other_salts=True)
    assert verdicts(revealed) == [SALT_DIFFERS, AFTER_MISS, PARTIAL]
    assert "another salt" in revealed.summary
    assert verdicts(explain_prompt(engine, tokens, None, reveal_other_salts=True))[0] == (
        SALT_DIFFERS)  # no salt differs from every salt


def test_a_block_aligned_prompt_computes_its_last_block_although_cached(engine) -> None:
    tokens = prompt(4000, 48)
    run(engine, tokens)
    explanation = explain_prompt(engine, tokens, None)
    assert verdicts(explanation) == [HIT, HIT, HIT]
    assert explanation.num_hit_tokens == 32  # the lookup stops one token short
    assert "block 2 is cached but computed anyway" in explanation.summary
    short = explain_prompt(engine, prompt(4000, 9), None)
    assert verdicts(short) == [PARTIAL] and short.num_hit_tokens == 0


def test_the_snapshot_agrees_with_the_live_engine(engine) -> None:
    shared = prompt(8000, 57)
    run(engine, shared)
    run(engine, prompt(8100, 40), cache_salt="acme")
    cases = [(shared, None), (shared[:16] + prompt(8200, 41), None), (shared, "acme"),
             (prompt(8100, 40), "acme"), (prompt(8100, 40), "globex"), (shared[:48], None),
             (prompt(8300, 30), None)]
    snapshot = engine.kv_snapshot()
    for tokens, salt in cases:
        live = explain_prompt(engine, tokens, salt)
        offline = explain_from_snapshot(snapshot, tokens, salt)
        assert verdicts(offline) == verdicts(live), (tokens[0], salt)
        assert offline.num_hit_tokens == live.num_hit_tokens
        assert [v.short_hash for v in offline.verdicts] == [v.short_hash for v in live.verdicts]


def test_blocks_past_the_miss_still_cached_and_a_device_block_after_a_reload() -> None:
    """The core's walk on a made-up cache: it never returns to the device after a reload."""
    tiers = {0: {"device"}, 1: {"host"}, 2: {"device"}, 3: {"host", "disk"}}
    lookup = _Lookup(lambda index: tiers[index], lambda index: (NEVER_SEEN, None))
    walked = _classify(64, 16, ["a", "b", "c", "d"], lookup)
    assert [v.verdict for v in walked] == [HIT, HOST, NEVER_SEEN, AFTER_MISS]
    assert [v.still_cached for v in walked] == [None, None, "device", "host"]
    explanation = _explain(list(range(70)), 16, ["a", "b", "c", "d"], lookup)
    assert explanation.num_hit_tokens == 32
    assert "1 of them still cached, unreachable" in explanation.summary
    assert "does not return to the device" in explanation.summary


def test_an_evicted_block_is_told_from_one_never_seen(smollm2) -> None:
    engine = new_engine(smollm2, num_gpu_blocks=6)  # 96 token slots
    try:
        tokens = prompt(6000, 57)
        run(engine, tokens)  # 3 cached blocks, freed tail first: block 2 is evicted first
        run(engine, prompt(7000, 70))  # 5 blocks: 3 fresh, 2 evicted
        explanation = explain_prompt(engine, tokens, None)
        assert verdicts(explanation) == [HIT, EVICTED, AFTER_MISS, PARTIAL]
        assert explanation.verdicts[1].evictions_ago == 1
        assert "block 1 (tokens 16-31) was evicted 1 eviction(s) ago" in explanation.summary
        offline = explain_from_snapshot(engine.kv_snapshot(), tokens, None)
        assert verdicts(offline) == verdicts(explanation)
        assert offline.verdicts[1].evictions_ago == 1
    finally:
        engine.close()


def test_blocks_spilled_to_the_host_tier_are_reloads(smollm2) -> None:
    engine = new_engine(smollm2, num_gpu_blocks=6, swap_space=0.01)
    try:
        tokens = prompt(6000, 57)
        run(engine, tokens)
        run(engine, prompt(7000, 70))  # evicts blocks 2 and 1 to the host tier
        explanation = explain_prompt(engine, tokens, None)
        assert verdicts(explanation) == [HIT, HOST, HOST, PARTIAL]
        assert explanation.num_hit_tokens == 48
        assert "(16 from the device, 32 from the host tier)" in explanation.summary
        offline = explain_from_snapshot(engine.kv_snapshot(), tokens, None)
        assert verdicts(offline) == verdicts(explanation)
    finally:
        engine.close()
