"""Incremental detokenization: streamed deltas add up to the full decode, and a character split
across tokens is emitted whole, never as U+FFFD."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.model.detokenizer import IncrementalDetokenizer

FIXTURE_OK = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    return [detokenizer.add(token_id) for token_id in token_ids] + [detokenizer.flush()]


def test_an_emoji_split_across_tokens_comes_out_whole(tokenizer):
    ids = tokenizer.encode("Hi 🌸!")
    deltas = stream(IncrementalDetokenizer(tokenizer), ids)
    assert len(ids) == 5  # "Hi", then " 🌸" as three byte tokens, then "!"
    assert deltas == ["Hi", "", "", " 🌸", "!", ""]


# SmolLM2's vocabulary has no token for a few control bytes and for UTF-8 lead bytes 0xF1/0xF2
# (code points U+40000..U+BFFFF), so such text cannot round trip through any tokenizer of it.
ENCODABLE = st.characters(max_codepoint=0x3FFFF, exclude_categories=("Cc", "Cs"))


@FIXTURE_OK
@given(text=st.text(ENCODABLE, max_size=30))
def test_text_streams_back_exactly_without_replacement_chars(tokenizer, text):
    deltas = stream(IncrementalDetokenizer(tokenizer), tokenizer.encode(text))
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)


@FIXTURE_OK
@given(
    token_ids=st.lists(st.integers(0, 49151), max_size=24)
    | st.lists(st.sampled_from(range(130, 260)), max_size=24),  # byte tokens: partial UTF-8
    skip_special_tokens=st.booleans(),
)
def test_deltas_concatenate_to_the_full_decode(tokenizer, token_ids, skip_special_tokens):
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = stream(detokenizer, token_ids)
    expected = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == detokenizer.text == expected


def test_prompt_context_is_not_emitted(tokenizer):
    prompt = tokenizer.encode("The café sells 春巻")
    output = tokenizer.encode(" and crêpes 🥞 today")
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt), output)
    assert "".join(deltas) == " and crêpes 🥞 today"
