"""Tool calling for /v1/chat/completions: what `tools` and `tool_choice` ask for (`choice`),
how the prompt shows the tools (`prompt`), how the output is read back into calls (`parser`,
`hermes`, `output`)."""

from kvpool.openai.tools import hermes  # noqa: F401  (registers the "hermes" parser)
from kvpool.openai.tools.parser import get_tool_parser, tool_parser_names

DEFAULT_TOOL_PARSER = "hermes"

__all__ = ["DEFAULT_TOOL_PARSER", "get_tool_parser", "tool_parser_names"]
