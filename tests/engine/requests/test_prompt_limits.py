"""`PromptLimits`: text too long for any tokenization is refused before the tokenizer runs
(byte-level BPE: by its characters), other tokenizers truncate at max_model_len + 1, and the
token rule is the engine's one rule, used by the intake."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import LLMEngine
from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.requests.prompt_limits import PromptLimits, byte_level_max_token_chars
from kvpool.engine.setup import build_engine_parts

SMOLLM2_MAX_TOKEN_CHARS = 81  # its longest vocabulary entry: "Ċ" and 80 "Ġ" (newline, spaces)


class CountingTokenizer:
    """A tokenizer wrapper that counts encode calls and records their max_length."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.hf_tokenizer = tokenizer.hf_tokenizer
        self.max_lengths: list[int | None] = []

    def encode(self, text: str, add_special_tokens: bool = True,
               max_length: int | None = None) -> list[int]:
        self.max_lengths.append(max_length)
        return self.tokenizer.encode(text, add_special_tokens, max_length)


def test_smollm2_is_byte_level_with_81_chars_per_token_at_most(smollm2) -> None:
    assert byte_level_max_token_chars(smollm2.tokenizer) == SMOLLM2_MAX_TOKEN_CHARS
    limits = PromptLimits.for_tokenizer(smollm2.tokenizer, max_model_len=64)
    assert limits == PromptLimits(64, SMOLLM2_MAX_TOKEN_CHARS * 65)
    assert PromptLimits.for_tokenizer(None, 64) == PromptLimits(64, None)


def test_over_long_text_is_refused_without_tokenizing(smollm2) -> None:
    limits = PromptLimits.for_tokenizer(smollm2.tokenizer, max_model_len=64)
    tokenizer = CountingTokenizer(smollm2.tokenizer)
    with pytest.raises(InvalidRequestError) as refused:
        limits.encode(tokenizer, "x" * 5266, param="messages")
    assert refused.value.param == "messages"
    assert str(refused.value) == (
        "the prompt has 5266 characters, more than the 5265 any prompt that fits this "
        "model's maximum context length (64 tokens) can have")
    assert tokenizer.max_lengths == []  # never tokenized
    # At the bound it is tokenized, whole (no truncation at 65), and then too long.
    assert len(limits.encode(tokenizer, " " * 5265)) == 83
    assert tokenizer.max_lengths == [None]


def test_the_character_bound_never_refuses_what_fits(smollm2) -> None:
    """The densest text there is (the longest token, repeated) fits at exactly the bound."""
    limits = PromptLimits.for_tokenizer(smollm2.tokenizer, max_model_len=4)
    densest = ("\n" + " " * 80) * 5
    assert len(densest) == limits.max_chars
    assert len(limits.encode(smollm2.tokenizer, densest, add_special_tokens=False)) == 5


def test_without_a_character_bound_text_is_truncated_at_max_model_len_plus_one(smollm2) -> None:
    limits = PromptLimits(max_model_len=8)  # as for a tokenizer that is not byte-level
    tokenizer = CountingTokenizer(smollm2.tokenizer)
    token_ids = limits.encode(tokenizer, "word " * 500)
    assert tokenizer.max_lengths == [9] and len(token_ids) == 9
    with pytest.raises(InvalidRequestError, match="the prompt has 9 tokens, but max_model_len "
                                                  "is 8"):
        limits.check_num_tokens(len(token_ids))
    limits.check_num_tokens(7)


def test_the_engine_applies_its_limits_before_tokenizing(fast_model) -> None:
    config = EngineConfig(num_gpu_blocks=16, enable_warmup=False, max_model_len=32)
    engine = LLMEngine(config, build_engine_parts(config, fast_model))
    assert engine.prompt_limits == PromptLimits(32, SMOLLM2_MAX_TOKEN_CHARS * 33)
    counting = CountingTokenizer(fast_model.tokenizer)
    engine.intake.tokenizer = counting
    with pytest.raises(InvalidRequestError, match="characters") as refused:
        engine.add_request("y" * 3_500_000)
    assert refused.value.param == "prompt" and counting.max_lengths == []
    with pytest.raises(InvalidRequestError, match="max_model_len is 32"):
        engine.add_request("word " * 40)
    assert counting.max_lengths == [None] and not engine.has_unfinished_requests()
