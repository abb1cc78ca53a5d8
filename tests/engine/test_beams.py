"""Beam search in the engine (`kvpool.engine.beams`): beams are copy-on-write forks of one
sequence; the best beam equals transformers' `num_beams` search in float32; pruned beams
free their blocks at once; preemption and abort leave nothing behind.

A tiny random Llama (float32, no tokenizer) written by transformers is the reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpool import LLM
from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.sampling_params import SamplingParams
from kvpool.sampling_params import BeamSearchParams
from tests.model.test_loaders import save_tiny_hf_model

PROMPTS = [[5, 6, 7], [20, 21, 22, 23, 24, 25, 26, 27, 28], [100, 3], [9] * 13]
SMALL = {"dtype": "float32", "kv_cache_memory": 4 << 20, "enable_warmup": False,
         "block_size": 4}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    directory = tmp_path_factory.mktemp("tiny-llama-beams")
    return directory, save_tiny_hf_model(directory)


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return LLM(str(tiny[0]), **SMALL)


def hf_beams(model, prompt: list[int], width: int, max_tokens: int) -> list[list[int]]:
    """transformers' beam search, every beam to full length (no EOS), best first."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), num_beams=width,
                             num_return_sequences=width, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, length_penalty=1.0,
                             early_stopping=False, eos_token_id=None, pad_token_id=0)
    return [row[len(prompt):].tolist() for row in out]


@pytest.mark.parametrize("width", [2, 4])
def test_beams_equal_transformers_num_beams(llm, tiny, width):
    """With EOS out of play every beam runs max_tokens, so both rank by the summed log
    probability: the same beams come back, best first."""
    max_tokens = 10
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                              BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                               ignore_eos=True))
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ours = [beam.tokens[len(prompt):] for beam in output.sequences]
        assert ours == hf_beams(tiny[1], prompt, width, max_tokens)
        assert all(beam.finish_reason == "length" for beam in output.sequences)
    assert not llm.engine.has_unfinished_requests()


def _run_watching(engine, params: SamplingParams, prompt: list[int]):
    """Step one beam request to its end, checking every invariant after each step; returns
    its output, the request, and per step (blocks its live beams hold, blocks one copy per
    beam would hold)."""
    request = engine.add_request({"prompt_token_ids": prompt}, params)
    usage, final = [], None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        engine.check_invariants()
        live = [seq for seq in request.sequences if not seq.is_finished]
        shared = {block for seq in live for block in seq.block_table.live_block_ids}
        usage.append((len(shared), sum(seq.block_table.num_blocks for seq in live)))
        for seq in request.sequences:
            if seq.is_finished:
                assert seq.block_table.num_blocks == 0, "a pruned beam kept its blocks"
        final = next((out for out in outputs if out.finished), final)
    return final, request, usage


def test_beams_share_blocks_and_pruned_beams_free_at_once(llm):
    engine = llm.engine
    idle = engine.kv_memory.pool.num_used_blocks
    prompt = list(range(30, 62))  # 8 full blocks of 4, shared by every beam
    params = BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True).sampling_params()
    output, request, usage = _run_watching(engine, params, prompt)
    assert len(output.outputs) == 4
    assert engine.kv_memory.pool.num_used_blocks == idle
    assert len(request.sequences) > 4, "beams were forked round by round"
    peak_shared = max(shared for shared, _ in usage)
    peak_copies = max(copies for _, copies in usage)
    assert all(shared <= copies for shared, copies in usage)
    # Four beams of 44 tokens: copies would hold 4 × 11 blocks; forks share the prompt's 8.
    assert peak_copies == 4 * 11
    assert peak_shared <= 8 + 4 * 3


def test_a_beam_request_under_preemption_gives_the_same_beams(tiny):
    """A pool too small for every beam at once: beams are preempted and recomputed, the
    others wait for their round, and the result is the unpressured one."""
    params = BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(40, 60))},
               {"prompt_token_ids": list(range(70, 95))}]
    roomy = LLM(str(tiny[0]), **SMALL).beam_search(prompts, params)
    tight = LLM(str(tiny[0]), **{**SMALL, "num_gpu_blocks": 20,
                                 "enable_prefix_caching": False})
    pressured = tight.beam_search(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    for want, got in zip(roomy, pressured, strict=True):
        assert [b.tokens for b in got.sequences] == [b.tokens for b in want.sequences]
    tight.engine.check_invariants()


def test_an_aborted_beam_search_returns_its_beams_and_frees_them(llm):
    engine = llm.engine
    idle = engine.kv_memory.pool.num_used_blocks
    params = BeamSearchParams(beam_width=3, max_tokens=50, ignore_eos=True).sampling_params()
    request = engine.add_request({"prompt_token_ids": [5, 6, 7, 8, 9]}, params)
    for _ in range(4):
        engine.step()
    output = engine.abort_request(request.request_id)
    assert output.finished and len(output.outputs) == 3
    assert {beam.finish_reason for beam in output.outputs} == {"abort"}
    assert all(len(beam.token_ids) == 4 for beam in output.outputs)  # a round per step
    assert engine.kv_memory.pool.num_used_blocks == idle
    engine.check_invariants()


def test_beams_ending_in_eos_finish_and_rank_with_the_length_penalty(llm):
    """EOS in play: a kept EOS candidate ends its beam (a record, no blocks); the n best by
    cum_logprob / length ** length_penalty come back, best first."""
    eos = next(iter(llm.engine.eos_token_ids))
    prompt = [5, 6, 7]
    params = SamplingParams(n=2, best_of=4, use_beam_search=True, temperature=0,
                            max_tokens=12, logprobs=1, length_penalty=0.5)
    [output] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert len(output.outputs) == 2
    scores = [beam.cumulative_logprob / (len(prompt) + len(beam.token_ids)
                                         - (beam.token_ids[-1] == eos)) ** 0.5
              for beam in output.outputs]
    assert scores == sorted(scores, reverse=True)
    for beam in output.outputs:
        chosen = sum(row[token].logprob for row, token in zip(beam.logprobs, beam.token_ids,
                                                               strict=True))
        assert beam.cumulative_logprob == pytest.approx(chosen, abs=1e-4)
        assert beam.finish_reason == ("stop" if beam.token_ids[-1] == eos else "length")


@pytest.mark.parametrize(("fields", "param"), [
    ({"temperature": 0.8}, "temperature"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"stop": ["x"]}, "stop"),
    ({"min_tokens": 2}, "min_tokens"),
    ({"logit_bias": {3: 1.0}}, "logit_bias"),
])
def test_beam_search_refuses_what_it_cannot_honour(llm, fields, param):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(use_beam_search=True, **{"temperature": 0, **fields})
    assert error.value.param == param
    params = SamplingParams(use_beam_search=True, temperature=0)
    for field, value in fields.items():  # set after construction: refused when used
        setattr(params, field, value)
    with pytest.raises(InvalidRequestError):
        llm.engine.add_request({"prompt_token_ids": [5, 6]}, params)
    assert not llm.engine.has_unfinished_requests()


def test_ranking_fields_need_beam_search():
    with pytest.raises(InvalidRequestError, match="best_of"):
        SamplingParams(n=1, best_of=3).validated_copy()
    with pytest.raises(InvalidRequestError, match="length_penalty"):
        SamplingParams(length_penalty=0.5).validated_copy()
