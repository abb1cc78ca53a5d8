"""A request's token rules (`logit_bias`, `allowed_token_ids`, `bad_words`) as index tensors,
built once when the request is admitted, so that a step only indexes and concatenates them.

    params ── prepare (any thread: tokenize the bad words) ── build (at admission) ──▶ TokenRules
    each step: the rows' tensors concatenated (bias ids and values, allowed ids, one-token
               bad words) + one dict lookup by the output's last token (longer bad words)

A step used to rebuild Python lists over every row's dict and lists, so one request with a
40,000-key `logit_bias` slowed every tenant's step by a second and a half. Now a step's Python
work per row is constant, whatever the sizes, and the sizes are capped besides:
`SamplingParams` caps the counts (`MAX_LOGIT_BIAS_KEYS`, `MAX_ALLOWED_TOKEN_IDS`,
`MAX_BAD_WORDS`), and `build` caps the bad words' tokens (`MAX_BAD_WORD_TOKENS`).

Bad words follow vLLM: each word, without its leading whitespace and with one leading space
(how it tokenizes mid-text), is a token sequence; a one-token sequence is always banned, a
longer one's last token is banned when the output so far ends with its other tokens.
Tokenizing them is the slow part, so the async engine `prepare`s them in a worker thread
before the request reaches the engine thread, whose `build` then finds them cached.

Invariant: a `TokenRules`' tensors live on its builder's device (the model's) and never change;
`NO_TOKEN_RULES` (no tensors) is the rules of a request without any.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvpool.model.tokenizer import Tokenizer

# All of a request's bad-word token sequences together (both forms of every word).
MAX_BAD_WORD_TOKENS = 1024
# Tokenized bad-word lists kept between `prepare` and `build`: enough for the requests being
# added at once; a list that fell out is tokenized again by `build` (correct, only slower).
_NUM_CACHED_BAD_WORD_LISTS = 256

TokenSequence = tuple[int, ...]
# A longer bad word as (its tokens but the last, its last token), filed under the prefix's
# last token: a step looks up only the words whose prefix could end the output now.
_PrefixIndex = Mapping[int, tuple[tuple[TokenSequence, int], ...]]


@dataclass(frozen=True, slots=True, eq=False)
class TokenRules:
    """One request's token rules, as tensors on the model's device. None: no such rule."""

    bias_token_ids: torch.Tensor | None = None  # [num_biased] int64
    bias_values: torch.Tensor | None = None  # [num_biased] float32, OpenAI's additive bias
    allowed_token_ids: torch.Tensor | None = None  # [num_allowed] int64; None: all allowed
    banned_token_ids: torch.Tensor | None = None  # [num_one_token_words] int64, always banned
    bad_word_prefixes: _PrefixIndex = field(default_factory=dict)  # read-only once built
    bad_words_token_ids: tuple[TokenSequence, ...] = ()  # every bad word's sequence, in order

    @classmethod
    def from_token_ids(cls, logit_bias: Mapping[int, float] | None,
                       allowed_token_ids: SequenceOf[int] | None,
                       bad_words_token_ids: SequenceOf[TokenSequence],
                       device: torch.device) -> TokenRules:
        """The rules from already checked token ids (bad words as token sequences)."""
        if not logit_bias and allowed_token_ids is None and not bad_words_token_ids:
            return NO_TOKEN_RULES
        bias_ids = bias_values = allowed = banned = None
        if logit_bias:
            bias_ids = torch.tensor(list(logit_bias), dtype=torch.int64, device=device)
            bias_values = torch.tensor(list(logit_bias.values()), dtype=torch.float32,
                                       device=device)
        if allowed_token_ids is not None:
            allowed = torch.tensor(list(allowed_token_ids), dtype=torch.int64, device=device)
        words = tuple(tuple(word) for word in bad_words_token_ids)
        one_token = [word[0] for word in words if len(word) == 1]
        if one_token:
            banned = torch.tensor(one_token, dtype=torch.int64, device=device)
        return cls(bias_ids, bias_values, allowed, banned, _prefix_index(words), words)

    @property
    def is_empty(self) -> bool:
        return (self.bias_token_ids is None and self.allowed_token_ids is None
                and self.banned_token_ids is None and not self.bad_word_prefixes)

    def bad_word_bans(self, output_token_ids: SequenceOf[int]) -> list[int]:
        """The last tokens of the longer bad words whose other tokens end the output now (the
        one-token words are `banned_token_ids`). Looks only at the words filed under the
        output's last token."""
        if not self.bad_word_prefixes or not output_token_ids:
            return []
        num_output = len(output_token_ids)
        candidates = self.bad_word_prefixes.get(output_token_ids[-1], ())
        return [last for prefix, last in candidates
                if len(prefix) <= num_output
                and tuple(output_token_ids[num_output - len(prefix):]) == prefix]


NO_TOKEN_RULES = TokenRules()


def _prefix_index(words: tuple[TokenSequence, ...]) -> _PrefixIndex:
    index: dict[int, list[tuple[TokenSequence, int]]] = {}
    for word in words:
        if len(word) > 1:
            index.setdefault(word[-2], []).append((word[:-1], word[-1]))
    return {token_id: tuple(entries) for token_id, entries in index.items()}


class TokenRuleBuilder:
    """Builds requests' `TokenRules` for one model: its tokenizer (None: bad words are refused),
    vocabulary and device. Thread-safe: `prepare` may run in any thread, `build` in another."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int,
                 device: torch.device) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.device = device
        self._tokenized: OrderedDict[tuple[str, ...], tuple[TokenSequence, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def prepare(self, params: SamplingParams) -> None:
        """Tokenize `params.bad_words` ahead, so that `build` finds them cached (the async
        engine calls this in a worker thread); InvalidRequestError as `build` would raise."""
        self._bad_words_token_ids(params.bad_words)

    def build(self, params: SamplingParams) -> TokenRules:
        """The request's rules; its ids must already be checked against the vocabulary."""
        return TokenRules.from_token_ids(params.logit_bias, params.allowed_token_ids,
                                         self._bad_words_token_ids(params.bad_words),
                                         self.device)

    def _bad_words_token_ids(self, bad_words: list[str]) -> tuple[TokenSequence, ...]:
        if not bad_words:
            return ()
        key = tuple(bad_words)
        with self._lock:
            cached = self._tokenized.get(key)
            if cached is not None:
                self._tokenized.move_to_end(key)
                return cached
        sequences = self._tokenize(bad_words)
        with self._lock:
            self._tokenized[key] = sequences
            while len(self._tokenized) > _NUM_CACHED_BAD_WORD_LISTS:
                self._tokenized.popitem(last=False)
        return sequences

    def _tokenize(self, bad_words: list[str]) -> tuple[TokenSequence, ...]:
        """Each word stripped of leading whitespace, alone and after a space; duplicates
        dropped, and sequences with ids past the vocabulary (never generated) too."""
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: bad_words need one",
                                      "bad_words")
        sequences: dict[TokenSequence, None] = {}  # an ordered set
        num_tokens = 0
        for word in bad_words:
            word = word.lstrip()
            for text in (word, " " + word) if word else ():
                token_ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                num_tokens += len(token_ids)
                if num_tokens > MAX_BAD_WORD_TOKENS:
                    raise InvalidRequestError(
                        f"bad_words may come to at most {MAX_BAD_WORD_TOKENS} tokens in all "
                        "(each word counts twice: alone and after a space)", "bad_words")
                if token_ids and max(token_ids) < self.vocab_size:
                    sequences[token_ids] = None
        return tuple(sequences)
