"""The chat pipeline's errors, renamed for a Responses client.

A Responses request runs as a chat request (`convert.py`), so a check deep in the chat path
names the chat field (`max_completion_tokens`, `tools[0].function.parameters`); the client
wrote `max_output_tokens` and `tools[0].parameters`. `responses_error` renames the field in
`param`, and in the message where the name cannot be an ordinary word.
"""

from __future__ import annotations

import re

from kvpool.openai.errors import OpenAIError

# (chat field pattern, the Responses field); patterns anchored with ^ rename `param` only.
_RENAMED = (
    (r"^(messages|prompt)\b", "input"),
    (r"\bmax_completion_tokens\b|\bmax_tokens\b", "max_output_tokens"),
    (r"\bresponse_format\.json_schema\.schema\b", "text.format.schema"),
    (r"\bresponse_format(\.json_schema)?\b", "text.format"),
    (r"\btools\[(\d+)\]\.function\.", r"tools[\1]."),
    (r"\btool_choice\.function\.", "tool_choice."),
)


def responses_error(error: OpenAIError) -> OpenAIError:
    """`error` with the chat fields it names renamed to the Responses fields."""
    if error.param is None:
        return error
    param, message = error.param, error.message
    for pattern, name in _RENAMED:
        param = re.sub(pattern, name, param)
        if not pattern.startswith("^"):
            message = re.sub(pattern, name, message)
    return OpenAIError(error.status_code, message, param, error.error_type, error.headers)
