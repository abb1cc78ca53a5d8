"""Prompts as an OpenAI request carries them, turned into the token ids an engine runs: a
completion's prompts tokenized, a chat's conversation rendered with the chat template (its
tools planned and rendered by `tools/`) and tokenized.

The server builds its engine inputs from these, and `kvpool router` tokenizes with the same
functions, so the block hashes it looks up are the ones a replica will publish.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.requests.prompt_limits import PromptLimits
from kvpool.openai.errors import bad_request
from kvpool.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvpool.openai.tools.choice import ToolPlan, plan_tools
from kvpool.openai.tools.prompt import conversation

logger = logging.getLogger(__name__)

# Template arguments kvpool sets itself; a client's chat_template_kwargs cannot replace them.
_RESERVED_TEMPLATE_ARGS = frozenset({
    "conversation", "messages", "tools", "tokenize", "chat_template", "return_dict",
    "add_generation_prompt", "continue_final_message", "documents",
})


@dataclass(frozen=True, slots=True)
class EnginePrompt:
    """One prompt as the engine takes it (text kept for the response, ids to run)."""

    text: str | None
    token_ids: list[int]
    first_token_text: str | None = None  # echo with logprobs: position 0 has no logprob

    def as_engine_input(self) -> dict[str, Any]:
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}


def prompt_list(request: CompletionRequest) -> list[str | list[int]]:
    """`prompt` as a list of prompts (it is one text, one list of token ids, or a list of
    either); unchecked (the router reads it too, and leaves the checks to the replica)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def tokenize_prompt(prompt: str | list[int], tokenizer: Any, add_special_tokens: bool,
                    limits: PromptLimits | None = None) -> EnginePrompt:
    """The prompt's ids; text the `limits` (the server's engine's) refuse by its length alone
    is a 400 before the tokenizer sees it. The router, which tokenizes only to route, passes
    none."""
    if not isinstance(prompt, str):
        return EnginePrompt(None, prompt)
    if tokenizer is None:
        raise bad_request("this model has no tokenizer: send prompts as token ids", "prompt")
    return EnginePrompt(prompt, _encode(tokenizer, prompt, add_special_tokens, limits, "prompt"))


def _encode(tokenizer: Any, text: str, add_special_tokens: bool, limits: PromptLimits | None,
            param: str) -> list[int]:
    try:
        if limits is None:
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return limits.encode(tokenizer, text, add_special_tokens, param)
    except InvalidRequestError as error:  # too long: the limits' message, with its numbers
        raise bad_request(str(error), param) from error
    except (ValueError, TypeError) as error:  # e.g. a lone surrogate, not encodable
        raise bad_request(f"{param}: the text could not be tokenized", param) from error


def chat_prompt(request: ChatCompletionRequest, tokenizer: Any, override: str | None,
                limits: PromptLimits | None = None) -> tuple[EnginePrompt, ToolPlan]:
    """The conversation as the engine runs it, and its tool plan: the tools planned, the
    messages rendered with the chat template (`override`, the server's --chat-template, else
    the model's) and tokenized. OpenAIError 400 without a template, or for tools or messages
    that are refused. `kvpool router` tokenizes with it too, so its block hashes are the
    replica's. The rendered text is checked against `limits` as `tokenize_prompt` checks."""
    template = override or (tokenizer.hf_tokenizer.chat_template
                            if tokenizer is not None else None)
    if tokenizer is None or not template:
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    plan = plan_tools(request)
    return _render(tokenizer, request, plan, template, override, limits), plan


def _render(tokenizer: Any, request: ChatCompletionRequest, plan: ToolPlan, template: str,
            override: str | None, limits: PromptLimits | None) -> EnginePrompt:
    messages, extra = conversation(request.messages, plan, template)
    user_args = {key: value for key, value in (request.chat_template_kwargs or {}).items()
                 if key not in _RESERVED_TEMPLATE_ARGS}
    kwargs: dict[str, Any] = {**user_args, **extra,
                              "continue_final_message": request.continue_final_message}
    if request.documents:
        kwargs["documents"] = request.documents
    if override:
        kwargs["chat_template"] = override
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=request.add_generation_prompt, tokenize=False,
            **kwargs)
    except Exception as error:  # the template rejected the conversation (jinja raises anything)
        logger.info("chat template failed: %s", type(error).__name__)
        raise bad_request("the chat template cannot render these messages", "messages") from error
    return EnginePrompt(text, _encode(tokenizer, text, request.add_special_tokens, limits,
                                      "messages"))
