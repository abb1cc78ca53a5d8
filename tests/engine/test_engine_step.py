"""The step as a whole on the real model: a failed step is rolled back, outputs come in the kind
each request asks for, forks respect max_num_seqs, and bad salts or temperatures are handled."""

from __future__ import annotations

import dataclasses

import pytest

from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.sampling_params import RequestOutputKind, SamplingParams
from tests.engine.conftest import PROMPTS, fail_once, run_all, token_ids

SMALL = {"kv_cache_memory": 32 * 2**20, "max_model_len": 1024}
LONG_GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def test_a_failed_step_is_rolled_back_and_never_poisons_the_prefix_cache(make_engine):
    reference_engine = make_engine(**SMALL)
    prompt = PROMPTS[8]  # ~90 tokens: decodes cross several block boundaries
    expected = token_ids(run_all(reference_engine, [prompt], LONG_GREEDY))[0]
    engine = make_engine(**SMALL)
    request = engine.add_request(prompt, LONG_GREEDY)
    for _ in range(12):  # prefill, then eleven decodes
        engine.step()
    fail_once(engine.runner, "execute", "the device fell over")
    with pytest.raises(RuntimeError, match="fell over"):
        engine.step()
    # No slot reserved for the failed step survives: every table holds its computed tokens.
    engine.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
    assert request.sequences[0].output_token_ids == expected
    # The blocks cached along the way hold the KV of the tokens their hashes name: a prompt
    # made of this sequence's tokens continues exactly as a fresh engine continues it.
    follow_up = {"prompt_token_ids": request.prompt_token_ids + expected[:20]}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (output,) = run_all(engine, [follow_up], params)
    assert output.num_cached_tokens > 0
    assert output.outputs[0].token_ids == token_ids(run_all(reference_engine, [follow_up],
                                                            params))[0]


@pytest.mark.parametrize("n", [1, 3])
def test_delta_outputs_add_up_to_the_cumulative_ones(make_engine, n):
    engine = make_engine(**SMALL)
    base = dict(n=n, temperature=0.8, seed=5, max_tokens=24, logprobs=2, stop=["\n\n"])
    outputs = {}
    for kind in RequestOutputKind:
        params = SamplingParams(**base, output_kind=kind)
        request = engine.add_request(PROMPTS[1], params, request_id=kind.name)
        seen = []
        while engine.has_unfinished_requests():
            seen += [o for o in engine.step() if o.request_id == request.request_id]
        outputs[kind] = seen
    final = outputs[RequestOutputKind.CUMULATIVE][-1]
    assert len(outputs[RequestOutputKind.FINAL_ONLY]) == 1
    assert outputs[RequestOutputKind.FINAL_ONLY][0].outputs == final.outputs
    deltas = outputs[RequestOutputKind.DELTA]
    assert len(deltas) == len(outputs[RequestOutputKind.CUMULATIVE]) > 1
    for completion in final.outputs:
        pieces = [c for o in deltas for c in o.outputs if c.index == completion.index]
        assert "".join(c.text for c in pieces) == completion.text
        assert [t for c in pieces for t in c.token_ids] == completion.token_ids
        assert [e for c in pieces for e in c.logprobs] == completion.logprobs
        assert pieces[-1].finish_reason == completion.finish_reason
        assert pieces[-1].cumulative_logprob == pytest.approx(completion.cumulative_logprob)


def test_forks_never_push_the_running_sequences_past_max_num_seqs(make_engine):
    engine = make_engine(max_num_seqs=4, **SMALL)
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=6, ignore_eos=True)
    engine.add_request(PROMPTS[0], dataclasses.replace(params, n=3))
    for prompt in PROMPTS[1:4]:
        engine.add_request(prompt, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 4


def test_a_tiny_temperature_decodes_greedily(make_engine):
    engine = make_engine(**SMALL)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tiny = SamplingParams(temperature=1e-40, max_tokens=8, ignore_eos=True)
    assert token_ids(run_all(engine, PROMPTS[:2], tiny)) == token_ids(
        run_all(engine, PROMPTS[:2], greedy))


def test_a_cache_salt_that_is_not_text_is_refused_by_name(make_engine):
    engine = make_engine(**SMALL)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("Hello", cache_salt="tenant\ud800")
    assert info.value.param == "cache_salt" and "\ud800" not in str(info.value)
    assert not engine.has_unfinished_requests()
