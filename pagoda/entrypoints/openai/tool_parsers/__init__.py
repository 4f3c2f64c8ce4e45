"""Tool-call parsers, one per chat-template family, and the choice of one for a model.

`hermes` (`<tool_call>` blocks: Qwen2.5, Qwen3, Hermes) and `llama3_json` (Llama 3.1 / 3.2
JSON). `parser_for_template` picks by what the chat template itself writes; the server's
`--tool-call-parser` overrides it.
"""

from __future__ import annotations

from pagoda.entrypoints.openai.tool_parsers.base import (
    ParsedToolCall,
    ParseResult,
    StreamingToolParser,
    ToolParser,
)
from pagoda.entrypoints.openai.tool_parsers.forced import ForcedToolParser
from pagoda.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagoda.entrypoints.openai.tool_parsers.llama import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(
            f"tool call parser must be one of {', '.join(sorted(TOOL_PARSERS))}, got {name!r}"
        )
    return TOOL_PARSERS[name]()


def parser_for_template(chat_template: str | None) -> ToolParser:
    """The parser for the syntax a chat template teaches; Hermes when it names none."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return HermesToolParser()
    if "<|python_tag|>" in template or '"parameters"' in template:
        return Llama3JsonToolParser()
    return HermesToolParser()


__all__ = [
    "TOOL_PARSERS",
    "ForcedToolParser",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "ParseResult",
    "ParsedToolCall",
    "StreamingToolParser",
    "ToolParser",
    "get_tool_parser",
    "parser_for_template",
]
