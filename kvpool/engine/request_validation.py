"""The checks a request passes before the engine queues it (`LLMEngine.add_request`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvpool.engine.engine import LLMEngine


def validate_request(engine: LLMEngine, request_id: str, token_ids: list[int],
                     params: SamplingParams) -> None:
    """InvalidRequestError (a ValueError naming the field) for a request that can never run:
    a reused id, an empty or out-of-vocabulary prompt, one longer than the model or the whole
    KV pool, token ids outside the vocabulary, n beyond the batch."""
    if request_id in engine.requests:
        raise InvalidRequestError("the request id is already in use", "request_id")
    if not token_ids:
        raise InvalidRequestError("the prompt is empty", "prompt")
    vocab_size = engine.model_config.vocab_size
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    if len(token_ids) >= engine.max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(token_ids)} tokens, but max_model_len is "
            f"{engine.max_model_len} (room is needed for at least one output token)", "prompt")
    if not engine.kv_memory.can_ever_fit(len(token_ids) + 1):
        capacity = engine.kv_memory.max_num_blocks * engine.kv_memory.layout.block_size
        raise InvalidRequestError(
            f"the prompt has {len(token_ids)} tokens, but the whole KV pool holds only "
            f"{capacity} tokens: it could never run", "prompt")
    if params.logprobs is not None and params.logprobs > vocab_size:
        raise InvalidRequestError(f"logprobs exceeds the vocabulary ({vocab_size})",
                                  "logprobs")
    if params.prompt_logprobs is not None and params.prompt_logprobs > vocab_size:
        raise InvalidRequestError(f"prompt_logprobs exceeds the vocabulary ({vocab_size})",
                                  "prompt_logprobs")
    for param, what, ids in (
        ("stop_token_ids", "stop_token_ids", params.stop_token_ids),
        ("logit_bias", "logit_bias keys", params.logit_bias or ()),
        ("allowed_token_ids", "allowed_token_ids", params.allowed_token_ids or ()),
    ):
        if any(token_id >= vocab_size for token_id in ids):
            raise InvalidRequestError(f"{what} must be in [0, {vocab_size})", param)
    if params.n > engine.config.max_num_seqs:
        raise InvalidRequestError(
            f"n exceeds max_num_seqs ({engine.config.max_num_seqs})", "n")
