"""Fields OpenAI or vLLM define that kvpool does not honour: a 400 naming the field, not silence.

A client that sends `suffix` or chat's `use_beam_search: true` expects a behaviour; answering as if
the field were absent would hand it a different result without a word. Each entry lists the
values that mean "off" (the field's default): those pass, since many clients send defaults
explicitly; any other value is refused before tokenizing. Fields that change nothing here
(`user`, `store`, `metadata`, `service_tier`, `session_id`, `reasoning_effort`, ...) and fields
no one defines stay ignored, as vLLM ignores unknown fields.

The request bodies keep unknown fields (`model_extra`), which is where these are read from:
none of them is declared in `kvpool/openai/protocol.py`, so none of them can reach the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpool.openai.errors import bad_request
from kvpool.openai.protocol import ChatCompletionRequest, SamplingFields

_VLLM_GUIDED = "was removed from vLLM; use structured_outputs (or response_format)"


@dataclass(frozen=True, slots=True)
class Unsupported:
    """A field and the values of it that ask for nothing (None always does)."""

    field: str
    reason: str
    neutral: tuple[Any, ...] = ()

    def is_neutral(self, value: Any) -> bool:
        return value is None or any(
            type(value) is type(allowed) and value == allowed for allowed in self.neutral
        )


_BOTH = (
    Unsupported("logprob_token_ids", "logprob_token_ids is not supported"),
    Unsupported("truncate_prompt_tokens", "truncate_prompt_tokens is not supported"),
    Unsupported("return_token_ids", "return_token_ids is not supported", (False,)),
    Unsupported("return_tokens_as_token_ids", "return_tokens_as_token_ids is not supported",
                (False,)),
    Unsupported("spaces_between_special_tokens",
                "only spaces_between_special_tokens true is supported", (True,)),
    Unsupported("watermarking", "watermarking is not supported", (False,)),
    Unsupported("prompt_embeds", "prompt_embeds is not supported"),
    Unsupported("ec_transfer_params", "ec_transfer_params is not supported"),
    Unsupported("vllm_xargs", "vllm_xargs is not supported"),
    Unsupported("repetition_detection", "repetition_detection is not supported"),
    Unsupported("thinking_token_budget", "thinking_token_budget is not supported", (-1,)),
    Unsupported("stream_interval", "stream_interval is not supported", (1,)),
    Unsupported("mm_processor_kwargs", "multimodal input is not supported"),
    Unsupported("media_io_kwargs", "multimodal input is not supported"),
    *(Unsupported(name, f"{name} {_VLLM_GUIDED}") for name in (
        "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "guided_decoding_backend", "guided_whitespace_pattern",
    )),
)

_COMPLETION_ONLY = (
    Unsupported("suffix", "suffix (insertion) is not supported"),
)

_CHAT_ONLY = (
    Unsupported("use_beam_search", "beam search is served on /v1/completions only", (False,)),
    Unsupported("length_penalty", "length_penalty (beam search) is served on /v1/completions "
                "only", (1, 1.0)),
    Unsupported("functions", "functions is deprecated and not supported; use tools"),
    Unsupported("function_call", "function_call is deprecated and not supported; use "
                "tool_choice"),
    Unsupported("audio", "audio output is not supported"),
    Unsupported("modalities", "only the text modality is supported", (["text"],)),
    Unsupported("prediction", "predicted outputs are not supported"),
    Unsupported("web_search_options", "web search is not supported"),
    Unsupported("echo", "chat echo is not supported", (False,)),
    Unsupported("chat_template", "a per-request chat_template is not supported; start the "
                "server with --chat-template"),
)


def check_supported(request: SamplingFields) -> None:
    """400 for the first field this request sets to a value kvpool cannot honour."""
    extra = request.model_extra or {}
    entries = _BOTH + (_CHAT_ONLY if isinstance(request, ChatCompletionRequest)
                       else _COMPLETION_ONLY)
    for entry in entries:
        if not entry.is_neutral(extra.get(entry.field)):
            raise bad_request(entry.reason, entry.field)
