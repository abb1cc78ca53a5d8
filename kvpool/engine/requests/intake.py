"""Request intake: what a caller sends, turned once into a `Request` the scheduler can queue.

    prompt (text | token ids | {"prompt_token_ids": ...}), SamplingParams, id, salt
      └─ snapshot ─ tokenize ─ validate ─ derive (salt key, generators, grammar matchers,
         token rules)
         ─ hash the prompt's full blocks ──▶ (Request, block_hashes)

Everything a step would otherwise derive again is derived here, at the edge, once: a request
that passes intake is never checked again, and the step only indexes what intake prepared
(`kvpool.engine.requests.derived`, `kvpool.engine.sampling.token_rules`). The request keeps
`params.validated_copy()`, so what the caller changes on its params object afterwards never
reaches it. Intake holds the limits a request is checked against (the
model's vocabulary and length, the whole KV pool's capacity, the batch's width), never the
engine: it knows nothing of steps.

Invariant: every request it returns can run alone on an empty pool (prompt plus one output
token fits `max_model_len` and the pool at its largest), and its ids lie in the vocabulary.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Container
from collections.abc import Sequence as SequenceOf
from typing import TYPE_CHECKING

import torch

from kvpool.engine.beams import BeamGroup
from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.requests.derived import (
    cache_salt_key,
    grammar_matchers,
    sequence_generators,
)
from kvpool.engine.requests.prompt_limits import PromptLimits
from kvpool.engine.sampling.grammar import GrammarCompiler
from kvpool.engine.sampling.token_rules import TokenRuleBuilder
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.sequence import Request
from kvpool.memory.kv_memory import KVMemory
from kvpool.memory.prefix_cache import BlockHash, hash_full_blocks

if TYPE_CHECKING:
    from kvpool.engine.config.scheduling import SchedulingConfig
    from kvpool.model.config import ModelConfig
    from kvpool.model.tokenizer import Tokenizer

PromptInput = str | SequenceOf[int] | dict


class RequestIntake:
    """Tokenizes, validates and prepares requests for one engine's model and KV memory."""

    def __init__(self, tokenizer: Tokenizer | None, model_config: ModelConfig,
                 max_model_len: int, scheduling: SchedulingConfig, kv_memory: KVMemory,
                 device: torch.device) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.max_model_len = max_model_len
        self.prompt_limits = PromptLimits.for_tokenizer(tokenizer, max_model_len)
        self.max_num_seqs = scheduling.max_num_seqs
        self.takes_priority = scheduling.scheduling_policy == "priority"
        self.kv_memory = kv_memory
        self.device = device
        eos_ids = tokenizer.eos_token_ids if tokenizer else ()
        self.eos_token_ids = frozenset(eos_ids) | frozenset(model_config.eos_token_ids)
        # Structured outputs' grammars (None without a tokenizer): callers may compile ahead.
        self.grammar_compiler = None if tokenizer is None else GrammarCompiler(
            tokenizer, model_config.vocab_size, self.eos_token_ids)
        # Logit bias, allowed ids and bad words as tensors; callers may tokenize bad words ahead.
        self.token_rules = TokenRuleBuilder(tokenizer, model_config.vocab_size, device)
        self._request_ids = itertools.count()

    def make_request(self, prompt: PromptInput, params: SamplingParams | None,
                     request_id: str | None, priority: int, cache_salt: str | None,
                     ids_in_use: Container[str]) -> tuple[Request, list[BlockHash]]:
        """The request and its prompt's full-block hashes; InvalidRequestError (a ValueError
        naming the field) if it could never run, TypeError for params of the wrong type."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params = params.validated_copy()  # checked now, and the caller's changes stay theirs
        prompt_text, token_ids = self.tokenize(prompt)
        request_id = request_id if request_id is not None else str(next(self._request_ids))
        if request_id in ids_in_use:
            raise InvalidRequestError("the request id is already in use", "request_id")
        if priority and not self.takes_priority:
            raise InvalidRequestError(
                f"priority {priority} needs scheduling_policy 'priority' (this engine serves "
                "first come, first served)", "priority")
        self.validate(token_ids, params)
        salt = cache_salt_key(cache_salt)
        request = Request(request_id, prompt_text, token_ids, params, time.monotonic(), salt,
                          sequence_generators(params.seed, params.n, self.device), priority,
                          cache_salt, grammar_matchers(params, self.grammar_compiler),
                          self.token_rules.build(params), beams=self._beams(params, token_ids))
        return request, hash_full_blocks(token_ids, self.kv_memory.layout.block_size, salt)

    def _beams(self, params: SamplingParams, token_ids: list[int]) -> BeamGroup | None:
        if not params.use_beam_search:
            return None
        return BeamGroup(params.beam_width, params.length_penalty, params.ignore_eos,
                         self.eos_token_ids, len(token_ids), params.max_tokens,
                         self.max_model_len)

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """(the prompt's text if it had one, its token ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer: give prompts as token ids", "prompt")
            return prompt, self.prompt_limits.encode(self.tokenizer, prompt)
        return None, [int(t) for t in prompt]

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """InvalidRequestError for a request that can never run: an empty or out-of-vocabulary
        prompt, one longer than the model or the whole KV pool, token ids outside the
        vocabulary, n beyond the batch."""
        self._validate_prompt(token_ids)
        vocab_size = self.vocab_size
        for param, value in (("logprobs", params.logprobs),
                             ("prompt_logprobs", params.prompt_logprobs)):
            if value is not None and value > vocab_size:
                raise InvalidRequestError(f"{param} exceeds the vocabulary ({vocab_size})", param)
        for param, what, ids in (
            ("stop_token_ids", "stop_token_ids", params.stop_token_ids),
            ("logit_bias", "logit_bias keys", params.logit_bias or ()),
            ("allowed_token_ids", "allowed_token_ids", params.allowed_token_ids or ()),
        ):
            if any(token_id >= vocab_size for token_id in ids):
                raise InvalidRequestError(f"{what} must be in [0, {vocab_size})", param)
        if params.n > self.max_num_seqs:
            raise InvalidRequestError(f"n exceeds max_num_seqs ({self.max_num_seqs})", "n")
        if params.use_beam_search and params.beam_width > self.max_num_seqs:
            raise InvalidRequestError(
                f"the beam width exceeds max_num_seqs ({self.max_num_seqs})", "best_of")

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})",
                                      "prompt")
        self.prompt_limits.check_num_tokens(len(token_ids))
        memory = self.kv_memory
        if not memory.can_ever_fit(len(token_ids) + 1):
            capacity = memory.max_num_blocks * memory.layout.block_size
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens, but the whole KV pool holds only "
                f"{capacity} tokens: it could never run", "prompt")
