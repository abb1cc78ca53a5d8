"""/v1/chat/completions' engine inputs: the conversation rendered into one prompt, its tools
planned, its output budget and sampling parameters (shared with completions, `inputs.py`).

The prompt is `kvpool.openai.prompts.chat_prompt`'s, which the router uses too. The chat
template is the server's `--chat-template` if given, else the model's. Tools are rendered by
`kvpool/openai/tools/prompt.py` (the template's own way when it takes `tools`, else kvpool's
default tool prompt); `tool_choice` `required` or a named function constrains decoding
(`tools/choice.py`), which cannot be combined with another constraint
(`response_format`/`structured_outputs`). With tools in play (`auto`) a parser that needs
special tokens in the text turns `skip_special_tokens` off, as vLLM's hermes parser does.

With a `--reasoning-parser`, the output thinks first whatever it is asked: the constraint (a
tool choice's or the client's) gets the parser's `thinking`, so the grammar holds only the
answer after the thinking, and the output is read with the thinking split off first.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from kvpool.engine.structured_outputs import StructuredOutputsParams
from kvpool.openai.errors import bad_request
from kvpool.openai.prompts import chat_prompt
from kvpool.openai.protocol import ChatCompletionRequest
from kvpool.openai.reasoning import ThinkingFirst, get_reasoning_parser
from kvpool.openai.structured import compile_constraint, request_constraint
from kvpool.openai.tools import get_tool_parser
from kvpool.openai.tools.choice import ToolPlan, compile_tool_constraint
from kvpool.openai.tools.output import output_parser
from kvpool.openai.tools.parser import ToolParser
from kvpool.server.config import ServerConfig
from kvpool.server.inputs import (
    EngineInputs,
    check_prompt_length,
    checked_prompt_logprobs,
    engine_defaults,
    output_budget,
    sampling_params,
)
from kvpool.server.unsupported import check_supported

logger = logging.getLogger(__name__)

def chat_inputs(
    request: ChatCompletionRequest, engine: Any, config: ServerConfig, grammars: Any
) -> EngineInputs:
    check_supported(request)
    if not request.messages:
        raise bad_request("messages must not be empty", "messages")
    if request.continue_final_message and request.add_generation_prompt:
        raise bad_request("continue_final_message needs add_generation_prompt false",
                          "continue_final_message")
    prompt, plan = chat_prompt(request, engine.tokenizer, config.chat_template,
                               engine.prompt_limits)
    constraint = request_constraint(request)
    if constraint is not None and plan.constraint is not None:
        raise bad_request("tool_choice required or a named function constrains the output "
                          "itself: leave out response_format and structured_outputs",
                          "tool_choice")
    check_prompt_length(engine.prompt_limits, len(prompt.token_ids), "messages")
    logprobs = _logprobs(request, config)
    compile_tool_constraint(grammars, plan)
    if constraint is not None:
        compile_constraint(grammars, constraint)
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
        structured_outputs=None if chosen is None else _after_thinking(config, chosen.spec),
        **extra,
    )
    return EngineInputs([prompt], [params], request.priority, tool_plan=plan,
                        output_parser=_reader(config, plan, parser))


def _after_thinking(config: ServerConfig,
                    spec: StructuredOutputsParams) -> StructuredOutputsParams:
    """The constraint the engine applies: with a reasoning parser, to the answer after the
    thinking (the grammar is the same, compiled once, only its start moves)."""
    if config.reasoning_parser is None:
        return spec
    return replace(spec, thinking=get_reasoning_parser(config.reasoning_parser).thinking)


def _reader(config: ServerConfig, plan: ToolPlan, parser: ToolParser) -> ToolParser:
    """How the output is read: the tool plan's reader, after the thinking is split off when a
    reasoning parser is on (tool choices and constrained outputs too: their grammars hold the
    answer after the thinking)."""
    reader = output_parser(plan, parser)
    if config.reasoning_parser is None:
        return reader
    return ThinkingFirst(get_reasoning_parser(config.reasoning_parser), reader)


def _logprobs(request: ChatCompletionRequest, config: ServerConfig) -> int | None:
    num_top = request.top_logprobs
    if num_top is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    if num_top is not None and not 0 <= num_top <= config.max_logprobs:
        raise bad_request(f"top_logprobs must be in [0, {config.max_logprobs}]", "top_logprobs")
    return (num_top or 0) if request.logprobs else None
