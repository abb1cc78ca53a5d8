"""How to sample a request's continuation, and what its outputs carry; vLLM's names and meanings.

`SamplingParams` is a mutable dataclass, as in vLLM (whose chat example does
`sp = llm.get_default_sampling_params(); sp.max_tokens = N`). Every value is checked when the
object is built and again when it is used: the engine keeps `validated_copy()`, a checked
snapshot taken when the request is added, so a field set to a bad value after construction
fails at `generate`/`add_request`, and a change made after that never reaches a running
request. A bad value raises an `InvalidRequestError` whose `param` is the field at fault and
whose message names the field and the allowed range, never the offending value. The numeric
bounds also keep the sampler's float32 arithmetic finite (see `_MIN_REPETITION_PENALTY`), and
the size caps keep what a request's token rules cost bounded (`MAX_LOGIT_BIAS_KEYS`).
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field
from typing import Any

from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.structured_outputs import StructuredOutputsParams

# Temperatures below this are greedy (vLLM's `_SAMPLING_EPS`): dividing logits by less would
# scale them past 1e5 and make the softmax a numerically fragile argmax anyway.
_SAMPLING_EPS = 1e-5

# The repetition penalty multiplies or divides a logit by at most 100. With temperatures of at
# least _SAMPLING_EPS, a logit is scaled by at most 1e7 in all, so any logit below ~3e31 in
# magnitude (real ones are below 1e4) stays finite in float32, whose largest value is 3.4e38;
# 1e-300 overflowed to inf and turned the probabilities into NaN. Useful penalties lie near 1
# (vLLM and HF suggest 1.0-1.5): at 100 a seen token is already as good as banned.
_MIN_REPETITION_PENALTY = 0.01
_MAX_REPETITION_PENALTY = 100.0
# OpenAI's range for logit_bias values: -100 bans a token in effect, 100 all but forces it.
_MAX_LOGIT_BIAS = 100.0
# OpenAI's and vLLM's OpenAI server's bound. Far above it, dividing the logits gives float32
# zeros and subnormals: a row's probabilities come out unusable and it silently turns greedy.
MAX_TEMPERATURE = 2.0
# Size caps, checked before anything walks the values. OpenAI caps logit_bias at a few hundred
# keys; the others bound a request's token rules (`kvpool.engine.sampling.token_rules`), built
# once at admission, so that no request's lists can make every tenant's step slow.
MAX_LOGIT_BIAS_KEYS = 300
MAX_ALLOWED_TOKEN_IDS = 8192
MAX_BAD_WORDS = 128


class RequestOutputKind(enum.Enum):
    """What each output of a request carries, as it runs."""

    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # each output carries only what is new since the previous one
    FINAL_ONLY = 2  # a single output, when the request finishes


@dataclass
class SamplingParams:
    """Sampling and stopping rules for one request.

    temperature 0 (or below 1e-5) is greedy decoding. top_k 0 (or -1, as in vLLM) means no top-k
    limit. `logprobs=k` returns, for every sampled token, its log probability and the k most
    likely alternatives (from the model's raw distribution, before temperature and penalties).
    `output_kind` says what each of the request's outputs carries (see `RequestOutputKind`).

    Beyond the basics, as in vLLM: `logit_bias` adds to chosen tokens' logits; only
    `allowed_token_ids` may be sampled, when given; `bad_words` are never generated (as token
    sequences); `structured_outputs` constrains the output to a schema, regex, choice or
    grammar; `include_stop_str_in_output` keeps the stop string that ended the text;
    `prompt_logprobs=k` returns each prompt token's log probability and the k most likely
    alternatives at its position. `stop=None`, `stop_token_ids=None` and `seed=-1` mean none.
    `use_beam_search` searches `best_of` (default n) beams and returns the n best, ranked by
    cumulative log probability over length ** `length_penalty` (`kvpool.engine.beams`); it is
    greedy, so it takes no temperature, stop strings, min_tokens, penalties or constraints.

    Fields may be changed after construction (as in vLLM); the change is checked when the
    params are used (`validated_copy`, run by the engine when it takes the request).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Beam search (vLLM's earlier SamplingParams fields; /v1/completions still takes them).
    use_beam_search: bool = False
    best_of: int | None = None  # beams searched (default n); the n best come back
    length_penalty: float = 1.0
    # vLLM's extra_args; the engine reads "kv_transfer_params" there (disaggregated serving:
    # `kvpool.engine.kv_connector.params`) and ignores other keys, as vLLM leaves them to
    # custom code.
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self._normalize()
        self._validate()

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's `clone`): changing the copy's lists never touches this one."""
        return copy.deepcopy(self)

    def validated_copy(self) -> SamplingParams:
        """A normalised, checked deep copy: what the engine keeps of a request's params, so a
        change the caller makes later (to the object or its lists) never reaches the request.
        InvalidRequestError if a field was set out of range since construction."""
        self._check_sizes()  # before the copy walks them
        snapshot = copy.deepcopy(self)
        snapshot._normalize()
        snapshot._validate()
        return snapshot

    def _normalize(self) -> None:
        """vLLM's spellings of "none" and one-item shorthands, as the engine reads them; the
        lists and dict as this object's own copies."""
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.seed == -1:
            self.seed = None
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)

    def _check_sizes(self) -> None:
        """The size caps, checked by length alone (nothing walks the values first)."""
        for param, values, cap in (("logit_bias", self.logit_bias, MAX_LOGIT_BIAS_KEYS),
                                   ("allowed_token_ids", self.allowed_token_ids,
                                    MAX_ALLOWED_TOKEN_IDS),
                                   ("bad_words", self.bad_words, MAX_BAD_WORDS)):
            if values is not None and len(values) > cap:
                raise InvalidRequestError(f"{param} may hold at most {cap} entries", param)

    def _validate(self) -> None:
        self._check_sizes()
        # (field, is valid, rule); NaN fails every comparison, so it is rejected too.
        max_tokens = self.max_tokens
        checks = [
            ("n", self.n >= 1, "must be at least 1"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("temperature", math.isfinite(self.temperature), "must be finite"),
            ("temperature", self.temperature <= MAX_TEMPERATURE,
             f"must be in [0, {MAX_TEMPERATURE:g}]"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be 0 or -1 (off) or a positive int"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            (
                "repetition_penalty",
                _MIN_REPETITION_PENALTY <= self.repetition_penalty <= _MAX_REPETITION_PENALTY,
                f"must be in [{_MIN_REPETITION_PENALTY:g}, {_MAX_REPETITION_PENALTY:g}]",
            ),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("max_tokens", max_tokens is None or max_tokens >= 1, "must be at least 1"),
            ("min_tokens", self.min_tokens >= 0, "must be >= 0"),
            (
                "min_tokens",
                max_tokens is None or self.min_tokens <= max_tokens,
                "must not exceed max_tokens",
            ),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "must be >= 0"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "strings must be non-empty"),
            (
                "stop_token_ids",
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "must be non-negative ints",
            ),
            (
                "output_kind",
                isinstance(self.output_kind, RequestOutputKind),
                "must be a RequestOutputKind",
            ),
            *self._extension_checks(),
            *self._beam_checks(),
        ]
        for param, is_valid, rule in checks:
            if not is_valid:
                raise InvalidRequestError(f"{param} {rule}", param)

    def _extension_checks(self) -> list[tuple[str, bool, str]]:
        bias = self.logit_bias or {}
        allowed = self.allowed_token_ids
        return [
            ("logit_bias", all(_is_token_id(t) for t in bias), "keys must be token ids"),
            (
                "logit_bias",
                all(isinstance(v, (int, float)) and abs(v) <= _MAX_LOGIT_BIAS
                    for v in bias.values()),
                f"values must be in [-{_MAX_LOGIT_BIAS:g}, {_MAX_LOGIT_BIAS:g}]",
            ),
            (
                "allowed_token_ids",
                allowed is None or (bool(allowed) and all(_is_token_id(t) for t in allowed)),
                "must be a non-empty list of token ids",
            ),
            ("bad_words", all(isinstance(w, str) and w for w in self.bad_words),
             "must be non-empty strings"),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= 0,
             "must be >= 0"),
            (
                "structured_outputs",
                self.structured_outputs is None
                or isinstance(self.structured_outputs, StructuredOutputsParams),
                "must be a StructuredOutputsParams",
            ),
        ]

    def _beam_checks(self) -> list[tuple[str, bool, str]]:
        best_of = self.best_of
        if not self.use_beam_search:
            return [("best_of", best_of is None or best_of == self.n,
                     "must equal n unless use_beam_search (samples are not ranked)"),
                    ("length_penalty", self.length_penalty == 1.0, "needs use_beam_search")]
        return [
            ("best_of", best_of is None or best_of >= self.n, "must be at least n"),
            ("length_penalty", math.isfinite(self.length_penalty), "must be finite"),
            ("temperature", self.is_greedy, "must be 0 with use_beam_search"),
            ("stop", not self.stop, "is not supported with use_beam_search"),
            ("min_tokens", self.min_tokens == 0, "is not supported with use_beam_search"),
            ("structured_outputs", self.structured_outputs is None,
             "is not supported with use_beam_search"),
            ("repetition_penalty", not self.has_penalties,
             "penalties are not supported with use_beam_search"),
            ("logit_bias", not (self.logit_bias or self.allowed_token_ids or self.bad_words),
             "(and allowed_token_ids, bad_words) is not supported with use_beam_search: "
             "beams rank the model's raw distribution"),
        ]

    @property
    def num_sampled_logprobs(self) -> int | None:
        """Alternatives the sampler returns per token: `logprobs`, or for beam search its
        round's candidates, each beam's 2 * width likeliest tokens."""
        if self.use_beam_search:
            return max(self.logprobs or 0, 2 * self.beam_width)
        return self.logprobs

    @property
    def beam_width(self) -> int:
        """Beams searched at once (beam search only)."""
        return self.best_of or self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
