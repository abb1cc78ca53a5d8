"""The block hashes a replica will compute for a request, computed in the router its way.

The token ids come from the server's own functions, so they are the replica's ids: the
body is parsed with the server's request models; a completion's first prompt is tokenized by
`kvpool.openai.prompts.tokenize_prompt` (a batch of prompts runs on one replica, routed by its
first), a chat's conversation rendered and tokenized by `kvpool.openai.prompts.chat_prompt`
(chat template, tools and all). The salt is `TenantSalts.cache_salt(tenant, cache_salt)` (the
router holds the replicas' salt secret), the tenant the one the server's middleware gives the
same key, so the hashes are the replica's `hash_full_blocks` chain.

A request that cannot be read this way (a body that does not parse, no tokenizer, messages the
template refuses, a bad salt) gets `UNMATCHED`: it is routed by load, and the replica gives the
real error. The router never fails a request here.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from kvpool.memory.prefix_cache import BlockHash, hash_full_blocks, salt_key
from kvpool.openai.auth import TenantSalts
from kvpool.openai.prompts import chat_prompt, prompt_list, tokenize_prompt
from kvpool.openai.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True, slots=True)
class PromptKey:
    """What the router looks up in the replicas' prefix indexes."""

    block_hashes: tuple[BlockHash, ...]  # the prompt's full blocks, salted as a replica salts
    num_prompt_tokens: int


UNMATCHED = PromptKey((), 0)  # not hashed: matches nothing, so the request goes by load


def prompt_key(path: str, body: bytes, tenant: str, tokenizer: Any,
               chat_template: str | None, block_size: int,
               tenant_salts: TenantSalts) -> PromptKey:
    """The request's `PromptKey`, or `UNMATCHED` (module docstring)."""
    try:
        token_ids, client_salt = _token_ids(path, json.loads(body), tokenizer, chat_template)
        salt = salt_key(tenant_salts.cache_salt(tenant, client_salt))
    except Exception as error:  # anything a bad request raises: the replica will say what
        logger.debug("routing by load: the request cannot be tokenized (%s)",
                     type(error).__name__)
        return UNMATCHED
    return PromptKey(tuple(hash_full_blocks(token_ids, block_size, salt)), len(token_ids))


def _token_ids(path: str, data: Any, tokenizer: Any, chat_template: str | None
               ) -> tuple[list[int], str | None]:
    """The ids the replica will run, and the request's own `cache_salt`."""
    if path == CHAT_PATH:
        chat = ChatCompletionRequest.model_validate(data)
        prompt, _ = chat_prompt(chat, tokenizer, chat_template)
        return prompt.token_ids, chat.cache_salt
    completion = CompletionRequest.model_validate(data)
    first = prompt_list(completion)[0]  # IndexError for no prompt: routed by load
    prompt = tokenize_prompt(first, tokenizer, completion.add_special_tokens)
    return prompt.token_ids, completion.cache_salt


def load_tokenizer(model: str | None) -> Any:
    """The tokenizer of `model` (a path or cached Hub id, as `kvpool serve` takes it; None:
    the bundled SmolLM2), without its weights; None for a dummy preset, which has none (text
    prompts are then routed by load)."""
    from kvpool.model.loaders.auto import make_loader
    from kvpool.model.presets import PRESETS

    if model in PRESETS:
        return None
    return make_loader(model).load_tokenizer()
