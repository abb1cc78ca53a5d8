"""From an OpenAI request body to engine inputs: token ids and `SamplingParams` per prompt.

Every check that can fail on user input lives here (and in `chat_inputs.py`, `unsupported.py`,
and `kvpool/openai/`'s `prompts.py`, `structured.py`, `tools/choice.py`) and raises
`OpenAIError` 400 with the parameter named: empty or too many prompts, a prompt that fills the
context (the engine's `PromptLimits`: text too long to fit is refused before it is tokenized),
`max_tokens` beyond the context, `n`/`logprobs`/stop limits, fields kvpool does not
honour, constraints the grammar compiler refuses, and the range checks of `SamplingParams` (its
`InvalidRequestError`: the message as it is, the field from its `param`). No message
includes the client's value; numbers the server computed (context lengths, token counts)
are fine.

A request that leaves a sampling field out gets the model's default from its
`generation_config.json` (`engine.default_sampling_params()`), else SamplingParams' own, as
vLLM does. `max_tokens` is clamped to what the context leaves after the prompt, as vLLM does;
only a value beyond the whole context (`max_model_len`) is an error.

The output kind is chosen here too: a stream asks for `DELTA` outputs (each carries only what
is new), a whole response for `FINAL_ONLY` (one output, at the end, with everything).

Tokenization and grammar compilation happen off the event loop (routes call these functions
through the input executor, `kvpool.server.input_work`; grammars compile within their bounds,
`kvpool.server.grammar_bounds`); the tokenizer is only read, never reconfigured, so that is safe
beside the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.requests.prompt_limits import PromptLimits
from kvpool.engine.sampling_params import RequestOutputKind, SamplingParams
from kvpool.openai.errors import bad_request
from kvpool.openai.prompts import EnginePrompt, prompt_list, tokenize_prompt
from kvpool.openai.protocol import CompletionRequest, SamplingFields
from kvpool.openai.structured import compile_constraint, request_constraint
from kvpool.openai.tools.choice import ToolPlan
from kvpool.openai.tools.parser import ToolParser
from kvpool.server.config import ServerConfig
from kvpool.server.unsupported import check_supported

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_SAMPLING_OPTIONS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty")


@dataclass(frozen=True, slots=True)
class EngineInputs:
    prompts: list[EnginePrompt]
    params: list[SamplingParams]  # one per prompt: max_tokens depends on the prompt's length
    priority: int = 0
    echo: bool = False  # completions: the response repeats each prompt first
    is_echo_only: bool = False  # echo with max_tokens 0: one token runs, none is returned
    tool_plan: ToolPlan | None = None  # chat: what the tools ask for
    output_parser: ToolParser | None = None  # chat: how the output text is read


def completion_inputs(
    request: CompletionRequest, engine: Any, config: ServerConfig, grammars: Any
) -> EngineInputs:
    """`grammars` compiles constraints (`compile(spec)`): the request's tenant's bounded
    compiler (`kvpool.server.grammar_bounds`)."""
    check_supported(request)
    tokenizer = engine.tokenizer
    max_model_len = engine.max_model_len
    limits = engine.prompt_limits
    prompts = [tokenize_prompt(prompt, tokenizer, request.add_special_tokens, limits)
               for prompt in _checked_prompt_list(request, config)]
    for prompt in prompts:
        check_prompt_length(limits, len(prompt.token_ids), "prompt")
    if request.logprobs is not None and not 0 <= request.logprobs <= config.max_logprobs:
        raise bad_request(f"logprobs must be in [0, {config.max_logprobs}]", "logprobs")
    constraint = request_constraint(request)
    if constraint is not None:
        compile_constraint(grammars, constraint)
    echo = bool(request.echo)
    is_echo_only = echo and request.max_tokens == 0
    if echo:
        prompts = [_echo_prompt(prompt, tokenizer, request.logprobs is not None)
                   for prompt in prompts]
    defaults = engine_defaults(engine)
    prompt_logprobs = checked_prompt_logprobs(request, config)
    if prompt_logprobs is None and echo:
        prompt_logprobs = request.logprobs  # what echo with logprobs returns for the prompt
    params = [
        sampling_params(
            request, config, defaults, "max_tokens",
            max_tokens=1 if is_echo_only else output_budget(
                request.max_tokens, len(prompt.token_ids), max_model_len, "max_tokens",
                DEFAULT_COMPLETION_MAX_TOKENS),
            logprobs=request.logprobs, prompt_logprobs=prompt_logprobs,
            structured_outputs=None if constraint is None else constraint.spec,
            **_beam_fields(request),
        )
        for prompt in prompts
    ]
    return EngineInputs(prompts, params, request.priority, echo, is_echo_only)


def engine_defaults(engine: Any) -> dict[str, Any]:
    """The model's sampling defaults (generation_config.json), or none."""
    read = getattr(engine, "default_sampling_params", None)
    if read is None:
        read = getattr(getattr(engine, "engine", None), "default_sampling_params", None)
    return dict(read()) if callable(read) else {}


# ------------------------------------------------------------------ prompts
def _checked_prompt_list(request: CompletionRequest, config: ServerConfig
                         ) -> list[str | list[int]]:
    prompts = prompt_list(request)
    if not prompts or any(len(item) == 0 for item in prompts):
        raise bad_request("prompt must not be empty", "prompt")
    if len(prompts) > config.max_prompts:
        raise bad_request(f"at most {config.max_prompts} prompts per request", "prompt")
    if len(prompts) > 1 and request.kv_transfer_params is not None:
        raise bad_request("kv_transfer_params hands over one prompt's KV: send one prompt",
                          "kv_transfer_params")
    return prompts


def _echo_prompt(prompt: EnginePrompt, tokenizer: Any, needs_first_token: bool) -> EnginePrompt:
    """The prompt with what echo repeats: its text (decoded, for token ids) and, for
    logprobs, its first token's text (the one position without a logprob)."""
    if tokenizer is None:
        raise bad_request("echo needs a tokenizer, which this model does not have", "echo")
    text = prompt.text
    if text is None:
        text = tokenizer.decode(prompt.token_ids)
    first = tokenizer.decode(prompt.token_ids[:1]) if needs_first_token else None
    return EnginePrompt(text, prompt.token_ids, first)


def check_prompt_length(limits: PromptLimits, num_tokens: int, param: str) -> None:
    """The engine's own length rule (`PromptLimits`), as a 400 naming `param`."""
    try:
        limits.check_num_tokens(num_tokens, param)
    except InvalidRequestError as error:
        raise bad_request(str(error), param) from error


def output_budget(
    requested: int | None, num_prompt_tokens: int, max_model_len: int, param: str,
    default: int | None,
) -> int:
    """The output budget, clamped to what the context leaves after the prompt (vLLM's rule:
    only a request beyond the whole context is an error; the prompt is already checked)."""
    room = max_model_len - num_prompt_tokens
    if requested is not None and requested > max_model_len:
        raise bad_request(
            f"{param} must be at most this model's maximum context length, "
            f"{max_model_len} tokens", param,
        )
    budget = default if requested is None else requested
    return room if budget is None else min(budget, room)


# ------------------------------------------------------------------ sampling
def checked_prompt_logprobs(request: SamplingFields, config: ServerConfig) -> int | None:
    value = request.prompt_logprobs
    if value is None:
        return None
    if not 0 <= value <= config.max_logprobs:
        raise bad_request(f"prompt_logprobs must be in [0, {config.max_logprobs}]",
                          "prompt_logprobs")
    if request.stream:
        raise bad_request("prompt_logprobs are not available with stream", "prompt_logprobs")
    return value


def sampling_params(
    request: SamplingFields, config: ServerConfig, defaults: dict[str, Any],
    max_tokens_param: str, **computed: Any,
) -> SamplingParams:
    """The engine's parameters from the request's fields, the model's defaults for those it
    leaves out, and what the endpoint `computed` (max_tokens, logprobs, constraint, ...);
    `max_tokens_param` is the field the client gave the output budget in."""
    n = request.n if request.n is not None else 1
    if n > config.max_n:
        raise bad_request(f"n must be at most {config.max_n}", "n")
    options = {name: getattr(request, name) for name in _SAMPLING_OPTIONS}
    given = {name: value if value is not None else defaults.get(name)
             for name, value in options.items()}
    kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
    fields = {
        "n": n, "seed": request.seed, "min_tokens": request.min_tokens,
        "stop": _stop_strings(request, config), "stop_token_ids": request.stop_token_ids,
        "ignore_eos": request.ignore_eos, "output_kind": kind,
        "logit_bias": _logit_bias(request.logit_bias),
        "allowed_token_ids": request.allowed_token_ids, "bad_words": request.bad_words,
        "skip_special_tokens": request.skip_special_tokens,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        **{name: value for name, value in given.items() if value is not None},
        "extra_args": ({"kv_transfer_params": request.kv_transfer_params}
                       if request.kv_transfer_params is not None else None),
        **computed,
    }
    try:
        return SamplingParams(**fields)
    except InvalidRequestError as error:
        param = max_tokens_param if error.param == "max_tokens" else error.param
        raise bad_request(str(error), param) from error


def _beam_fields(request: CompletionRequest) -> dict[str, Any]:
    """vLLM's beam search fields. A beam search is greedy: the model's default temperature
    does not apply (a temperature the client sets is refused by the engine's check)."""
    fields = {"best_of": request.best_of, "use_beam_search": request.use_beam_search,
              "length_penalty": request.length_penalty}
    if request.use_beam_search and request.temperature is None:
        fields["temperature"] = 0.0
    return fields


def _stop_strings(request: SamplingFields, config: ServerConfig) -> list[str]:
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stops) > config.max_stop_strings:
        raise bad_request(f"at most {config.max_stop_strings} stop strings", "stop")
    if any(len(stop) > config.max_stop_chars for stop in stops):
        raise bad_request(f"stop strings must be at most {config.max_stop_chars} chars", "stop")
    return stops


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's string keys as token ids (the engine checks them against the vocabulary)."""
    if bias is None:
        return None
    if not all(key.isascii() and key.isdigit() and len(key) <= 10 for key in bias):
        raise bad_request("logit_bias keys must be token ids (non-negative integers, as "
                          "strings)", "logit_bias")
    return {int(key): value for key, value in bias.items()}
