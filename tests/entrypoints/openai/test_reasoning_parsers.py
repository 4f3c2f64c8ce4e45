"""`--reasoning-parser` (qwen3, deepseek_r1): whole outputs and every split of a stream."""

import pytest

from pagoda.entrypoints.openai.reasoning_parsers import (
    ReasoningParser,
    get_reasoning_parser,
    thinking_disabled,
)

CASES = [
    ("<think>\nLet me add.\n</think>\n\nIt is 4.", ("\nLet me add.\n", "\n\nIt is 4.")),
    ("Let me add.</think>It is 4.", ("Let me add.", "It is 4.")),  # <think> was in the prompt
    ("<think>still thinking", ("still thinking", None)),  # cut off: all reasoning
    ("no tags at all", ("no tags at all", None)),
    ("<think>done</think>", ("done", None)),
    ("<think>a < b and </thin is not a tag</think>x", ("a < b and </thin is not a tag", "x")),
]


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text,expected", CASES)
def test_extract(name, text, expected):
    assert ReasoningParser(name).extract(text) == expected


@pytest.mark.parametrize("text,expected", CASES)
def test_stream_matches_extract_at_every_split(text, expected):
    parser = ReasoningParser("qwen3")
    for chunk in (1, 2, 3, 5, 7):
        stream = parser.stream()
        reasoning, content = "", ""
        pieces = [text[i : i + chunk] for i in range(0, len(text), chunk)]
        for i, piece in enumerate(pieces):
            r, c = stream.feed(piece, final=i == len(pieces) - 1)
            reasoning += r
            content += c
        assert (reasoning or None, content or None) == expected, chunk


def test_unknown_parser_is_a_clear_error():
    with pytest.raises(ValueError, match="--reasoning-parser 'granite' is not available"):
        get_reasoning_parser("granite")
    assert get_reasoning_parser(None) is None


def test_enable_thinking_false_turns_the_parser_off():
    assert thinking_disabled({"enable_thinking": False})
    assert not thinking_disabled({"enable_thinking": True})
    assert not thinking_disabled(None)
