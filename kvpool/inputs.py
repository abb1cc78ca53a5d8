"""vLLM's prompt types (`from vllm.inputs import TokensPrompt, TextPrompt`): plain dicts, which
`LLM.generate` and the engine take as they are."""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict, total=False):
    """A prompt as text; the engine tokenizes it."""

    prompt: str


class TokensPrompt(TypedDict, total=False):
    """A prompt as token ids (`prompt` is optional text kept with the output)."""

    prompt_token_ids: list[int]
    prompt: str


__all__ = ["TextPrompt", "TokensPrompt"]
