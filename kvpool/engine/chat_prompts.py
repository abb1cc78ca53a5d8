"""Chat conversations as engine prompts, for `LLM.chat` (vLLM's arguments and meanings).

A conversation is rendered with the model's chat template, or with `chat_template` (a Jinja
string) when given; `tools` (OpenAI-style function definitions) and `chat_template_kwargs`
(extra variables such as `enable_thinking`) are handed to the template, as vLLM does. Each
prompt keeps both the rendered text and its token ids, so the engine does not tokenize twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Message = Mapping[str, Any]


def as_conversations(
    messages: Sequence[Message] | Sequence[Sequence[Message]],
) -> list[Sequence[Message]]:
    """One conversation (a list of messages) as a list of one; a list of them as a list."""
    if messages and isinstance(messages[0], Mapping):
        return [messages]
    return list(messages)


def chat_prompts(
    tokenizer: Any,
    conversations: list[Sequence[Message]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """{"prompt", "prompt_token_ids"} for each conversation. `tokenizer` is kvpool's wrapper
    (`LLMEngine.tokenizer`); ValueError if it is None or has no template to render with."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so it cannot chat")
    template_kwargs = _template_kwargs(chat_template, chat_template_kwargs, tools)
    prompts = []
    for conversation in conversations:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt,
                                             tokenize=False, **template_kwargs)
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        prompts.append({"prompt": text, "prompt_token_ids": token_ids})
    return prompts


def _template_kwargs(
    chat_template: str | None,
    chat_template_kwargs: Mapping[str, Any] | None,
    tools: Sequence[Mapping[str, Any]] | None,
) -> dict[str, Any]:
    """The keywords the template renders with; the named arguments win over the same names in
    `chat_template_kwargs`, as in vLLM."""
    kwargs = dict(chat_template_kwargs or {})
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    if tools is not None:
        kwargs["tools"] = [dict(tool) for tool in tools]
    return kwargs
