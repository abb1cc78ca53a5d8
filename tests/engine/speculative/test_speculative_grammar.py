"""Speculative decoding for requests with structured outputs.

Drafts are cut at proposal to what the grammar accepts (the matcher walked and rolled back),
each verification row is masked by the grammar after the drafts before it, and the matcher
ends each step having accepted exactly the tokens the sequence kept. End to end, greedy output
with drafts is the same token for token as without, in batches mixed with unconstrained
requests, and the constrained requests' drafts are proposed and accepted, also across the end
of a reasoning model's thinking, where the grammar starts.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from kvpool.engine.config.speculative import SpeculativeConfig
from kvpool.engine.sampling.constraints import (
    advance_grammars,
    bitmask_penalty,
    fill_grammar_rows,
)
from kvpool.engine.sampling.grammar import GrammarCompiler
from kvpool.engine.sampling.rows import SamplingRow
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.scheduler_output import ScheduledChunk
from kvpool.engine.sequence import Request, Sequence
from kvpool.engine.speculative import Speculator
from kvpool.engine.structured_outputs import StructuredOutputsParams, Thinking
from kvpool.memory.prefix_cache import NO_SALT
from tests.engine.speculative.test_speculative_engine import run_checked

CHOICES = ["yes please", "no thanks"]


@pytest.fixture(scope="module")
def compiler(smollm2) -> GrammarCompiler:
    return GrammarCompiler(smollm2.tokenizer, smollm2.config.vocab_size)


@pytest.fixture(scope="module")
def vocab(smollm2):
    """(tokenizer.encode without specials, the EOS id the grammar ends with)."""
    tokenizer = smollm2.tokenizer
    return (lambda text: tokenizer.encode(text, False)), min(tokenizer.eos_token_ids)


def allowed_mask(matcher, width: int) -> torch.Tensor:
    bitmask = torch.full((1, width), -1, dtype=torch.int32)
    matcher.fill(bitmask, 0)
    return bitmask


def decoding_chunk(prompt_token_ids: list[int], first_output: int, matcher,
                   max_tokens: int = 64) -> ScheduledChunk:
    """The decode chunk of a structured request's first output token (the one its prefill
    sampled, which its matcher has accepted): everything before it is computed."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    request = Request("r", None, prompt_token_ids, params, 0.0, NO_SALT, (None,),
                      matchers=(matcher,) if matcher is not None else ())
    seq = Sequence(0, request, 0, None, [], [first_output])
    request.sequences.append(seq)
    if matcher is not None:
        assert matcher.accept(first_output)
    return ScheduledChunk(seq, len(prompt_token_ids), [first_output], 1)


def speculator() -> Speculator:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=8, prompt_lookup_max=2,
                               prompt_lookup_min=2)
    return Speculator(config, max_model_len=1024)


@pytest.mark.parametrize("ending", ["rejected", "terminated"])
def test_the_proposal_cuts_drafts_the_grammar_rejects_and_leaves_the_matcher_alone(
        compiler, vocab, ending):
    """The prompt's earlier "Q:" was followed by the answer and then text the grammar
    forbids (or by EOS and more text): the drafts end at the last token the grammar takes, or
    at the EOS that ends it."""
    encode, eos = vocab
    answer = encode(CHOICES[0])
    after = [eos, *encode(" and more")] if ending == "terminated" else encode(" and more")
    prompt = [*encode("Q: A:"), *answer, *after, *encode("\nQ: A:")]
    matcher = compiler.compile(StructuredOutputsParams(choice=CHOICES)).new_matcher()
    chunk = decoding_chunk(prompt, answer[0], matcher)  # the answer's first token is out
    before = allowed_mask(matcher, compiler.bitmask_width)
    drafts = speculator().propose([chunk], 64, 1)
    expected = [*answer[1:], eos] if ending == "terminated" else answer[1:]
    assert drafts == {0: expected}
    assert matcher.num_accepted == 1 and not matcher.is_terminated and not matcher.is_rejected
    assert torch.equal(allowed_mask(matcher, compiler.bitmask_width), before)


def test_without_the_grammar_the_same_prompt_drafts_past_the_answer(compiler, vocab):
    """The control of the test above: the proposer itself does draft past the answer."""
    encode, _ = vocab
    answer = encode(CHOICES[0])
    prompt = [*encode("Q: A:"), *answer, *encode(" and more"), *encode("\nQ: A:")]
    drafts = speculator().propose([decoding_chunk(prompt, answer[0], None)], 64, 1)
    assert len(drafts[0]) > len(answer) - 1


def verification_rows(matcher, drafts: list[int]) -> list[SamplingRow]:
    params = SamplingParams(temperature=0)
    return [SamplingRow(params, [], [], None, matcher=matcher,
                        draft_token_ids=tuple(drafts[:row])) for row in range(len(drafts) + 1)]


def test_each_verification_row_is_masked_after_the_drafts_before_it(compiler, vocab):
    encode, eos = vocab
    answer = encode(CHOICES[0])
    matcher = compiler.compile(StructuredOutputsParams(choice=CHOICES)).new_matcher()
    bitmask = torch.full((len(answer) + 1, compiler.bitmask_width), -1, dtype=torch.int32)
    assert all(fill_grammar_rows(bitmask, verification_rows(matcher, answer)))
    assert matcher.num_accepted == 0  # rewound to the sequence's (no) outputs
    walker = compiler.compile(StructuredOutputsParams(choice=CHOICES)).new_matcher()
    for row in range(len(answer) + 1):
        assert torch.equal(bitmask[row], allowed_mask(walker, compiler.bitmask_width)[0])
        if row < len(answer):
            walker.accept(answer[row])
    is_allowed = torch.isfinite(bitmask_penalty(bitmask[-1:], compiler.vocab_size))[0]
    assert is_allowed.nonzero().flatten().tolist() == [eos]  # after the whole answer


@pytest.mark.parametrize("agrees", [False, True])
def test_the_sampler_advances_the_grammar_by_the_kept_tokens_only(compiler, vocab, agrees):
    """Drafts "yes please"; the sampler chose "no" at once (the rows after it choose tokens
    the grammar would reject: they are not kept), or every draft and EOS after them."""
    encode, eos = vocab
    drafts = encode(CHOICES[0])
    matcher = compiler.compile(StructuredOutputsParams(choice=CHOICES)).new_matcher()
    junk = encode(" maybe")[0]
    chosen = [*drafts, eos] if agrees else [encode("no")[0], *[junk] * len(drafts)]
    advance_grammars(verification_rows(matcher, drafts), chosen)
    num_kept = len(drafts) + 1 if agrees else 1
    assert matcher.num_accepted == num_kept and not matcher.is_rejected
    assert matcher.is_terminated == agrees


def test_a_grammar_that_ends_with_a_draft_takes_no_token_after_it(compiler, vocab):
    encode, eos = vocab
    drafts = [*encode(CHOICES[1]), eos]
    matcher = compiler.compile(StructuredOutputsParams(choice=CHOICES)).new_matcher()
    advance_grammars(verification_rows(matcher, drafts), drafts + encode(" more"))
    assert matcher.num_accepted == len(drafts) and matcher.is_terminated
    assert not matcher.has_ended(len(drafts) - 1) and matcher.has_ended(len(drafts))
    assert not matcher.has_rejected(len(drafts) + 1)


# ------------------------------------------------------------------ end to end
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
RECORD = {"name": "Alice Martin", "age": 31, "city": "Paris", "languages": ["French", "Go"]}
RECORD_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "city": {"type": "string"},
                   "languages": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "city", "languages"],
}
CODE = "QX-4821-KL-9035-ZT-7716"
SENTENCES = ["the block pool hands out fixed-size blocks from a free list",
             "the prefix cache shares full blocks between requests by their hashes"]


def chat(smollm2, text: str) -> str:
    return smollm2.tokenizer.hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)


def copy_requests(smollm2) -> list[tuple[str, SamplingParams]]:
    """Structured requests whose answers copy from their prompts (json, regex, choice), and
    unconstrained ones between them."""
    def guided(**spec) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=60,
                              structured_outputs=StructuredOutputsParams(**spec))
    free = SamplingParams(temperature=0, max_tokens=24)
    return [
        (chat(smollm2, f"Repeat this JSON exactly: {json.dumps(RECORD)}"),
         guided(json=RECORD_SCHEMA)),
        (chat(smollm2, "Once upon a time"), free),
        (chat(smollm2, f"Repeat this code exactly: {CODE}"),
         guided(regex=r"[A-Z]{2}(-[0-9]{4}-[A-Z]{2})+")),
        ("The quick brown fox", free),
        (chat(smollm2, f"Which is true: {SENTENCES[1]}, or {SENTENCES[0]}?"),
         guided(choice=SENTENCES)),
    ]


class _FreeDrafts:
    """A step cost model for which every draft pays (b = 0): how many tokens are drafted then
    follows the grammar and the prompt alone, not the wall times a busy machine measures."""

    def observe(self, num_tokens: int, seconds: float) -> None:
        pass

    def coefficients(self) -> tuple[float, float]:
        return 1.0, 0.0


def run(engine, requests) -> tuple[list, dict[str, list[tuple[int, int, int]]]]:
    """Final outputs in request order, and each request's verifications (outputs before it,
    drafts, drafts accepted), the engine's invariants checked after every step. Drafting is
    sized as if drafts were free (`_FreeDrafts`), so which requests draft is the same on any
    machine."""
    verifications: dict[str, list[tuple[int, int, int]]] = {}
    speculator = engine.scheduler.speculator
    speculator.cost = _FreeDrafts()
    verified = speculator.verified

    def spy(seq, num_drafts, num_accepted):
        verifications.setdefault(seq.request.request_id, []).append(
            (len(seq.output_token_ids), num_drafts, num_accepted))
        verified(seq, num_drafts, num_accepted)

    speculator.verified = spy
    prompts, params = zip(*requests, strict=True)
    return run_checked(engine, list(prompts), list(params)), verifications


def completions(outputs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
            for o in outputs]


def test_greedy_structured_outputs_are_identical_with_drafts_in_a_mixed_batch(
        make_engine, smollm2):
    requests = copy_requests(smollm2)
    plain, _ = run(make_engine(), requests)
    drafted, verifications = run(make_engine(speculative_config=NGRAM), requests)
    assert completions(drafted) == completions(plain)
    answer = json.loads(drafted[0].outputs[0].text)
    jsonschema.validate(answer, RECORD_SCHEMA)
    assert drafted[2].outputs[0].text.startswith("QX-4821")
    assert drafted[4].outputs[0].text in SENTENCES
    for output in (drafted[0], drafted[2], drafted[4]):  # the constrained requests drafted
        accepted = sum(entry[2] for entry in verifications[output.request_id])
        assert accepted >= 4, (output.request_id, verifications.get(output.request_id))


def test_a_grammar_that_ends_among_the_kept_tokens_stops_the_sequence_there(
        make_engine, smollm2, vocab):
    """The prompt ends its sentence with EOS (the chat template's end of turn), so the last
    drafts end with it: the verification keeps EOS and samples a token after it, and with
    ignore_eos only the grammar's end stops the sequence, at EOS, that token never emitted."""
    _, eos = vocab
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=SENTENCES))
    requests = [(chat(smollm2, f"Repeat exactly: {SENTENCES[0]}"), params)]
    plain, _ = run(make_engine(), requests)
    drafted, verifications = run(make_engine(speculative_config=NGRAM), requests)
    assert completions(drafted) == completions(plain)
    output = drafted[0].outputs[0]
    assert output.text == SENTENCES[0] and output.token_ids[-1] == eos
    num_before, _, num_accepted = verifications[drafted[0].request_id][-1]
    assert num_accepted > 0 and num_before + num_accepted == len(output.token_ids)


def test_seeded_structured_sampling_is_identical_with_drafts(make_engine, smollm2):
    """Random rows under a grammar: each verification row draws from the masked distribution
    its token would meet without drafts, and the seeded stream is rewound to the kept draws."""
    requests = [(prompt, SamplingParams(temperature=0.8, seed=11 + i, max_tokens=48,
                                        structured_outputs=params.structured_outputs))
                for i, (prompt, params) in enumerate(copy_requests(smollm2))
                if params.structured_outputs is not None]
    plain, _ = run(make_engine(), requests)
    drafted, verifications = run(make_engine(speculative_config=NGRAM), requests)
    assert completions(drafted) == completions(plain)
    assert sum(entry[2] for entries in verifications.values() for entry in entries) > 0


SUM_SCHEMA = {"type": "object", "required": ["sum"], "additionalProperties": False,
              "properties": {"sum": {"type": "integer"}}}


def test_drafts_run_through_the_thinking_into_the_answer_the_grammar_holds(
        make_engine, smollm2):
    """The prompt's pattern thinks, closes with </think> and answers `{"sum": "four"}`, which
    the schema refuses: drafts copy the thinking, the marker and the answer's start in one
    verification, and are cut where the answer leaves the schema. Greedy output is the same
    with drafts as without."""
    line = 'Q: two plus two?\nA: Two and two make four.</think>{"sum": "four"}\n'
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=(
        StructuredOutputsParams(json=SUM_SCHEMA, thinking=Thinking(end="</think>"))))
    requests = [(line * 3 + "Q: two plus two?\nA:", params)]
    plain, _ = run(make_engine(), requests)
    drafted, verifications = run(make_engine(speculative_config=NGRAM), requests)
    assert completions(drafted) == completions(plain)
    thinking, answer = drafted[0].outputs[0].text.split("</think>")
    assert thinking == " Two and two make four."
    jsonschema.validate(json.loads(answer), SUM_SCHEMA)
    boundary = len(smollm2.tokenizer.encode(thinking + "</think>", False))
    assert any(before < boundary < before + num_accepted
               for before, _, num_accepted in verifications[drafted[0].request_id])
