"""The SmolLM2 tokenizer built from the GGUF arrays agrees with transformers' own GGUF tokenizer:
encoding, decoding, special tokens and the chat template."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TEXTS = [
    "",
    "Hello, world!",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "Numbers: 12345, 3.14159, 1e-10, 2026-11-30",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(3)]}\n",
    "Ünïcödé àccents: naïve café, Straße, œuvre",
    "中文测试：春天来了，花开了。日本語のテキスト。한국어 문장.",
    "Emoji 🌸🚀 and a family 👩‍👩‍👧 and flags 🇫🇷",
    "مرحبا بالعالم — Привет, мир — Γειά σου",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "don't won't it's I'm you're we've they'll",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Bonjour ! 🌸"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 猫."},
    ],
]


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


def test_special_tokens_come_from_the_gguf(tokenizer):
    assert tokenizer.eos_token_ids == frozenset({2})  # the GGUF names <|im_end|> only
    assert tokenizer.bos_token_id == 1
    assert tokenizer.vocab_size == 49152
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == specials


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(tokenizer, hf_tokenizer, add_special_tokens):
    for text in TEXTS:
        expected = hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected, text


def test_decode_matches_transformers_and_round_trips(tokenizer, hf_tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids) == text
        assert tokenizer.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(
            ids, skip_special_tokens=True
        )


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=40))
def test_encode_matches_transformers_on_random_text(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer.encode(text)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_is_identical_to_transformers(tokenizer, hf_tokenizer, add_generation_prompt):
    for messages in CONVERSATIONS:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt, tokenize=False)
        expected_text = hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert text == expected_text
        expected_ids = hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
        assert tokenizer.apply_chat_template(messages, add_generation_prompt) == list(expected_ids)


def test_chat_template_default_system_prompt_and_generation_prompt(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_only_plain_byte_level_vocabularies_take_the_fast_path():
    from kvpool.model.tokenizer import _is_plain_byte_level

    metadata = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": ["a", "b", "Ġ"], "tokenizer.ggml.add_bos_token": False,
    }
    assert _is_plain_byte_level(metadata)
    # Other split rules, SentencePiece vocabularies, automatic BOS, or tokens outside the
    # byte alphabet go through transformers' GGUF conversion instead.
    assert not _is_plain_byte_level({**metadata, "tokenizer.ggml.pre": "llama-bpe"})
    assert not _is_plain_byte_level({**metadata, "tokenizer.ggml.model": "llama"})
    assert not _is_plain_byte_level({**metadata, "tokenizer.ggml.add_bos_token": True})
    assert not _is_plain_byte_level({**metadata, "tokenizer.ggml.tokens": ["a", "中"]})
