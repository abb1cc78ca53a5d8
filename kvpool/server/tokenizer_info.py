"""`GET /tokenizer_info`: the served tokenizer's configuration, as vLLM serves it behind
`--enable-tokenizer-info-endpoint` (off by default: the chat template and special tokens are
more than most clients need to see). Like every route but /health and /ping, it needs a key
when keys are configured.

The body is `tokenizer_class` plus the tokenizer's own configuration (transformers'
`init_kwargs`: special tokens, `model_max_length`, added tokens…) made JSON-safe, the chat
template the server renders with (`--chat-template` or the model's), and `vocab_size`.
Local file paths the tokenizer was read from are left out: they describe the server's disk.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from kvpool.openai.errors import bad_request

router = APIRouter()

_LOCAL_KEYS = frozenset({"name_or_path", "vocab_file", "merges_file", "tokenizer_file",
                         "special_tokens_map_file", "tokenizer_config_file"})


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict[str, Any]:
    state = request.app.state.kvpool
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise bad_request("this model has no tokenizer", "model")
    hf_tokenizer = tokenizer.hf_tokenizer
    config = {key: _json_safe(value) for key, value in hf_tokenizer.init_kwargs.items()
              if key not in _LOCAL_KEYS}
    chat_template = state.config.chat_template or getattr(hf_tokenizer, "chat_template", None)
    return {"tokenizer_class": type(hf_tokenizer).__name__, **config,
            "chat_template": chat_template, "vocab_size": len(hf_tokenizer)}


def _json_safe(value: Any) -> Any:
    """Plain JSON values as they are; containers converted item by item; anything else (an
    AddedToken, an enum) as its `content` or its text."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return getattr(value, "content", None) or str(value)
