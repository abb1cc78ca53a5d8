"""Request-level behaviour: parallel sampling, aborts, bad requests, stopping rules, logprobs."""

from __future__ import annotations

import math

import pytest

from kvpool.engine.sampling_params import SamplingParams
from tests.engine.conftest import GREEDY, PROMPTS, run_all, token_ids

SMALL = {"kv_cache_memory": 32 * 2**20, "max_model_len": 1024}


def test_parallel_sampling_shares_the_prompt_blocks(make_engine):
    engine = make_engine(**SMALL)
    prompt = PROMPTS[5]  # ~250 tokens: many full blocks and a partial last block
    params = SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True)
    request = engine.add_request(prompt, params)
    num_prompt_tokens = len(request.prompt_token_ids)
    engine.step()  # the whole prompt fits one step: prefill, fork, first tokens
    assert len(request.sequences) == 4
    prompt_blocks = -(-num_prompt_tokens // 16)
    # forked, not copied: four sequences hold one set of prompt blocks
    assert engine.memory_stats().num_used_blocks == prompt_blocks
    engine.step()  # each child writes its first token: copy-on-write of the partial last block
    full_blocks = num_prompt_tokens // 16
    assert engine.memory_stats().num_used_blocks == full_blocks + 4
    while engine.has_unfinished_requests():
        engine.step()


def test_parallel_sampling_differs_yet_is_reproducible_with_a_seed(make_engine):
    engine = make_engine(**SMALL)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    first = run_all(engine, ["Tell me a story about a dragon."], params)[0]
    second = run_all(engine, ["Tell me a story about a dragon."], params)[0]
    texts = [completion.token_ids for completion in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert len({tuple(t) for t in texts}) > 1, "four samples at temperature 1 all agreed"
    assert [c.token_ids for c in second.outputs] == texts


def test_seeded_request_is_reproducible_inside_any_batch(make_engine):
    engine = make_engine(**SMALL)
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=3, ignore_eos=True)
    alone = run_all(engine, [PROMPTS[0]], params)[0].outputs[0].token_ids
    mixed = run_all(engine, [PROMPTS[1], PROMPTS[0], PROMPTS[2]], [GREEDY, params, GREEDY])
    assert mixed[1].outputs[0].token_ids == alone


@pytest.mark.parametrize("steps_before_abort", [0, 1, 4])
def test_abort_returns_blocks_at_once(make_engine, steps_before_abort):
    # chunks of 64 tokens: one step in, the long prompt is still mid-prefill; four in, decoding
    engine = make_engine(max_num_batched_tokens=64, **SMALL)
    long_request = engine.add_request(PROMPTS[11], GREEDY)
    other = engine.add_request(PROMPTS[0], GREEDY)
    for _ in range(steps_before_abort):
        engine.step()
    output = engine.abort_request(long_request.request_id)
    assert output is not None and output.finished
    assert output.outputs[0].finish_reason == "abort"
    assert all(len(seq.block_table.block_ids) == 0 for seq in long_request.sequences)
    assert engine.abort_request(long_request.request_id) is None
    while engine.has_unfinished_requests():
        engine.step()
    assert len(other.sequences[0].output_token_ids) == 16


def test_bad_requests_fail_clearly_and_do_not_disturb_others(make_engine):
    engine = make_engine(num_gpu_blocks=8, max_model_len=512, enable_prefix_caching=False)
    good = engine.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="max_model_len is 512"):
        engine.add_request([1] * 600, GREEDY)
    with pytest.raises(ValueError, match="whole KV pool holds only 128 tokens"):
        engine.add_request([1] * 200, GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", GREEDY, request_id=good.request_id)
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.add_request([10**9], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        engine.add_request("x", SamplingParams(logprobs=10**6))
    with pytest.raises(ValueError, match="stop_token_ids must be in"):
        engine.add_request("x", SamplingParams(stop_token_ids=[10**6]))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(good.sequences[0].output_token_ids) == 16


def test_a_sequence_that_outgrows_the_whole_pool_stops_with_length(make_engine):
    engine = make_engine(num_gpu_blocks=4, enable_prefix_caching=False)
    output = run_all(engine, ["Hi"], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    completion = output[0].outputs[0]
    assert completion.finish_reason == "length"
    # 64 slots hold the KV of 64 tokens; the 65th was sampled from the last step's logits
    assert len(output[0].prompt_token_ids) + len(completion.token_ids) == 4 * 16 + 1


def test_max_tokens_and_ignore_eos(make_engine):
    engine = make_engine(**SMALL)
    capped = run_all(engine, [PROMPTS[4]], SamplingParams(temperature=0, max_tokens=5))[0]
    assert len(capped.outputs[0].token_ids) == 5 and capped.outputs[0].finish_reason == "length"
    eos_prompt = PROMPTS[5]  # greedy decoding of this prompt emits EOS at once
    stopped = run_all(engine, [eos_prompt], SamplingParams(temperature=0, max_tokens=8))[0]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason is None
    assert stopped.outputs[0].token_ids[-1] in engine.eos_token_ids
    ignoring = run_all(
        engine, [eos_prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )[0]
    assert len(ignoring.outputs[0].token_ids) == 8


def test_min_tokens_bans_eos_until_reached(make_engine):
    engine = make_engine(**SMALL)
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=6)
    output = run_all(engine, [PROMPTS[5]], params)[0].outputs[0]
    assert len(output.token_ids) >= 6
    assert not set(output.token_ids[:5]) & engine.eos_token_ids


def test_stop_token_ids_end_the_sequence(make_engine, reference_greedy):
    engine = make_engine(**SMALL)
    expected = reference_greedy[0]
    stop_id = expected[3]
    params = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id])
    output = run_all(engine, [PROMPTS[0]], params)[0].outputs[0]
    assert output.token_ids == expected[: expected.index(stop_id) + 1]
    assert output.finish_reason == "stop" and output.stop_reason == stop_id


def test_stop_strings_cut_the_text_even_across_tokens(make_engine, smollm2, reference_greedy):
    engine = make_engine(**SMALL)
    tokenizer = smollm2.tokenizer
    full_text = tokenizer.decode(reference_greedy[0], skip_special_tokens=True)
    # a stop string that starts inside one token and ends inside a later one
    pieces = [tokenizer.decode([t]) for t in reference_greedy[0]]
    boundary = len(pieces[0]) + len(pieces[1])
    stop = full_text[boundary - 2 : boundary + 3]
    params = SamplingParams(temperature=0, max_tokens=16, stop=[stop, "never appears"])
    output = run_all(engine, [PROMPTS[0]], params)[0].outputs[0]
    assert output.text == full_text[: full_text.index(stop)]
    assert stop not in output.text and output.stop_reason == stop
    assert output.finish_reason == "stop"


def test_logprobs_are_top_k_of_the_raw_distribution(make_engine, reference_greedy):
    engine = make_engine(**SMALL)
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    output = run_all(engine, [PROMPTS[0]], params)[0].outputs[0]
    assert output.token_ids == reference_greedy[0][:4]
    assert output.logprobs is not None and len(output.logprobs) == 4
    for token_id, entry in zip(output.token_ids, output.logprobs, strict=True):
        assert entry[token_id].rank == 1  # greedy picks the most likely token
        ranks = sorted(logprob.rank for logprob in entry.values())
        assert ranks == [1, 2, 3]
        assert all(logprob.logprob <= 0 for logprob in entry.values())
        assert all(logprob.decoded_token is not None for logprob in entry.values())
    assert output.cumulative_logprob == pytest.approx(
        sum(entry[t].logprob for entry, t in zip(output.logprobs, output.token_ids, strict=True))
    )
    assert math.isfinite(output.cumulative_logprob)


@pytest.fixture(scope="module")
def reference_greedy(smollm2):
    from kvpool.engine.config import EngineConfig
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.setup import build_engine_parts

    config = EngineConfig(kv_cache_memory=32 * 2**20)
    engine = LLMEngine(config, build_engine_parts(config, smollm2))
    return token_ids(run_all(engine, PROMPTS[:1]))
