"""`PromptLimits`: the one rule for how long a prompt may be, applied before and after
tokenizing, by the engine's intake and the server alike.

A prompt fits when it has fewer than `max_model_len` tokens (room is left for one output
token). Tokenizing is the costly part (seconds for megabytes of text), so text that cannot
fit is refused before the tokenizer sees it:

- Byte-level BPE (GPT-2 style: SmolLM2, Llama 3, Qwen): every token stands for at most
  `max_token_chars` bytes of text (its longest vocabulary entry, in the byte alphabet's
  characters, one per byte; 81 for SmolLM2), hence at most that many characters. Text of more
  than `max_token_chars × (max_model_len + 1)` characters has more than `max_model_len`
  tokens, whatever it says: refused by its length alone (`max_chars`).
- Any other tokenizer (a normalizer may shrink text, a model may map many bytes to one token):
  no such bound is known, so the text is tokenized with truncation at `max_model_len + 1`
  tokens, enough to tell "too long" and no more held in memory.

Invariant: a prompt `check_text` lets through and `check_num_tokens` accepts fits the model;
`check_text` never refuses a prompt that would fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpool.engine.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """How long a prompt may be, in tokens and (where a bound is known) in characters."""

    max_model_len: int
    max_chars: int | None = None  # None: no character bound is known (truncate instead)

    def __post_init__(self) -> None:
        if self.max_model_len < 1 or (self.max_chars is not None and self.max_chars < 1):
            raise ValueError("max_model_len and max_chars must be at least 1")

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, max_model_len: int) -> PromptLimits:
        """The limits for `tokenizer` (a `kvpool.model.tokenizer.Tokenizer`, or None: token
        ids only, no text to bound)."""
        max_token_chars = byte_level_max_token_chars(tokenizer)
        if max_token_chars is None:
            return cls(max_model_len)
        return cls(max_model_len, max_token_chars * (max_model_len + 1))

    def check_text(self, text: str, param: str = "prompt") -> None:
        """InvalidRequestError if `text` has too many characters to fit in any tokenization."""
        if self.max_chars is not None and len(text) > self.max_chars:
            raise InvalidRequestError(
                f"the prompt has {len(text)} characters, more than the {self.max_chars} any "
                f"prompt that fits this model's maximum context length ({self.max_model_len} "
                f"tokens) can have", param)

    def encode(self, tokenizer: Any, text: str, add_special_tokens: bool = True,
               param: str = "prompt") -> list[int]:
        """`text`'s token ids, refused by `check_text` first; without a character bound,
        truncated at `max_model_len + 1` (so `check_num_tokens` still refuses it). The
        tokenizer's own errors (ValueError, TypeError) pass through."""
        self.check_text(text, param)
        max_length = None if self.max_chars is not None else self.max_model_len + 1
        return tokenizer.encode(text, add_special_tokens=add_special_tokens,
                                max_length=max_length)

    def check_num_tokens(self, num_tokens: int, param: str = "prompt") -> None:
        """InvalidRequestError unless a prompt of `num_tokens` leaves room for one output
        token."""
        if num_tokens >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {num_tokens} tokens, but max_model_len is "
                f"{self.max_model_len}: this model's maximum context length, which must leave "
                f"room for at least one output token", param)


def byte_level_max_token_chars(tokenizer: Any) -> int | None:
    """The longest vocabulary entry in characters, if `tokenizer` is a byte-level BPE with no
    normalizer (where that bounds the characters each token covers: no unknown token can
    swallow a run of text, and nothing shrinks the text first); else None."""
    from tokenizers import decoders, models

    backend = getattr(getattr(tokenizer, "hf_tokenizer", None), "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    if not (isinstance(backend.model, models.BPE)
            and isinstance(backend.decoder, decoders.ByteLevel)):
        return None
    return max(len(token) for token in backend.get_vocab(with_added_tokens=True))
