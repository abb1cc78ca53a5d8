"""From an OpenAI request body to engine inputs: token ids and `SamplingParams` per prompt.

Every check that can fail on user input lives here and raises `OpenAIError` 400 with the
parameter named: empty or too many prompts, a prompt that fills the context, `max_tokens`
beyond what the context leaves, `n`/`logprobs`/stop limits, unsupported options, and the range
checks of `SamplingParams` (its `InvalidRequestError`: the message as it is, the field from its
`param`). No message includes the client's value; numbers the server computed (context
lengths, token counts) are fine.

The output kind is chosen here too: a stream asks for `DELTA` outputs (each carries only what
is new), a whole response for `FINAL_ONLY` (one output, at the end, with everything).

Tokenization happens off the event loop (routes call these functions through a worker thread);
the tokenizer is only read, never reconfigured, so that is safe beside the engine thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.sampling_params import RequestOutputKind, SamplingParams
from kvpool.server.config import ServerConfig
from kvpool.server.errors import bad_request
from kvpool.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True, slots=True)
class EnginePrompt:
    """One prompt as the engine takes it (text kept for the response, ids to run)."""

    text: str | None
    token_ids: list[int]

    def as_engine_input(self) -> dict[str, Any]:
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}


@dataclass(frozen=True, slots=True)
class EngineInputs:
    prompts: list[EnginePrompt]
    params: list[SamplingParams]  # one per prompt: max_tokens depends on the prompt's length


def completion_inputs(
    request: CompletionRequest, tokenizer: Any, max_model_len: int, config: ServerConfig
) -> EngineInputs:
    if request.echo:
        raise bad_request("echo is not supported", "echo")
    if request.suffix is not None:
        raise bad_request("suffix is not supported", "suffix")
    prompts = [_tokenize_prompt(prompt, tokenizer) for prompt in _prompt_list(request, config)]
    for prompt in prompts:
        _check_prompt_length(len(prompt.token_ids), max_model_len, "prompt")
    if request.logprobs is not None and not 0 <= request.logprobs <= config.max_logprobs:
        raise bad_request(f"logprobs must be in [0, {config.max_logprobs}]", "logprobs")
    params = [
        _sampling_params(
            request,
            config,
            _max_tokens(request.max_tokens, len(prompt.token_ids), max_model_len, "max_tokens",
                        default=DEFAULT_COMPLETION_MAX_TOKENS),
            request.logprobs,
            "max_tokens",
        )
        for prompt in prompts
    ]
    return EngineInputs(prompts, params)


def chat_inputs(
    request: ChatCompletionRequest, tokenizer: Any, max_model_len: int, config: ServerConfig
) -> EngineInputs:
    if not request.messages:
        raise bad_request("messages must not be empty", "messages")
    if tokenizer is None or not tokenizer.has_chat_template:
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    prompt = _chat_prompt(tokenizer, request.messages)
    _check_prompt_length(len(prompt.token_ids), max_model_len, "messages")
    num_top = request.top_logprobs
    if num_top is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    if num_top is not None and not 0 <= num_top <= config.max_logprobs:
        raise bad_request(f"top_logprobs must be in [0, {config.max_logprobs}]", "top_logprobs")
    requested = request.max_completion_tokens
    param = "max_completion_tokens"
    if requested is None:
        requested, param = request.max_tokens, "max_tokens"
    max_tokens = _max_tokens(requested, len(prompt.token_ids), max_model_len, param, default=None)
    logprobs = (num_top or 0) if request.logprobs else None
    params = _sampling_params(request, config, max_tokens, logprobs, param)
    return EngineInputs([prompt], [params])


# ------------------------------------------------------------------ prompts
def _prompt_list(request: CompletionRequest, config: ServerConfig) -> list[str | list[int]]:
    prompt = request.prompt
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [list(prompt)]  # type: ignore[arg-type]
    else:
        prompts = list(prompt)  # type: ignore[arg-type]
    if not prompts or any(len(item) == 0 for item in prompts):
        raise bad_request("prompt must not be empty", "prompt")
    if len(prompts) > config.max_prompts:
        raise bad_request(f"at most {config.max_prompts} prompts per request", "prompt")
    return prompts


def _tokenize_prompt(prompt: str | list[int], tokenizer: Any) -> EnginePrompt:
    if not isinstance(prompt, str):
        return EnginePrompt(None, prompt)
    if tokenizer is None:
        raise bad_request("this model has no tokenizer: send prompts as token ids", "prompt")
    try:
        return EnginePrompt(prompt, tokenizer.encode(prompt))
    except (ValueError, TypeError) as error:  # e.g. a lone surrogate, not encodable
        raise bad_request("prompt: the text could not be tokenized", "prompt") from error


def _chat_prompt(tokenizer: Any, messages: list[ChatMessage]) -> EnginePrompt:
    conversation = [
        {"role": "system" if m.role == "developer" else m.role, "content": _content_text(m)}
        for m in messages
    ]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
        return EnginePrompt(text, tokenizer.encode(text, add_special_tokens=False))
    except Exception as error:  # the template rejected the conversation (jinja raises anything)
        logger.info("chat template failed: %s", type(error).__name__)
        raise bad_request("the chat template cannot render these messages", "messages") from error


def _content_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def _check_prompt_length(num_tokens: int, max_model_len: int, param: str) -> None:
    if num_tokens >= max_model_len:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{num_tokens} tokens (room is needed for at least one output token)",
            param,
            code="context_length_exceeded",
        )


def _max_tokens(
    requested: int | None, num_prompt_tokens: int, max_model_len: int, param: str,
    default: int | None,
) -> int:
    """The output budget: as requested if the context has room, else a 400 (the prompt's own
    length is already checked)."""
    room = max_model_len - num_prompt_tokens
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens: the prompt has "
            f"{num_prompt_tokens}, which leaves {room} for the completion, and {param} asks "
            f"for more",
            param,
            code="context_length_exceeded",
        )
    return requested


# ------------------------------------------------------------------ sampling
def _sampling_params(
    request: SamplingFields, config: ServerConfig, max_tokens: int, logprobs: int | None,
    max_tokens_param: str,
) -> SamplingParams:
    """The engine's parameters; `max_tokens_param` is the field the client gave the output
    budget in (chat's `max_completion_tokens`, or `max_tokens`)."""
    if request.n > config.max_n:
        raise bad_request(f"n must be at most {config.max_n}", "n")
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stops) > config.max_stop_strings:
        raise bad_request(f"at most {config.max_stop_strings} stop strings", "stop")
    if any(len(stop) > config.max_stop_chars for stop in stops):
        raise bad_request(f"stop strings must be at most {config.max_stop_chars} chars", "stop")
    options = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
    }
    given = {name: value for name, value in options.items() if value is not None}
    kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
    try:
        return SamplingParams(
            n=request.n, seed=request.seed, max_tokens=max_tokens, min_tokens=request.min_tokens,
            stop=stops, ignore_eos=request.ignore_eos, logprobs=logprobs, output_kind=kind,
            **given,
        )
    except InvalidRequestError as error:
        param = max_tokens_param if error.param == "max_tokens" else error.param
        raise bad_request(str(error), param) from error
