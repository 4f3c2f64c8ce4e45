"""Hermes-style tool calls, as Qwen2.5 / Qwen3 templates ask for them.

`<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, one block per call, several
blocks for parallel calls. The content is what comes before the first block.
"""

from __future__ import annotations

import json

from pagoda.entrypoints.openai.tool_parsers.base import (
    ParsedToolCall,
    ToolParser,
    call_from_json,
    partial_marker_len,
)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def call_start(self, text: str) -> int | None:
        i = text.find(START)
        return None if i < 0 else i

    def held_back(self, text: str) -> int:
        return partial_marker_len(text, START)

    def calls(self, section: str, final: bool) -> list[ParsedToolCall]:
        out = []
        for block in section.split(START)[1:]:
            body, closed, _ = block.partition(END)
            if not closed and not final:
                break  # still being written
            try:
                call = call_from_json(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is not None:
                out.append(call)
        return out
