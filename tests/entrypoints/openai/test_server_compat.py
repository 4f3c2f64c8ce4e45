"""vLLM-compatibility of the server: prompt log-probs / echo, structured outputs, tools, the
tokenizer endpoints, /ping, /version, /v1/models/{id}, vllm: metrics, lenient fields.

Over loopback against the embedded SmolLM2 engine. Constrained outputs are checked against
their schema / regex / choices; echoed log-probs against the log-probs the same engine gives
the same tokens when it generates them.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re

import httpx
import pytest
from pydantic import BaseModel, Field

PROMPT = "The capital of France is"
# Structured outputs (and forced tool calls) need the grammar library (`structured` extra).
needs_grammar = pytest.mark.skipif(
    importlib.util.find_spec("xgrammar") is None, reason="xgrammar is not installed"
)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


class City(BaseModel):
    name: str
    # Bounded: without a bound the 135M model can write digits until max_tokens (the grammar
    # keeps the JSON valid, not short).
    population: int = Field(ge=0, le=99_999_999)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
        },
    },
}


def _post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", headers=server.headers, json=body, timeout=120, **kw)


def _stream_events(server, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream(
        "POST", f"{server.url}{path}", headers=server.headers, json=body, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


# ------------------------------------------------------------------ prompt log-probs and echo


def test_echo_logprobs_score_the_prompt_like_generation_does(server):
    # Greedy continuation with its log-probs ...
    gen = _post(
        server,
        "/v1/completions",
        {"model": server.model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1},
    ).json()
    choice = gen["choices"][0]
    cont_lps = choice["logprobs"]["token_logprobs"]
    n_prompt = gen["usage"]["prompt_tokens"]
    # ... then lm-eval's loglikelihood request on prompt + continuation.
    score = _post(
        server,
        "/v1/completions",
        {
            "model": server.model,
            "prompt": PROMPT + choice["text"],
            "max_tokens": 1,
            "logprobs": 1,
            "echo": True,
            "temperature": 0,
        },
    ).json()
    sc = score["choices"][0]
    lp = sc["logprobs"]
    n_all = score["usage"]["prompt_tokens"]
    assert sc["text"].startswith(PROMPT + choice["text"])
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == n_all + 1  # + the generated one
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x is not None and x <= 0 for x in lp["token_logprobs"][1:])
    if n_all == n_prompt + len(cont_lps):  # the texts re-tokenize to the same tokens
        echoed = lp["token_logprobs"][n_prompt:n_all]
        assert echoed == pytest.approx(cont_lps, abs=1e-3)
        # greedy tokens are the top-1 of their position: lm-eval's is_greedy holds
        for tok_lp, top in zip(echoed, lp["top_logprobs"][n_prompt:n_all], strict=True):
            assert tok_lp == pytest.approx(max(top.values()), abs=1e-6)
    assert "".join(lp["tokens"][:n_all]) == PROMPT + choice["text"]
    assert lp["text_offset"][1] == len(lp["tokens"][0])


def test_echo_with_max_tokens_0_scores_only_and_prompt_logprobs_field(server):
    r = _post(
        server,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0, "prompt_logprobs": 2},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    c = body["choices"][0]
    assert c["text"] == PROMPT and body["usage"]["completion_tokens"] == 0
    n = body["usage"]["prompt_tokens"]
    assert len(c["logprobs"]["token_logprobs"]) == n
    plp = c["prompt_logprobs"]
    assert len(plp) == n and plp[0] is None
    for entry, lp in zip(plp[1:], c["logprobs"]["token_logprobs"][1:], strict=True):
        assert 2 <= len(entry) <= 3  # the prompt token + the top 2
        assert lp in [e["logprob"] for e in entry.values()]
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_streamed_echo_with_logprobs(server):
    events = _stream_events(
        server,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 1, "stream": True},
    )
    first = events[0]["choices"][0]
    assert first["text"] == PROMPT and first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) > 1


def test_chat_prompt_logprobs(server):
    r = _post(
        server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0}
    )
    body = r.json()
    assert body["prompt_logprobs"][0] is None
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    r = _post(
        server,
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0, "stream": True},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


# ------------------------------------------------------------------ structured outputs


@needs_grammar
@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_and_json_object(server, stream):
    schema = City.model_json_schema()
    for fmt, question in (
        (
            {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}},
            "Give me a city as JSON.",
        ),
        # json_object only bounds the syntax: a prompt that asks for a short object
        ({"type": "json_object"}, 'Repeat this JSON object exactly: {"city": "Paris"}'),
    ):
        body = {
            "messages": [{"role": "user", "content": question}],
            "response_format": fmt,
            "max_tokens": 60,
            "temperature": 0,
            "stream": stream,
        }
        if stream:
            events = _stream_events(server, "/v1/chat/completions", body)
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
            finish = events[-1]["choices"][0]["finish_reason"]
        else:
            c = _post(server, "/v1/chat/completions", body).json()["choices"][0]
            text, finish = c["message"]["content"], c["finish_reason"]
        assert finish == "stop", text
        if fmt["type"] == "json_schema":
            City.model_validate_json(text)
        else:
            assert isinstance(json.loads(text), dict)


@needs_grammar
def test_guided_fields_and_structured_outputs(server):
    base = {"prompt": "My favourite colour is", "max_tokens": 12, "temperature": 0}
    r = _post(server, "/v1/completions", {**base, "guided_choice": ["red", "green", "blue"]})
    assert r.json()["choices"][0]["text"] in ("red", "green", "blue")
    r = _post(server, "/v1/completions", {**base, "guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.json()["choices"][0]["text"])
    schema = json.dumps(City.model_json_schema())
    r = _post(server, "/v1/completions", {**base, "max_tokens": 60, "guided_json": schema})
    City.model_validate_json(r.json()["choices"][0]["text"])
    r = _post(
        server,
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")
    r = _post(
        server,
        "/v1/completions",
        {**base, "guided_grammar": 'root ::= "a" | "b"'},
    )
    assert r.json()["choices"][0]["text"] in ("a", "b")


@needs_grammar
def test_structured_output_errors_name_the_field(server):
    base = {"prompt": "x", "max_tokens": 2}
    cases = [
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"structured_outputs": {"json": {}, "bogus": 1}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"guided_regex": "("}, "structured_outputs"),
    ]
    for extra, name in cases:
        r = _post(server, "/v1/completions", {**base, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert name in r.json()["error"]["message"], (extra, r.text)


# ------------------------------------------------------------------ tools


def _tool_body(tool_choice, stream=False, **kw) -> dict:
    return {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER_TOOL, TIME_TOOL],
        "tool_choice": tool_choice,
        "max_tokens": 80,
        "temperature": 0,
        "stream": stream,
        **kw,
    }


def _streamed_tool_calls(events: list[dict]) -> tuple[list[dict], str | None]:
    calls: dict[int, dict] = {}
    for e in events:
        for c in e["choices"]:
            for tc in c["delta"].get("tool_calls") or []:
                slot = calls.setdefault(tc["index"], {"name": "", "arguments": "", "id": None})
                slot["id"] = slot["id"] or tc.get("id")
                slot["name"] += tc["function"].get("name") or ""
                slot["arguments"] += tc["function"].get("arguments") or ""
    return [calls[i] for i in sorted(calls)], events[-1]["choices"][0]["finish_reason"]


@needs_grammar
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_calls_are_schema_valid_streamed_and_not(server, choice):
    c = _post(server, "/v1/chat/completions", _tool_body(choice)).json()["choices"][0]
    assert c["finish_reason"] == "tool_calls", c
    calls = c["message"]["tool_calls"]
    assert calls and c["message"]["content"] is None
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        args = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            assert set(args) == {"city", "unit"} and args["unit"] in ("C", "F")
        else:
            assert call["function"]["name"] == "get_time" and "zone" in args
    if isinstance(choice, dict):
        assert [x["function"]["name"] for x in calls] == ["get_weather"]
    streamed, finish = _streamed_tool_calls(
        _stream_events(server, "/v1/chat/completions", _tool_body(choice, stream=True))
    )
    assert finish == "tool_calls"
    assert [(s["name"], json.loads(s["arguments"])) for s in streamed] == [
        (x["function"]["name"], json.loads(x["function"]["arguments"])) for x in calls
    ]
    assert all(s["id"] for s in streamed)


def test_tool_round_trip_history_and_tool_choice_none(server):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
    }
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
    ]
    for choice in ("auto", "none"):
        r = _post(
            server,
            "/v1/chat/completions",
            {"messages": messages, "tools": [WEATHER_TOOL], "tool_choice": choice, "max_tokens": 8},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    bad = _post(
        server,
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"


# A small Hermes-style template (the shape Qwen2.5's uses): tools in the system turn, calls as
# <tool_call> blocks with the arguments rendered as a mapping, tool results as responses.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t.function | tojson }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'tool' %}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% else %}{{ m.content }}{% endif %}"
    '{% for c in m.tool_calls or [] %}<tool_call>\n{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}'
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tools_and_history_reach_the_template(server):
    # /tokenize renders exactly as the chat endpoint does.
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    body = {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "tools": [WEATHER_TOOL],
        "chat_template": TOOL_TEMPLATE,
        "return_token_strs": True,
    }
    r = httpx.post(f"{server.url}/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": r.json()["tokens"]}).json()[
        "prompt"
    ]
    assert '"name": "get_weather"' in text and "The current weather of a city" in text
    # arguments arrive as JSON text and reach the template as a mapping (not a string)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    r = _post(server, "/v1/chat/completions", {**body, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_template_that_drops_tools_is_named_at_start_up_and_in_the_response(
    server, async_engine, caplog
):
    import asyncio

    from pagoda.entrypoints.openai.serving_chat import TOOLS_DROPPED, OpenAIServingChat
    from pagoda.entrypoints.openai.serving_engine import ServingOptions

    # SmolLM2's own template renders no tools: start-up warns (the lifespan hook's check) ...
    chat = OpenAIServingChat(async_engine, "m", metrics=None)
    with caplog.at_level(logging.WARNING, logger="pagoda"):
        asyncio.run(chat.check_template())
    assert TOOLS_DROPPED in caplog.text
    # ... and a request with tools and tool_choice "auto" carries the note, streamed or not
    body = {"messages": CHAT, "tools": [WEATHER_TOOL], "tool_choice": "auto", "max_tokens": 2}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["warnings"] == [TOOLS_DROPPED]
    assert "does not render `tools`" in r.headers["warning"]
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", headers=server.headers,
        json={**body, "stream": True}, timeout=120,
    ) as s:  # fmt: skip
        assert s.status_code == 200 and "does not render `tools`" in s.headers["warning"]
        s.read()
    # no note where the template renders the tools, or where no tool is offered
    for quiet in ({**body, "chat_template": TOOL_TEMPLATE}, {"messages": CHAT, "max_tokens": 2}):
        r = _post(server, "/v1/chat/completions", quiet)
        assert r.status_code == 200 and "warnings" not in r.json() and "warning" not in r.headers
    # a server started with a template that renders tools says nothing
    caplog.clear()
    options = ServingOptions(chat_template=TOOL_TEMPLATE)
    with caplog.at_level(logging.WARNING, logger="pagoda"):
        asyncio.run(OpenAIServingChat(async_engine, "m", None, options=options).check_template())
    assert TOOLS_DROPPED not in caplog.text


def test_chat_template_and_kwargs_are_honored(server):
    template = (
        "{% for m in messages %}[{{ m.role }}|{{ greeting }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    body = {
        "messages": CHAT,
        "chat_template": template,
        "chat_template_kwargs": {"greeting": "salut"},
    }
    r = httpx.post(f"{server.url}/tokenize", json=body, timeout=60)
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": r.json()["tokens"]}).json()[
        "prompt"
    ]
    assert text == "[user|salut] What is the capital of France?\n[assistant]"
    r = _post(server, "/v1/chat/completions", {**body, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(
        httpx.post(f"{server.url}/tokenize", json=body).json()["tokens"]
    )
    bad = _post(server, "/v1/chat/completions", {**body, "chat_template": "{{ 1 / 0 }}"})
    assert bad.status_code == 400 and "chat_template" in bad.json()["error"]["message"]


# ------------------------------------------------------------------ sampling fields


def test_bad_words_allowed_token_ids_truncate(server):
    base = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    plain = _post(server, "/v1/completions", base).json()["choices"][0]
    r = _post(server, "/v1/completions", {**base, "allowed_token_ids": [29892, 30]})
    ids = r.json()["choices"][0]["token_ids"]
    assert ids and set(ids) <= {29892, 30}
    word = plain["text"].split()[0]
    r = _post(server, "/v1/completions", {**base, "bad_words": [word]})
    assert word not in r.json()["choices"][0]["text"].split()[:1]
    r = _post(server, "/v1/completions", {**base, "truncate_prompt_tokens": 2})
    assert r.json()["usage"]["prompt_tokens"] == 2
    long = _post(
        server,
        "/v1/completions",
        {**base, "prompt": "word " * 700, "truncate_prompt_tokens": -1, "max_tokens": 1},
    )
    assert long.status_code == 200, long.text
    assert long.json()["usage"]["prompt_tokens"] == 511  # max_model_len 512 - 1


def test_lenient_numbers_missing_model_and_refusals(server, caplog):
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3.0, "n": 1.0})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == server.model
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": "3"})
    assert r.status_code == 400
    for field, value in [
        ("use_beam_search", True),
        ("functions", []),
        ("logits_processors", ["x"]),
    ]:
        r = _post(server, "/v1/chat/completions", {"messages": CHAT, field: value})
        assert r.status_code == 400 and field in r.json()["error"]["message"], (field, r.text)
    with caplog.at_level(logging.WARNING, logger="pagoda"):
        r = _post(
            server,
            "/v1/chat/completions",
            {"messages": CHAT, "max_tokens": 1, "user": "u1", "made_up_field": 1},
        )
    assert r.status_code == 200
    assert "ignoring the request fields user (end-user ids are not used), made_up_field" in (
        caplog.text
    )


# ------------------------------------------------------------------ endpoints


def test_tokenizer_endpoints(server):
    r = httpx.post(
        f"{server.url}/tokenize", json={"prompt": "hello world", "return_token_strs": True}
    )
    body = r.json()
    assert body["count"] == len(body["tokens"]) >= 2 and body["max_model_len"] == 512
    assert len(body["token_strs"]) == body["count"]
    d = httpx.post(f"{server.url}/detokenize", json={"tokens": body["tokens"]}).json()
    assert d["prompt"] == "hello world"
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["eos_token"] and info["chat_template"]
    # lm-eval's remote tokenizer: the eos token's text tokenizes to its id
    eos = httpx.post(
        f"{server.url}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}
    ).json()["tokens"]
    assert eos == [info["eos_token_id"]]
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    bad = httpx.post(f"{server.url}/tokenize", json={"prompt": 5})
    assert bad.status_code == 400


def test_ping_version_model_by_id_and_vllm_metrics(server):
    assert httpx.get(f"{server.url}/ping").status_code == 200
    assert httpx.post(f"{server.url}/ping").status_code == 200
    from pagoda import __version__

    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}
    r = httpx.get(f"{server.url}/v1/models/{server.model}", headers=server.headers)
    assert r.json()["id"] == server.model and r.json()["object"] == "model"
    r = httpx.get(f"{server.url}/v1/models/gpt-9", headers=server.headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:time_per_output_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert name in text, name
    # labels as vLLM 0.34 sets them (model_name, engine), in whatever order the exposition has
    success = re.findall(r"^vllm:request_success_total\{([^}]*)\} (\S+)$", text, re.M)
    assert any(
        'finished_reason="length"' in labels and 'engine="0"' in labels and float(v) >= 1
        for labels, v in success
    ), text
    m = re.search(r"^vllm:generation_tokens_total\{([^}]*)\} (\S+)$", text, re.M)
    assert m and 'model_name="' in m.group(1) and float(m.group(2)) >= 3
