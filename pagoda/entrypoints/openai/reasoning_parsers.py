"""`--reasoning-parser`: a thinking model's `<think>...</think>` as `reasoning_content`.

Qwen3 and DeepSeek-R1 write their reasoning between `<think>` and `</think>` (DeepSeek-R1's
template opens the block in the prompt, so the output may lack `<think>`). As vLLM's parsers do,
the text before `</think>` is reasoning and the rest is content; an output without `</think>` is
all reasoning. `ReasoningStream` does the same split on streamed deltas, holding back only the
characters that may be the start of a tag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REASONING_PARSERS = ("qwen3", "deepseek_r1")


@dataclass(frozen=True)
class ReasoningParser:
    """The split rule of one model family (both built-in families use the same tags)."""

    name: str
    start: str = "<think>"
    end: str = "</think>"

    def __post_init__(self) -> None:
        if self.name not in REASONING_PARSERS:
            raise ValueError(
                f"--reasoning-parser {self.name!r} is not available; pagoda has "
                f"{', '.join(REASONING_PARSERS)}"
            )

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for an empty part."""
        before, tag, after = text.partition(self.start)
        text = after if tag else before
        if self.end not in text:
            return text or None, None
        reasoning, _, content = text.partition(self.end)
        return reasoning or None, content or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    return None if name is None else ReasoningParser(name)


def thinking_disabled(template_kwargs: dict[str, Any] | None) -> bool:
    """Whether the request turned thinking off in the template (Qwen3's `enable_thinking`):
    then the output has no reasoning block and is all content."""
    kw = template_kwargs or {}
    return kw.get("enable_thinking") is False or kw.get("thinking") is False


def _held_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


class ReasoningStream:
    """Splits streamed text into reasoning and content deltas."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.in_reasoning = True
        self.seen_start = False
        self.buffer = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta); `final` flushes what was held back."""
        p = self.parser
        if not self.in_reasoning:
            return "", delta
        text = self.buffer + delta
        self.buffer = ""
        if not self.seen_start:
            stripped = text.lstrip()
            if not final and len(stripped) < len(p.start) and p.start.startswith(stripped):
                self.buffer = text  # nothing yet, or what may still become `<think>`
                return "", ""
            if stripped.startswith(p.start):
                text = stripped[len(p.start) :]
            self.seen_start = True
        before, tag, after = text.partition(p.end)
        if tag:
            self.in_reasoning = False
            return before, after
        if final:
            return text, ""
        keep = _held_suffix(text, (p.end,))
        self.buffer = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], ""
