"""Tool calls the grammar forced (`tool_choice` required or named): the output is pure JSON.

Named: the output is the arguments object of that one tool. Required: a JSON array of
`{"name", "parameters"}` objects (the schema `ChatCompletionRequest.tool_call_schema` builds).
Nothing is content, so a stream holds everything back until the end.
"""

from __future__ import annotations

import json

from pagoda.entrypoints.openai.tool_parsers.base import (
    ParsedToolCall,
    ParseResult,
    ToolParser,
    call_from_json,
)


class ForcedToolParser(ToolParser):
    name = "forced"

    def __init__(self, tool_name: str | None) -> None:
        self.tool_name = tool_name  # None: required (the output names the tools)

    def call_start(self, text: str) -> int | None:
        return 0

    def held_back(self, text: str) -> int:
        return len(text)

    def calls(self, section: str, final: bool) -> list[ParsedToolCall]:
        if not final:
            return []
        if self.tool_name is not None:
            # The grammar guarantees an object unless max_tokens cut it short; the text is
            # returned as the arguments either way, as OpenAI does.
            return [ParsedToolCall(self.tool_name, section.strip())]
        try:
            items = json.loads(section)
        except json.JSONDecodeError:
            return []
        if not isinstance(items, list):
            return []
        calls = [call_from_json(item) for item in items]
        return [c for c in calls if c is not None]

    def parse(self, text: str) -> ParseResult:
        calls = self.calls(text, final=True)
        return ParseResult("" if calls else text, calls)
