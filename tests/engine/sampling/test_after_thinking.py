"""A grammar that starts after the thinking (`AfterThinking`), on SmolLM2's vocabulary, where
`</think>` is three tokens (`</`, `think`, `>`): before the end marker every token is allowed
and accepted, after it the grammar's mask and rules hold; the marker counts however it is
tokenized; rewinds and speculative drafts cross the boundary both ways; and with a start
marker (qwen3) an output that does not open with it is constrained from its first token."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.sampling.after_thinking import ANSWER, OPENING, THINKING
from kvpool.engine.sampling.constraints import (
    advance_grammars,
    bitmask_penalty,
    fill_grammar_rows,
    grammar_draft_prefix,
)
from kvpool.engine.sampling.grammar import GrammarCompiler
from kvpool.engine.sampling.rows import SamplingRow
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.structured_outputs import StructuredOutputsParams, Thinking

pytestmark = pytest.mark.slow

CHOICES = ["yes", "no"]
DEEPSEEK = Thinking(end="</think>")  # thinks from the first token
QWEN3 = Thinking(end="</think>", start="<think>")  # thinks only if it opens with <think>


@pytest.fixture(scope="module")
def compiler(smollm2) -> GrammarCompiler:
    return GrammarCompiler(smollm2.tokenizer, smollm2.config.vocab_size)


@pytest.fixture(scope="module")
def encode(smollm2):
    return lambda text: smollm2.tokenizer.encode(text, False)


@pytest.fixture(scope="module")
def eos(smollm2) -> int:
    return min(smollm2.tokenizer.eos_token_ids)


def matcher(compiler, thinking: Thinking | None, **spec):
    return compiler.new_matcher(StructuredOutputsParams(**(spec or {"choice": CHOICES}),
                                                        thinking=thinking))


def allowed(compiler, matcher) -> set[int] | None:
    """The tokens `matcher` allows next; None if it leaves its row alone (all allowed)."""
    bitmask = torch.full((1, compiler.bitmask_width), -1, dtype=torch.int32)
    if not matcher.fill(bitmask, 0):
        return None
    is_allowed = torch.isfinite(bitmask_penalty(bitmask, compiler.vocab_size))[0]
    return set(is_allowed.nonzero().flatten().tolist())


def accept_all(matcher, token_ids: list[int]) -> bool:
    return all([matcher.accept(token_id) for token_id in token_ids])


# ------------------------------------------------------------------ the end marker
def test_tokens_before_the_end_marker_are_free_and_those_after_it_follow_the_grammar(
        compiler, encode, eos):
    plain = matcher(compiler, None)
    after = matcher(compiler, DEEPSEEK)
    assert after.phase == THINKING and allowed(compiler, after) is None
    thinking = encode("maybe, or not.</think>")  # "maybe" is no choice: free while thinking
    assert accept_all(after, thinking) and after.num_accepted == len(thinking)
    assert after.phase == ANSWER and not after.is_rejected
    assert allowed(compiler, after) == allowed(compiler, plain)  # the grammar's first mask
    assert not after.accept(encode("maybe")[0]) and after.has_rejected(len(thinking) + 1)
    assert accept_all(after, [*encode("yes"), eos]) and after.is_terminated
    num_outputs = len(thinking) + 2
    assert after.has_ended(num_outputs) and not after.has_ended(num_outputs - 1)


def test_an_output_that_never_closes_its_thinking_is_never_constrained(compiler, encode, eos):
    after = matcher(compiler, DEEPSEEK)
    assert accept_all(after, [*encode("I think </thi"), eos])  # not the marker: free
    assert after.phase == THINKING and not after.is_terminated and not after.has_ended(10)


@pytest.mark.parametrize("marker", [["Ġ</", "think", ">"], list("</think>"), ["</", "think", "><"]],
                         ids=["space-merged", "letters", "past-the-marker"])
def test_the_end_marker_counts_however_it_is_tokenized(compiler, smollm2, encode, marker):
    """The marker as tokens other than its own (`</`, `think`, `>`): after a space, letter by
    letter, and ending in a `><` token that carries text past it (the grammar starts after
    that token)."""
    vocab = smollm2.tokenizer.hf_tokenizer.get_vocab()
    token_ids = [*encode("hm"), *(vocab[token] for token in marker)]
    after = matcher(compiler, DEEPSEEK)
    assert accept_all(after, token_ids[:-1]) and after.phase == THINKING
    assert after.accept(token_ids[-1]) and after.phase == ANSWER
    assert allowed(compiler, after) == allowed(compiler, matcher(compiler, None))


# ------------------------------------------------------------------ rewinds and drafts
def test_rewinds_cross_the_boundary_both_ways(compiler, encode, eos):
    after = matcher(compiler, DEEPSEEK)
    thinking, answer = encode("so:</think>"), [*encode("no"), eos]
    assert accept_all(after, thinking + answer) and after.is_terminated
    after.rewind_to(len(thinking))  # to the boundary: answering, nothing of it accepted
    assert after.phase == ANSWER and not after.is_terminated
    assert allowed(compiler, after) == allowed(compiler, matcher(compiler, None))
    after.rewind_to(len(thinking) - 1)  # back inside the marker: thinking again
    assert after.phase == THINKING and after.num_accepted == len(thinking) - 1
    assert allowed(compiler, after) is None and after.accept(encode("maybe")[0])
    after.rewind_to(len(thinking) - 1)
    assert accept_all(after, [thinking[-1], *encode("yes"), eos]) and after.is_terminated
    after.rewind_to(0)
    assert after.phase == THINKING and after.num_accepted == 0 and not after.is_terminated
    assert accept_all(after, thinking + answer) and after.is_terminated  # as the first time


def test_drafts_are_cut_where_the_answer_breaks_the_grammar(compiler, encode, eos):
    """From inside the thinking, drafts run through the end marker into the answer: they are
    kept up to the answer's last allowed token, and the matcher stays where it stood."""
    after = matcher(compiler, DEEPSEEK)
    thinking = encode("so, yes.</think>")
    assert accept_all(after, thinking[:2])
    drafts = [*thinking[2:], *encode("yes"), encode(" maybe")[0]]
    assert grammar_draft_prefix(after, 2, drafts) == drafts[:-1]
    assert after.num_accepted == 2 and after.phase == THINKING
    assert grammar_draft_prefix(after, 2, [*thinking[2:], eos, *encode("yes")]) == thinking[2:]


def test_verification_rows_are_free_before_the_marker_and_masked_after_it(
        compiler, encode, eos):
    after = matcher(compiler, DEEPSEEK)
    drafts = [*encode("ok</think>"), *encode("yes")]
    rows = [SamplingRow(SamplingParams(temperature=0), [], [], None, matcher=after,
                        draft_token_ids=tuple(drafts[:index]))
            for index in range(len(drafts) + 1)]
    bitmask = torch.full((len(rows), compiler.bitmask_width), -1, dtype=torch.int32)
    num_thinking = len(drafts) - 1
    assert fill_grammar_rows(bitmask, rows) == [False] * num_thinking + [True, True]
    assert after.num_accepted == 0 and after.phase == THINKING  # rewound to the outputs
    is_allowed = torch.isfinite(bitmask_penalty(bitmask[-1:], compiler.vocab_size))[0]
    assert is_allowed.nonzero().flatten().tolist() == [eos]  # after the whole answer
    advance_grammars(rows, [*drafts, eos])  # the sampler agreed with every draft
    assert after.num_accepted == len(drafts) + 1 and after.is_terminated


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(operations=st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=16),
       thinking=st.sampled_from([DEEPSEEK, QWEN3]))
def test_the_state_is_a_function_of_the_accepted_tokens(compiler, encode, eos, operations,
                                                       thinking):
    """Any run of accepts (pieces of the markers and of the answer, each token until one is
    refused) and rewinds leaves the matcher as a fresh one that accepted the same tokens:
    the same phase, mask, count and end (the invariant rewinds rely on)."""
    pieces = [encode("<think>"), encode("</think>"), encode("</think"), encode("<b>"),
              encode("yes"), encode("maybe"), encode("><"), [eos]]
    after = matcher(compiler, thinking, choice=["<b>", "yes"])
    accepted: list[int] = []
    for is_accept, number in operations:
        if is_accept:
            for token_id in pieces[number % len(pieces)]:
                if not after.accept(token_id):
                    break
                accepted.append(token_id)
        else:
            num_kept = max(len(accepted) + 1 - number % 5, 0)  # back 0 to 3, or a no-op
            after.rewind_to(num_kept)
            del accepted[num_kept:]
        fresh = matcher(compiler, thinking, choice=["<b>", "yes"])
        assert accept_all(fresh, accepted)
        assert (after.phase, after.num_accepted, after.is_terminated) == (
            fresh.phase, len(accepted), fresh.is_terminated)
        assert allowed(compiler, after) == allowed(compiler, fresh)


# ------------------------------------------------------------------ a start marker (qwen3)
def test_without_the_start_marker_the_grammar_holds_from_the_first_token(
        compiler, encode, eos):
    after = matcher(compiler, QWEN3)
    assert after.phase == OPENING
    first = allowed(compiler, matcher(compiler, None))
    assert allowed(compiler, after) == first | {encode("<")[0]}  # the opener may still come
    assert not after.accept(encode("maybe")[0]) and after.is_rejected
    assert accept_all(after, [*encode("yes"), eos]) and after.is_terminated
    assert after.phase == ANSWER and after.has_ended(2)


def test_opening_with_the_start_marker_thinks_until_the_end_marker(compiler, encode, eos):
    """The grammar refuses `<`, so only the marker's own tokens lead on; once it is open,
    anything goes until `</think>`. Rewound to the start, the grammar holds again."""
    after = matcher(compiler, QWEN3)
    opener = encode("<think>")
    assert after.accept(opener[0]) and after.phase == OPENING
    assert allowed(compiler, after) == {opener[1]}
    assert accept_all(after, opener[1:]) and after.phase == THINKING
    assert allowed(compiler, after) is None and accept_all(after, encode("maybe</think>"))
    assert after.phase == ANSWER and not after.accept(encode("maybe")[0])
    assert accept_all(after, [*encode("no"), eos]) and after.is_terminated
    after.rewind_to(1)
    assert after.phase == OPENING and allowed(compiler, after) == {opener[1]}
    after.rewind_to(0)
    assert after.accept(encode("no")[0]) and after.phase == ANSWER


def test_a_grammar_that_may_open_like_the_marker_keeps_both_ways_open(compiler, encode, eos):
    """choice "<b>": after `<` both the grammar's `b` and the marker's `think` are allowed;
    `b` leaves the marker, and the grammar, which took `<` too, goes on."""
    after = matcher(compiler, QWEN3, choice=["<b>", "yes"])
    less, bee, greater = encode("<b>")
    assert after.accept(less) and after.phase == OPENING
    assert allowed(compiler, after) == {bee, encode("<think>")[1]}
    assert accept_all(after, [bee, greater, eos]) and after.phase == ANSWER
    assert after.is_terminated and after.num_accepted == 4


# ------------------------------------------------------------------ the spec
def test_thinking_is_checked_and_moves_no_grammar(compiler):
    with pytest.raises(InvalidRequestError) as raised:
        Thinking(end="")
    assert raised.value.param == "structured_outputs.thinking.end"
    with pytest.raises(InvalidRequestError):
        Thinking(start="")
    plain = StructuredOutputsParams(choice=CHOICES)
    after = StructuredOutputsParams(choice=CHOICES, thinking=QWEN3)
    assert plain.key == after.key and plain != after  # one grammar, two specs
    assert compiler.compile(plain) is compiler.compile(after)
