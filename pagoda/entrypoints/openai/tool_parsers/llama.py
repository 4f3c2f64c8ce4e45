"""Llama 3.1 / 3.2 JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}`.

The model may start with `<|python_tag|>` and separate parallel calls with `;`. An answer that
does not start with a JSON object is content; one is only known to be a call once complete, so
a stream holds such an answer back until the end.
"""

from __future__ import annotations

import json

from pagoda.entrypoints.openai.tool_parsers.base import (
    ParsedToolCall,
    ToolParser,
    call_from_json,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(PYTHON_TAG) or stripped.startswith("{"):
            return 0
        return None

    def held_back(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or PYTHON_TAG.startswith(stripped):
            return len(text)  # could still become a call
        return 0

    def calls(self, section: str, final: bool) -> list[ParsedToolCall]:
        if not final:
            return []
        text = section.strip().removeprefix(PYTHON_TAG)
        decoder = json.JSONDecoder()
        out, pos = [], 0
        while True:
            while pos < len(text) and text[pos] in " \t\r\n;":
                pos += 1
            if pos == len(text):
                return out
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                return []  # not (only) calls: the whole answer is content
            call = call_from_json(obj)
            if call is None:
                return []
            out.append(call)
