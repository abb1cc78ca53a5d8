"""Speculative decoding end to end: the same tokens as without it, whatever else is on.

Greedy output must be identical token for token; seeded sampling too (the verification
rewinds a request's stream to the draws of the tokens it kept); and a drafted step must leave
no trace in KV memory (the engine's invariants are checked after every step).
"""

from __future__ import annotations

import pytest

from kvpool.engine.sampling_params import SamplingParams
from tests.engine.conftest import PROMPTS, run_all, token_ids

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
_PASSAGE = ("The block pool cuts one reservation into fixed-size blocks. Each block holds the "
            "keys and values of sixteen tokens, and a free list hands them out in constant "
            "time. Blocks are shared between sequences by reference counts, and a shared block "
            "is copied before anyone writes into it.")
# Prompts a small instruct model answers by copying: drafts are often right.
GROUNDED = [
    f"Repeat this text exactly.\n\nText: {_PASSAGE}\n\nRepeated text: The block pool",
    f"{_PASSAGE}\n\nQuote the second sentence of the text above word for word: \"Each",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "# The same two functions again:\ndef add(a, b):",
]


def run_checked(engine, prompts, params):
    """`run_all`, asserting the engine's invariants after every step (no tentative slot
    survives a step; tables hold exactly the computed tokens)."""
    ids = [engine.add_request(prompt, p).request_id
           for prompt, p in zip(prompts, params, strict=True)]
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.check_invariants()
    return [finished[request_id] for request_id in ids]


def test_greedy_output_is_identical_token_for_token(make_engine):
    prompts = GROUNDED + PROMPTS[:6]  # batched: rows with different numbers of drafts
    params = [SamplingParams(temperature=0, max_tokens=24 + 8 * (i % 3))
              for i in range(len(prompts))]
    plain = run_checked(make_engine(), prompts, params)
    engine = make_engine(speculative_config=NGRAM)
    drafted = run_checked(engine, prompts, params)
    assert token_ids(drafted) == token_ids(plain)
    assert [o.outputs[0].text for o in drafted] == [o.outputs[0].text for o in plain]
    stats = engine.stats()
    assert stats.spec_decode.num_accepted_tokens > 0 and stats.num_steps < plain_steps(plain)
    assert stats.num_generated_tokens == sum(len(ids) for ids in token_ids(plain))


def plain_steps(outputs) -> int:
    """Steps a non-speculative run needs at least: one per token of the longest output."""
    return max(len(output.outputs[0].token_ids) for output in outputs)


def test_seeded_sampling_is_identical_with_and_without_speculation(make_engine):
    params = [SamplingParams(temperature=0.7, top_p=0.95, seed=100 + i, max_tokens=32)
              for i in range(len(GROUNDED))]
    plain = run_all(make_engine(), GROUNDED, params)
    engine = make_engine(speculative_config=NGRAM)
    drafted = run_all(engine, GROUNDED, params)
    assert token_ids(drafted) == token_ids(plain)
    assert engine.stats().spec_decode.num_drafts > 0


@pytest.mark.parametrize("options", [
    {"enable_prefix_caching": True},
    {"kv_cache_dtype": "int8"},
    {"max_num_batched_tokens": 64},  # chunked prefill: prompts arrive over several steps
])
def test_exact_with_other_features(make_engine, options):
    params = SamplingParams(temperature=0, max_tokens=24)
    prompts = GROUNDED + GROUNDED[:1]  # the repeat hits the prefix cache when it is on
    plain = run_checked(make_engine(**options), prompts, [params] * len(prompts))
    drafted = run_checked(make_engine(speculative_config=NGRAM, **options), prompts,
                          [params] * len(prompts))
    assert token_ids(drafted) == token_ids(plain)


def test_stop_strings_max_tokens_and_logprobs_of_accepted_tokens(make_engine):
    params = [SamplingParams(temperature=0, max_tokens=7, logprobs=2),
              SamplingParams(temperature=0, max_tokens=40, stop=["values"], logprobs=1)]
    prompts = GROUNDED[:2]
    plain = run_checked(make_engine(), prompts, params)
    drafted = run_checked(make_engine(speculative_config=NGRAM), prompts, params)
    for got, want in zip(drafted, plain, strict=True):
        got, want = got.outputs[0], want.outputs[0]
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.finish_reason == want.finish_reason and got.stop_reason == want.stop_reason
        assert [sorted(entry) for entry in got.logprobs] == [sorted(e) for e in want.logprobs]
        for entry, wanted in zip(got.logprobs, want.logprobs, strict=True):
            for token_id, logprob in entry.items():
                assert logprob.logprob == pytest.approx(wanted[token_id].logprob, abs=1e-4)
    assert len(drafted[0].outputs[0].token_ids) == 7


def test_n_completions_and_preemption(make_engine):
    """n > 1 forks draft each on their own; a pool too small for everyone preempts (drafts
    never preempt: they take free blocks only, or nothing)."""
    params = [SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=60, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)]
    prompts = GROUNDED[:2]
    for preemption_mode, swap_space in (("recompute", 0), ("swap", 0.1)):
        options = {"num_gpu_blocks": 16, "block_size": 16,
                   "preemption_mode": preemption_mode, "swap_space": swap_space}
        plain = run_checked(make_engine(**options), prompts, params)
        engine = make_engine(speculative_config=NGRAM, **options)
        drafted = run_checked(engine, prompts, params)
        assert [[c.token_ids for c in o.outputs] for o in drafted] == \
            [[c.token_ids for c in o.outputs] for o in plain]
        assert engine.stats().num_preemptions > 0


def test_tentative_blocks_are_traced_and_never_published(make_engine, tmp_path):
    """The trace shows drafts' blocks ("d": 1); a block dropped with rejected drafts goes
    straight back to the free list, never into the prefix cache."""
    import json

    trace = tmp_path / "trace.jsonl"
    engine = make_engine(speculative_config=NGRAM, kv_trace=str(trace), block_size=4)
    cached_before = engine.memory_stats().num_cached_blocks
    run_checked(engine, GROUNDED[:1], [SamplingParams(temperature=0, max_tokens=40)])
    engine.close()
    events = [json.loads(line) for line in trace.read_text().splitlines()[1:]]
    drafted = {b for e in events if e["e"] == "alloc" and e.get("d") for b in e["b"]}
    dropped = {b for e in events if e["e"] == "free" and e.get("d") for b in e["b"]}
    assert drafted and dropped <= drafted
    stats = engine.memory_stats()
    num_tokens = len(engine.tokenizer.encode(GROUNDED[0])) + 40
    # Only the committed tokens' full blocks were published.
    assert stats.num_cached_blocks - cached_before <= num_tokens // 4


# ------------------------------------------------------------ suffix decoding
SUFFIX = {"method": "suffix", "num_speculative_tokens": 5}
_CHAT = "Once upon a time"  # nothing in the prompt to copy


def test_suffix_decoding_drafts_from_the_tenants_earlier_answers(make_engine):
    params = SamplingParams(temperature=0, max_tokens=32)
    engine = make_engine(speculative_config=SUFFIX)
    first = run_checked(engine, [_CHAT], [params])
    before = engine.stats().spec_decode.num_accepted_tokens
    again = run_checked(engine, [_CHAT], [params])
    gained = engine.stats().spec_decode.num_accepted_tokens - before
    assert token_ids(again) == token_ids(first) == token_ids(run_checked(make_engine(),
                                                                         [_CHAT], [params]))
    assert gained >= 20  # the second answer came almost whole from the first one's


def test_suffix_decoding_never_drafts_from_another_tenants_answers(make_engine):
    params = SamplingParams(temperature=0, max_tokens=32)
    engine = make_engine(speculative_config=SUFFIX)
    engine.add_request(_CHAT, params, cache_salt="tenant-a")
    while engine.has_unfinished_requests():
        engine.step()
    before = engine.stats().spec_decode.num_accepted_tokens
    engine.add_request(_CHAT, params, cache_salt="tenant-b")
    while engine.has_unfinished_requests():
        engine.step()
    # Only tenant b's own context could draft; with nothing to copy it gains little, against
    # the ~30 tokens tenant a's answer would give.
    assert engine.stats().spec_decode.num_accepted_tokens - before < 10


def test_suffix_decoding_gives_the_same_tokens_on_grounded_batches(make_engine):
    prompts = GROUNDED + PROMPTS[:4]
    params = [SamplingParams(temperature=0, max_tokens=24) for _ in prompts]
    plain = run_checked(make_engine(), prompts, params)
    drafted = run_checked(make_engine(speculative_config=SUFFIX), prompts, params)
    assert token_ids(drafted) == token_ids(plain)


def test_a_one_token_prompt_chunk_never_drafts(make_engine):
    # A prompt's last chunk of one token looks like a decode (one new token) but computes
    # the prompt: drafts follow only sequences that already have outputs.
    prompt = {"prompt_token_ids": [1]}
    params = [SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1)]
    plain = run_checked(make_engine(), [prompt], params)
    engine = make_engine(speculative_config=NGRAM)
    proposed = []
    propose = engine.scheduler.speculator.proposer.propose

    def spy(seq, k):
        proposed.append(len(seq.output_token_ids))
        return propose(seq, k)

    engine.scheduler.speculator.proposer.propose = spy
    drafted = run_checked(engine, [prompt], params)
    assert token_ids(drafted) == token_ids(plain)
    assert drafted[0].prompt_logprobs == plain[0].prompt_logprobs
    assert proposed and 0 not in proposed
