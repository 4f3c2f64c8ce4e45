"""What every tool-call parser gives: `ParsedToolCall`s and content, for whole texts and streams.

A parser finds where the tool-call section of a generated text starts and parses the calls in
it. The content is the text before that section (all of it when no call parses). The streaming
wrapper applies the same rule to deltas: content is shown as soon as no later text can turn it
into a call, and each call as soon as it is complete, so streamed and whole responses agree.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it


@dataclass
class ParseResult:
    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


def call_from_json(obj: object) -> ParsedToolCall | None:
    """`{"name": ..., "arguments" | "parameters": {...}}` → a call; anything else → None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: object = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolParser(ABC):
    """Parses one chat-template family's tool-call syntax."""

    name: str = ""

    @abstractmethod
    def call_start(self, text: str) -> int | None:
        """Where the tool-call section begins, or None when (so far) there is none."""

    @abstractmethod
    def held_back(self, text: str) -> int:
        """How many characters at the end of `text` might still begin a tool-call section."""

    @abstractmethod
    def calls(self, section: str, final: bool) -> list[ParsedToolCall]:
        """The calls of a section; with `final` False only those that later text cannot change."""

    def parse(self, text: str) -> ParseResult:
        start = self.call_start(text)
        if start is None:
            return ParseResult(text)
        calls = self.calls(text[start:], final=True)
        return ParseResult(text[:start] if calls else text, calls)

    def streaming(self) -> StreamingToolParser:
        return StreamingToolParser(self)


class StreamingToolParser:
    """Feeds deltas to a parser: content when it is certain, each call once it is complete."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content_sent = 0  # characters of content already returned
        self.calls_sent = 0

    def feed(self, delta: str) -> ParseResult:
        self.text += delta
        start = self.parser.call_start(self.text)
        if start is None:
            return self._content_upto(len(self.text) - self.parser.held_back(self.text))
        out = self._content_upto(start)
        calls = self.parser.calls(self.text[start:], final=False)
        out.tool_calls = calls[self.calls_sent :]
        self.calls_sent = max(self.calls_sent, len(calls))
        return out

    def finish(self) -> ParseResult:
        """The rest, once the text is complete (the same split `parse` gives)."""
        result = self.parser.parse(self.text)
        out = self._content_upto(len(result.content))
        out.tool_calls = result.tool_calls[self.calls_sent :]
        self.calls_sent = len(result.tool_calls)
        return out

    def _content_upto(self, end: int) -> ParseResult:
        if end <= self.content_sent:
            return ParseResult()
        text = self.text[self.content_sent : end]
        self.content_sent = end
        return ParseResult(text)
