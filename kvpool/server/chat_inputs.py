"""/v1/chat/completions' engine inputs: the conversation rendered into one prompt, its tools
planned, its output budget and sampling parameters (shared with completions, `inputs.py`).

The chat template is the server's `--chat-template` if given, else the model's. Tools are
rendered by `tools/prompt.py` (the template's own way when it takes `tools`, else kvpool's
default tool prompt); `tool_choice` `required` or a named function constrains decoding
(`tools/choice.py`), which cannot be combined with another constraint
(`response_format`/`structured_outputs`). With tools in play (`auto`) a parser that needs
special tokens in the text turns `skip_special_tokens` off, as vLLM's hermes parser does.
"""

from __future__ import annotations

import logging
from typing import Any

from kvpool.server.config import ServerConfig
from kvpool.server.errors import bad_request
from kvpool.server.inputs import (
    EngineInputs,
    EnginePrompt,
    check_prompt_length,
    checked_prompt_logprobs,
    engine_defaults,
    output_budget,
    sampling_params,
)
from kvpool.server.protocol import ChatCompletionRequest
from kvpool.server.structured import compile_constraint, request_constraint
from kvpool.server.tools import get_tool_parser
from kvpool.server.tools.choice import ToolPlan, compile_tool_constraint, plan_tools
from kvpool.server.tools.output import output_parser
from kvpool.server.tools.prompt import conversation
from kvpool.server.unsupported import check_supported

logger = logging.getLogger(__name__)

# Template arguments kvpool sets itself; a client's chat_template_kwargs cannot replace them.
_RESERVED_TEMPLATE_ARGS = frozenset({
    "conversation", "messages", "tools", "tokenize", "chat_template", "return_dict",
    "add_generation_prompt", "continue_final_message", "documents",
})


def chat_inputs(
    request: ChatCompletionRequest, engine: Any, config: ServerConfig
) -> EngineInputs:
    check_supported(request)
    if not request.messages:
        raise bad_request("messages must not be empty", "messages")
    if request.continue_final_message and request.add_generation_prompt:
        raise bad_request("continue_final_message needs add_generation_prompt false",
                          "continue_final_message")
    prompt, plan = chat_prompt(request, engine.tokenizer, config.chat_template)
    constraint = request_constraint(request)
    if constraint is not None and plan.constraint is not None:
        raise bad_request("tool_choice required or a named function constrains the output "
                          "itself: leave out response_format and structured_outputs",
                          "tool_choice")
    check_prompt_length(len(prompt.token_ids), engine.max_model_len, "messages")
    logprobs = _logprobs(request, config)
    compile_tool_constraint(engine, plan)
    if constraint is not None:
        compile_constraint(engine, constraint)
    chosen = plan.constraint or constraint
    parser = get_tool_parser(config.tool_call_parser)
    defaults = engine_defaults(engine)
    requested, param = request.max_completion_tokens, "max_completion_tokens"
    if requested is None:
        requested, param = request.max_tokens, "max_tokens"
    max_tokens = output_budget(requested, len(prompt.token_ids), engine.max_model_len, param,
                               defaults.get("max_tokens"))
    extra: dict[str, Any] = {}
    if plan.mode == "auto" and parser.needs_special_tokens:
        extra["skip_special_tokens"] = False
    params = sampling_params(
        request, config, defaults, param, max_tokens=max_tokens, logprobs=logprobs,
        prompt_logprobs=checked_prompt_logprobs(request, config),
        structured_outputs=None if chosen is None else chosen.spec, **extra,
    )
    return EngineInputs([prompt], [params], request.priority, tool_plan=plan,
                        output_parser=output_parser(plan, parser))


def chat_prompt(request: ChatCompletionRequest, tokenizer: Any, override: str | None
                ) -> tuple[EnginePrompt, ToolPlan]:
    """The conversation as the engine runs it, and its tool plan: the tools planned, the
    messages rendered with the chat template (`override`, the server's --chat-template, else
    the model's) and tokenized. OpenAIError 400 without a template, or for tools or messages
    that are refused. `kvpool router` tokenizes with it too, so its block hashes are the
    replica's."""
    template = override or (tokenizer.hf_tokenizer.chat_template
                            if tokenizer is not None else None)
    if tokenizer is None or not template:
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    plan = plan_tools(request)
    return _render(tokenizer, request, plan, template, override), plan


def _logprobs(request: ChatCompletionRequest, config: ServerConfig) -> int | None:
    num_top = request.top_logprobs
    if num_top is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    if num_top is not None and not 0 <= num_top <= config.max_logprobs:
        raise bad_request(f"top_logprobs must be in [0, {config.max_logprobs}]", "top_logprobs")
    return (num_top or 0) if request.logprobs else None


def _render(tokenizer: Any, request: ChatCompletionRequest, plan: ToolPlan, template: str,
            override: str | None) -> EnginePrompt:
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
        token_ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
    except Exception as error:  # the template rejected the conversation (jinja raises anything)
        logger.info("chat template failed: %s", type(error).__name__)
        raise bad_request("the chat template cannot render these messages", "messages") from error
    return EnginePrompt(text, token_ids)
