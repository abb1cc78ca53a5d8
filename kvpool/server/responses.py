"""From engine outputs to OpenAI bodies: whole responses, and the pieces streams share.

The server asks the engine for the outputs each body needs (`inputs.py` sets the output kind):
a whole response is built from one `FINAL_ONLY` output per prompt, which carries everything;
a stream (`streams.py`) gets `DELTA` outputs, each carrying only what is new.

Choice numbering follows OpenAI: with several prompts, prompt i's completion j is choice
`i * n + j`. With `echo`, a completion's text starts with its prompt and its logprobs with the
prompt's tokens' (from the engine's prompt logprobs; the first token has none: null, as in
OpenAI's and vLLM's answers), which is what loglikelihood evaluations read. A chat choice's
text is read by the request's tool plan (`tools/output.py`) into content and tool calls.
Prompt logprobs, when asked for, are passed on in vLLM's shape: per prompt token, null for the
first, else token id -> {logprob, rank, decoded_token}, -inf written as -9999.0 as vLLM does
(JSON has no infinity).
"""

from __future__ import annotations

from kvpool.engine.requests.outputs import CompletionOutput, Logprob, RequestOutput
from kvpool.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FunctionCall,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
)
from kvpool.openai.tools.output import finish_reason, new_call_id
from kvpool.server.inputs import EngineInputs, EnginePrompt

MIN_LOGPROB = -9999.0  # what vLLM writes for -inf


def usage(finals: list[RequestOutput], num_completion_tokens: int | None = None) -> Usage:
    """Usage of the prompts' final outputs; `num_completion_tokens` is counted by the caller
    for a stream (whose final outputs are deltas), else taken from the outputs themselves."""
    num_prompt = sum(len(output.prompt_token_ids) for output in finals)
    if num_completion_tokens is None:
        num_completion_tokens = sum(len(c.token_ids) for output in finals for c in output.outputs)
    return Usage(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt + num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(output.num_cached_tokens for output in finals)
        ),
    )


# ------------------------------------------------------------------ logprobs
def _token_text(token_id: int, entry: Logprob) -> str:
    return entry.decoded_token if entry.decoded_token is not None else f"token_id:{token_id}"


def _value(entry: Logprob) -> float:
    return max(entry.logprob, MIN_LOGPROB)


def _ranked(entries: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    """The `num_top` most likely tokens of a step, best first."""
    ranked = sorted(entries.items(), key=lambda item: (item[1].rank, -item[1].logprob))
    return [(token_id, entry) for token_id, entry in ranked if entry.rank <= num_top][:num_top]


def completion_logprobs(
    completion: CompletionOutput, num_top: int, text_offset: int
) -> CompletionLogprobs | None:
    """Logprobs of the completion's tokens, `text_offset` being where its first one begins."""
    if completion.logprobs is None:
        return None
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token_id, entries in zip(completion.token_ids, completion.logprobs, strict=True):
        _append(result, token_id, entries, num_top, text_offset)
        text_offset += len(result.tokens[-1])
    return result


def echo_logprobs(
    prompt: EnginePrompt, prompt_logprobs: list[dict[int, Logprob] | None], num_top: int
) -> CompletionLogprobs:
    """Logprobs of the prompt's tokens (echo): the first has none (null)."""
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    text_offset = 0
    for token_id, entries in zip(prompt.token_ids, prompt_logprobs, strict=True):
        if entries is None:
            result.tokens.append(prompt.first_token_text or f"token_id:{token_id}")
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            result.text_offset.append(text_offset)
        else:
            _append(result, token_id, entries, num_top, text_offset)
        text_offset += len(result.tokens[-1])
    return result


def _append(result: CompletionLogprobs, token_id: int, entries: dict[int, Logprob],
            num_top: int, text_offset: int) -> None:
    result.tokens.append(_token_text(token_id, entries[token_id]))
    result.token_logprobs.append(_value(entries[token_id]))
    result.top_logprobs.append(
        {_token_text(tid, entry): _value(entry) for tid, entry in _ranked(entries, num_top)})
    result.text_offset.append(text_offset)


def chat_logprobs(completion: CompletionOutput, num_top: int) -> ChatLogprobs | None:
    if completion.logprobs is None:
        return None
    content = []
    for token_id, entries in zip(completion.token_ids, completion.logprobs, strict=True):
        token = _token_text(token_id, entries[token_id])
        top = [_top_logprob(_token_text(tid, entry), entry) for tid, entry in
               _ranked(entries, num_top)]
        content.append(TokenLogprob(**_top_logprob(token, entries[token_id]).model_dump(),
                                    top_logprobs=top))
    return ChatLogprobs(content=content)


def _top_logprob(token: str, entry: Logprob) -> TopLogprob:
    token_bytes = list(token.encode("utf-8", "replace"))
    return TopLogprob(token=token, logprob=_value(entry), bytes=token_bytes)


def prompt_logprobs_body(output: RequestOutput) -> PromptLogprobs | None:
    """The output's prompt logprobs in vLLM's response shape, if it has them."""
    if output.prompt_logprobs is None:
        return None
    return [
        None if entries is None else {
            token_id: PromptLogprob(logprob=_value(entry), rank=entry.rank,
                                    decoded_token=entry.decoded_token)
            for token_id, entry in entries.items()
        }
        for entries in output.prompt_logprobs
    ]


# ------------------------------------------------------------ whole responses
def completion_choice_text(
    completion: CompletionOutput, output: RequestOutput, prompt: EnginePrompt,
    inputs: EngineInputs, num_top: int,
) -> tuple[str, CompletionLogprobs | None]:
    """A completion's text and logprobs as returned: the prompt's first with echo, and
    nothing generated with echo and max_tokens 0."""
    text = "" if inputs.is_echo_only else completion.text
    if not inputs.echo:
        return text, completion_logprobs(completion, num_top, 0)
    text = (prompt.text or "") + text
    if completion.logprobs is None or output.prompt_logprobs is None:
        return text, None
    logprobs = echo_logprobs(prompt, output.prompt_logprobs, num_top)
    if not inputs.is_echo_only:
        offset = sum(len(token) for token in logprobs.tokens)
        generated = completion_logprobs(completion, num_top, offset)
        assert generated is not None
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(logprobs, name).extend(getattr(generated, name))
    return text, logprobs


def completion_response(
    response_id: str, created: int, model: str, outputs: list[RequestOutput],
    inputs: EngineInputs, n: int, num_top: int,
) -> Completion:
    choices = []
    for prompt_index, output in enumerate(outputs):
        prompt = inputs.prompts[prompt_index]
        prompt_logprobs = prompt_logprobs_body(output)
        for completion in output.outputs:
            text, logprobs = completion_choice_text(completion, output, prompt, inputs,
                                                    num_top)
            choices.append(CompletionChoice(
                index=prompt_index * n + completion.index, text=text, logprobs=logprobs,
                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                prompt_logprobs=prompt_logprobs,
            ))
    choices.sort(key=lambda choice: choice.index)
    return Completion(id=response_id, created=created, model=model, choices=choices,
                      usage=usage(outputs), kv_transfer_params=outputs[0].kv_transfer_params)


def chat_response(
    response_id: str, created: int, model: str, output: RequestOutput, inputs: EngineInputs,
    num_top: int,
) -> ChatCompletion:
    choices = [
        ChatChoice(
            index=completion.index,
            message=message,
            logprobs=chat_logprobs(completion, num_top),
            finish_reason=reason,
            stop_reason=completion.stop_reason,
        )
        for completion in output.outputs
        for message, reason in [chat_message(completion, inputs)]
    ]
    return ChatCompletion(id=response_id, created=created, model=model, choices=choices,
                          usage=usage([output]), prompt_logprobs=prompt_logprobs_body(output),
                          kv_transfer_params=output.kv_transfer_params)


def chat_message(completion: CompletionOutput, inputs: EngineInputs
                 ) -> tuple[AssistantMessage, str | None]:
    """The assistant's message (content and tool calls) and the choice's finish reason."""
    assert inputs.output_parser is not None and inputs.tool_plan is not None
    parsed = inputs.output_parser.read(completion.text)
    calls, reasoning = parsed.calls, parsed.reasoning
    reason = finish_reason(inputs.tool_plan, len(calls), completion.finish_reason)
    if not calls:
        content = completion.text if reasoning is None else parsed.content
        return AssistantMessage(content=content, reasoning_content=reasoning), reason
    tool_calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=call.name,
                                                                    arguments=call.arguments))
                  for call in calls]
    return AssistantMessage(content=parsed.content, tool_calls=tool_calls,
                            reasoning_content=reasoning), reason
