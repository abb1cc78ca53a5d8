"""`speculative_config`: vLLM's option for speculative decoding, as a checked, frozen value.

Given as a dict (`LLM(speculative_config={...})`, `--speculative-config '{...}'`) with vLLM's
field names; `SpeculativeConfig.from_dict` checks it, naming a bad field. Methods:

- "ngram" (prompt lookup): the drafts continue the latest earlier occurrence of the context's
  last n tokens, for n from `prompt_lookup_max` down to `prompt_lookup_min` (vLLM's defaults:
  both 5, or the one given);
- "suffix" (suffix decoding): prompt lookup within the request, plus a counted suffix trie of
  the tenant's recent outputs (`kvpool.engine.speculative.suffix`), with vLLM's
  `suffix_decoding_*` fields and defaults; `num_speculative_tokens` defaults to the tree depth;
- "draft_model" is refused, saying why (not built yet).

`disable_by_batch_size` (vLLM's) turns drafting off while at least that many requests run;
without it the engine decides from measured step times (`kvpool.engine.speculative.adaptive`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "suffix")
NOT_YET = {
    "draft_model": "a draft model needs its own KV layout in the pool (pages of another "
                   "size); use method 'ngram'",
    "eagle": "EAGLE heads are not supported; use method 'ngram'",
    "eagle3": "EAGLE heads are not supported; use method 'ngram'",
    "medusa": "Medusa heads are not supported; use method 'ngram'",
    "mtp": "multi-token prediction heads are not supported; use method 'ngram'",
}
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's, when neither bound is given
# vLLM's suffix-decoding defaults.
SUFFIX_DEFAULTS = {"suffix_decoding_max_tree_depth": 24,
                   "suffix_decoding_max_cached_requests": 10000,
                   "suffix_decoding_max_spec_factor": 1.0,
                   "suffix_decoding_min_token_prob": 0.1}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Checked speculative-decoding settings (vLLM's names)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    disable_by_batch_size: int | None = None
    suffix_decoding_max_tree_depth: int = SUFFIX_DEFAULTS["suffix_decoding_max_tree_depth"]
    suffix_decoding_max_cached_requests: int = SUFFIX_DEFAULTS[
        "suffix_decoding_max_cached_requests"]
    suffix_decoding_max_spec_factor: float = SUFFIX_DEFAULTS["suffix_decoding_max_spec_factor"]
    suffix_decoding_min_token_prob: float = SUFFIX_DEFAULTS["suffix_decoding_min_token_prob"]

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any] | None
                   ) -> SpeculativeConfig | None:
        """From a config or vLLM's dict (the CLI's flag parses its JSON into one); None stays
        None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        return cls.from_dict(value)

    @classmethod
    def from_dict(cls, given: dict[str, Any]) -> SpeculativeConfig:
        """ValueError naming the field when `given` is not a usable configuration."""
        known = ("method", "model", "num_speculative_tokens", "prompt_lookup_max",
                 "prompt_lookup_min", "disable_by_batch_size", *SUFFIX_DEFAULTS)
        for name in given:
            if name not in known:
                match = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {match[0]!r}?" if match else ""
                raise ValueError(f"speculative_config has no field {name!r}{hint}")
        method = given.get("method")
        if method is None and given.get("model") is not None:  # vLLM infers it from the model
            ngram = given["model"] in ("ngram", "[ngram]")  # vLLM's older spelling
            method = "ngram" if ngram else "draft_model"
        if method in NOT_YET:
            raise ValueError(f"speculative_config method {method!r}: {NOT_YET[method]}")
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, "
                             f"got {method!r}")
        suffix = {name: given.get(name, default) for name, default in SUFFIX_DEFAULTS.items()}
        num_tokens = given.get("num_speculative_tokens")
        if num_tokens is None and method == "suffix":  # vLLM's: as deep as the tree
            num_tokens = suffix["suffix_decoding_max_tree_depth"]
        if num_tokens is None:
            raise ValueError("speculative_config needs num_speculative_tokens")
        lookup_max = given.get("prompt_lookup_max")
        lookup_min = given.get("prompt_lookup_min")
        if lookup_max is None and lookup_min is None:
            lookup_max = lookup_min = DEFAULT_PROMPT_LOOKUP
        return cls(method, num_tokens, lookup_max or lookup_min, lookup_min or lookup_max,
                   given.get("disable_by_batch_size"), **suffix)

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name in ("method", "suffix_decoding_max_spec_factor",
                              "suffix_decoding_min_token_prob") or value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {field.name} must be a positive "
                                 f"integer, got {value!r}")
        factor, floor = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if not isinstance(factor, int | float) or isinstance(factor, bool) or factor <= 0:
            raise ValueError("speculative_config suffix_decoding_max_spec_factor must be a "
                             f"positive number, got {factor!r}")
        if not isinstance(floor, int | float) or isinstance(floor, bool) or not 0 <= floor <= 1:
            raise ValueError("speculative_config suffix_decoding_min_token_prob must be a "
                             f"probability in [0, 1], got {floor!r}")
        if self.suffix_decoding_max_tree_depth < 2:
            raise ValueError("speculative_config suffix_decoding_max_tree_depth must be at "
                             f"least 2, got {self.suffix_decoding_max_tree_depth}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min})"
                             f" must not exceed prompt_lookup_max ({self.prompt_lookup_max})")

    def as_dict(self) -> dict[str, Any]:
        """The vLLM-named fields (what `from_dict` accepts back); the suffix fields only for
        the suffix method."""
        return {field.name: getattr(self, field.name) for field in fields(self)
                if getattr(self, field.name) is not None
                and (self.method == "suffix" or field.name not in SUFFIX_DEFAULTS)}
