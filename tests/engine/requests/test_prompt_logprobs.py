"""Prompt logprobs on the real SmolLM2 agree with transformers' log_softmax of its logits:
through chunked prefill, next to other requests, past a prefix-cache hit and a preemption.

Entry i of a prompt's list is token i's log probability given the tokens before it (the
logits at position i - 1), the first None. Measured prefill logits differ from transformers by
~4e-5 in float32 (tests/model/test_llama_vs_transformers.py); log probabilities get at most
twice that, so 2e-3 is a loose bound that still catches a wrong row (an off-by-one position
moves them by whole units).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.sampling_params import RequestOutputKind, SamplingParams
from tests.engine.conftest import PROMPTS, run_all

LOGPROB_ATOL = 2e-3
NUM_TOP = 5
WITH_PROMPT_LOGPROBS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                      prompt_logprobs=NUM_TOP)
PLAIN = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_logprobs(hf_smollm2):
    """Prompt token ids -> log_softmax of transformers' logits at every position (fp32, the
    suite-wide reference model). # [num_tokens, vocab]"""

    def logprobs(token_ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return hf_smollm2(torch.tensor([token_ids])).logits[0].float().log_softmax(dim=-1)

    return logprobs


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """One intra-op thread (see tests/model/conftest.py: faster on a shared 2-core machine)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def assert_matches_reference(prompt_logprobs, token_ids, reference, tokenizer) -> None:
    """Every entry agrees with the reference: the prompt token's log probability, rank and
    decoded text, and the top tokens (near-equal reference values may swap ranks)."""
    assert len(prompt_logprobs) == len(token_ids) and prompt_logprobs[0] is None
    for position, (entry, token_id) in enumerate(zip(prompt_logprobs[1:], token_ids[1:],
                                                     strict=True)):
        row = reference[position]  # the logits at position i - 1 give entry i
        expected = float(row[token_id])
        assert entry[token_id].logprob == pytest.approx(expected, abs=LOGPROB_ATOL)
        assert entry[token_id].decoded_token == tokenizer.decode([token_id])
        top_values = row.topk(NUM_TOP).values.tolist()
        by_rank = {e.rank: (top_id, e) for top_id, e in entry.items() if e.rank <= NUM_TOP}
        assert sorted(by_rank) == list(range(1, NUM_TOP + 1)), f"position {position}"
        for rank, (top_id, top) in by_rank.items():
            assert top.logprob == pytest.approx(top_values[rank - 1], abs=LOGPROB_ATOL)
            assert float(row[top_id]) == pytest.approx(top_values[rank - 1], abs=LOGPROB_ATOL)
        lowest = int((row > expected + LOGPROB_ATOL).sum()) + 1  # near-ties either way
        highest = int((row > expected - LOGPROB_ATOL).sum()) + 1
        assert lowest <= entry[token_id].rank <= highest, f"position {position}"


def test_chunked_prompts_next_to_other_requests_match_transformers(make_engine, smollm2,
                                                                   hf_logprobs):
    # 48 tokens a step: the long prompts prefill over several chunks while others decode.
    engine = make_engine(max_num_batched_tokens=48, max_model_len=1024)
    prompts = [PROMPTS[8], PROMPTS[1], PROMPTS[5], PROMPTS[14]]
    params = [WITH_PROMPT_LOGPROBS, PLAIN, WITH_PROMPT_LOGPROBS, PLAIN]
    seen_chunks: list[tuple[str, range]] = []
    execute = engine.runner.execute

    def recording_execute(chunks, block_copies=()):
        seen_chunks.extend((c.seq.request.request_id, c.prompt_logprob_positions)
                           for c in chunks)
        return execute(chunks, block_copies)

    engine.runner.execute = recording_execute
    outputs = run_all(engine, prompts, params)
    tokenizer = smollm2.tokenizer
    for output, prompt_params in zip(outputs, params, strict=True):
        if prompt_params.prompt_logprobs is None:
            assert output.prompt_logprobs is None
            continue
        token_ids = output.prompt_token_ids
        assert len(token_ids) > 48  # several chunks
        assert_matches_reference(output.prompt_logprobs, token_ids, hf_logprobs(token_ids),
                                 tokenizer)
        ranges = [r for request_id, r in seen_chunks if request_id == output.request_id and r]
        assert len(ranges) >= 2 and ranges[0].start == 0 and ranges[-1].stop == len(token_ids) - 1
        assert all(a.stop == b.start for a, b in itertools.pairwise(ranges)), "each position once"


def test_an_identical_prompt_takes_no_cached_prefix_yet_agrees(make_engine):
    engine = make_engine(max_num_batched_tokens=64, max_model_len=1024)
    prompt = PROMPTS[8]
    first, = run_all(engine, [prompt], WITH_PROMPT_LOGPROBS)
    second, = run_all(engine, [prompt], WITH_PROMPT_LOGPROBS)
    plain, = run_all(engine, [prompt], PLAIN)
    assert first.num_cached_tokens == second.num_cached_tokens == 0
    assert plain.num_cached_tokens > 0, "the prefix was cached, for requests that may use it"
    for a, b in zip(first.prompt_logprobs[1:], second.prompt_logprobs[1:], strict=True):
        assert list(a) == list(b)
        assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)


def test_a_preempted_prefill_resumes_without_computing_a_position_twice(make_engine, smollm2,
                                                                        hf_logprobs):
    # 10 blocks of 16 tokens: the long prompt's 10 blocks cannot grow next to the other
    # request's, so it is preempted mid-prefill (it arrived later), and recomputed from the
    # cached blocks whose positions were done.
    engine = make_engine(num_gpu_blocks=10, max_num_batched_tokens=32, max_model_len=1024,
                         preemption_mode="recompute", watermark=0.0)
    prompt = smollm2.tokenizer.encode(PROMPTS[5])[:150]
    seen: list[tuple[range, range]] = []  # per chunk: its positions, its prompt-logprob ones
    execute = engine.runner.execute

    def recording_execute(chunks, block_copies=()):
        seen.extend((range(c.num_computed_tokens, c.num_computed_tokens + c.num_new_tokens),
                     c.prompt_logprob_positions)
                    for c in chunks if c.seq.request.params.prompt_logprobs is not None)
        return execute(chunks, block_copies)

    engine.runner.execute = recording_execute
    other = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    _, output = run_all(engine, [PROMPTS[1], prompt], [other, WITH_PROMPT_LOGPROBS])
    assert engine.stats().num_preemptions > 0
    computed = [positions for positions, _ in seen]
    assert any(b.start < a.stop for a, b in itertools.pairwise(computed)), "it recomputed"
    ranges = [positions for _, positions in seen if positions]
    assert ranges[0].start == 0 and ranges[-1].stop == len(prompt) - 1
    assert all(a.stop == b.start for a, b in itertools.pairwise(ranges)), "each position once"
    assert_matches_reference(output.prompt_logprobs, prompt, hf_logprobs(prompt),
                             smollm2.tokenizer)


def test_delta_hands_them_out_once_and_final_only_at_the_end(make_engine):
    engine = make_engine()
    outputs = {}
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=0,
                                output_kind=kind)
        outputs[kind] = engine.add_request("The capital of France is", params).request_id
    steps = []
    while engine.has_unfinished_requests():
        steps.append({o.request_id: o for o in engine.step()})
    delta = [step[outputs[RequestOutputKind.DELTA]] for step in steps]
    assert len(delta) == 3 and delta[0].prompt_logprobs is not None
    assert all(entry is None or len(entry) == 1 for entry in delta[0].prompt_logprobs)
    assert [o.prompt_logprobs for o in delta[1:]] == [None, None]
    final = [step[outputs[RequestOutputKind.FINAL_ONLY]] for step in steps
             if outputs[RequestOutputKind.FINAL_ONLY] in step]
    assert len(final) == 1 and final[0].prompt_logprobs == delta[0].prompt_logprobs


def test_a_one_token_prompt_has_one_empty_entry_and_too_many_is_refused(make_engine):
    engine = make_engine()
    output, = run_all(engine, [[42]], WITH_PROMPT_LOGPROBS)
    assert output.prompt_logprobs == [None]
    vocab_size = engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request("hi", SamplingParams(prompt_logprobs=vocab_size + 1))
    assert error.value.param == "prompt_logprobs"
