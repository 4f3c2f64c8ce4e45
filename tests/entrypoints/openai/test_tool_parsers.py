"""Tool-call parsers on strings: Hermes blocks, Llama 3 JSON, grammar-forced output, streaming.

Every case is parsed whole and streamed in every split into small deltas; both must give the
same content and calls (streamed content is never taken back).
"""

from __future__ import annotations

import json

import pytest

from pagoda.entrypoints.openai.tool_parsers import (
    ForcedToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    get_tool_parser,
    parser_for_template,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def _streamed(parser, text: str, step: int):
    stream = parser.streaming()
    content, calls = "", []
    for i in range(0, len(text), step):
        out = stream.feed(text[i : i + step])
        content += out.content
        calls += out.tool_calls
    out = stream.finish()
    return content + out.content, calls + out.tool_calls


def _check_stream_agrees(parser, text: str):
    whole = parser.parse(text)
    for step in (1, 2, 3, 7, len(text) or 1):
        assert _streamed(parser, text, step) == (whole.content, whole.tool_calls), step
    return whole


def test_hermes_single_and_parallel_calls():
    text = f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>"
    r = _check_stream_agrees(HermesToolParser(), text)
    assert r.content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in r.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    two = f"<tool_call>{WEATHER}</tool_call>\n<tool_call>" + (
        '{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call>'
    )
    r = _check_stream_agrees(HermesToolParser(), two)
    assert r.content == "" and [c.name for c in r.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(r.tool_calls[1].arguments) == {"tz": "CET"}  # JSON-text arguments


def test_hermes_plain_text_bad_json_and_unclosed_block():
    p = HermesToolParser()
    assert _check_stream_agrees(p, "Paris is the capital. <tool").content.endswith("<tool")
    bad = "<tool_call>{not json}</tool_call>"
    r = _check_stream_agrees(p, bad)
    assert r.tool_calls == [] and r.content == bad  # nothing parsed: all of it is content
    r = _check_stream_agrees(p, f"<tool_call>\n{WEATHER}\n")  # the model stopped before </...>
    assert [c.name for c in r.tool_calls] == ["get_weather"]


def test_hermes_stream_emits_a_call_as_soon_as_its_block_closes():
    stream = HermesToolParser().streaming()
    assert stream.feed("Hi <tool_").content == "Hi "  # "<tool_" may start a marker: held
    out = stream.feed(f"call>{WEATHER}</tool_call>")
    assert out.content == "" and [c.name for c in out.tool_calls] == ["get_weather"]
    assert stream.finish().tool_calls == []  # not emitted twice


def test_llama3_json_calls_and_content():
    p = Llama3JsonToolParser()
    r = _check_stream_agrees(p, '{"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert r.content == "" and json.loads(r.tool_calls[0].arguments) == {"city": "Rome"}
    r = _check_stream_agrees(
        p, '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}'
    )
    assert [c.name for c in r.tool_calls] == ["a", "b"]
    assert _check_stream_agrees(p, "The answer is 4.").content == "The answer is 4."
    assert _check_stream_agrees(p, '{"city": "Rome"}').tool_calls == []  # no name: content


def test_forced_named_and_required():
    named = ForcedToolParser("get_weather")
    r = _check_stream_agrees(named, '{"city": "Oslo"}')
    assert r.content == "" and r.tool_calls[0].name == "get_weather"
    assert json.loads(r.tool_calls[0].arguments) == {"city": "Oslo"}
    required = ForcedToolParser(None)
    r = _check_stream_agrees(
        required, '[{"name": "a", "parameters": {"q": 1}}, {"name": "b", "parameters": {}}]'
    )
    assert [c.name for c in r.tool_calls] == ["a", "b"]
    assert _check_stream_agrees(required, "[{").content == "[{"  # cut short: content


def test_parser_choice():
    assert isinstance(parser_for_template("...<tool_call>..."), HermesToolParser)
    assert isinstance(parser_for_template("{{ '<|python_tag|>' }}"), Llama3JsonToolParser)
    assert isinstance(parser_for_template(None), HermesToolParser)
    assert isinstance(get_tool_parser("llama3_json"), Llama3JsonToolParser)
    with pytest.raises(ValueError, match="tool call parser must be one of hermes, llama3_json"):
        get_tool_parser("mistral")
