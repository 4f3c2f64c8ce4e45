"""Fuzzing the live server with malformed requests: never a 5xx, and it keeps serving.

A seeded generator mutates valid completion and chat bodies (wrong types, missing fields,
negative and huge numbers, NaN, bad nesting), sends broken bytes (truncated or invalid JSON,
non-UTF-8, deep nesting), wrong content types, oversized bodies, bad keys, paths and methods.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import httpx

NUM_REQUESTS = 1200

# fmt: off
BAD_VALUES = [
    None, True, False, 0, -1, -(10**30), 10**30, 1.5, -0.5, 1e308, "", "x", "1", "🙂" * 3,
    [], [None], [1, "a"], [[[]]], [-5], [10**6], {}, {"a": 1}, {"type": "text"}, "\u0000",
]
SAMPLING_FIELDS = [
    "model", "n", "best_of", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
    "min_tokens", "skip_special_tokens", "include_stop_str_in_output", "stream",
    "stream_options", "user", "logit_bias", "max_tokens",
    # vLLM's extensions and the structured-output fields
    "prompt_logprobs", "truncate_prompt_tokens", "bad_words", "allowed_token_ids",
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "spaces_between_special_tokens", "request_id", "priority",
    "use_beam_search", "metadata",
]
COMPLETION_FIELDS = [
    *SAMPLING_FIELDS, "prompt", "echo", "logprobs", "suffix", "add_special_tokens",
]
CHAT_FIELDS = [
    *SAMPLING_FIELDS, "messages", "max_completion_tokens", "logprobs", "top_logprobs",
    "tools", "tool_choice", "add_generation_prompt", "continue_final_message",
    "parallel_tool_calls", "chat_template", "chat_template_kwargs", "documents", "echo",
    "add_special_tokens", "functions", "modalities",
]
TOKENIZE_FIELDS = [
    "model", "prompt", "messages", "add_special_tokens", "return_token_strs",
    "add_generation_prompt", "chat_template", "chat_template_kwargs", "tools",
]
DETOKENIZE_FIELDS = ["model", "tokens"]
# Structured values that are almost right: wrong shapes inside the new nested fields.
NESTED_BAD = {
    "response_format": [
        {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 5}},
        {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}},
        {"type": "xml"}, {"type": "json_object", "json_schema": []},
    ],
    "structured_outputs": [
        {"json": 5}, {"regex": "("}, {"choice": []}, {"grammar": "root ::= "},
        {"json": {}, "regex": "a"}, {"json_object": False}, {"bogus": 1},
    ],
    "guided_json": ["{", "[]", {"type": "nonsense"}, {"properties": 5}],
    "guided_regex": ["(", "[", "a{99999999}"],
    "guided_grammar": ["root ::= ", "no rules here", "root ::= undefined_rule"],
    "tools": [
        [{"type": "function"}], [{"type": "function", "function": {"name": ""}}],
        [{"type": "code", "function": {"name": "f"}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
    ],
    "tool_choice": [
        "required", {"type": "function", "function": {"name": "nope"}}, {"type": "function"},
    ],
    "chat_template": ["{% for %}", "{{ 1 / 0 }}", "{{ raise_exception('x') }}", "{{ x.y.z }}"],
    "chat_template_kwargs": [{"tools": 1}, {"a": [1, 2]}],
}
BAD_PARTS = [
    {"type": "text"}, {"type": "video", "text": "x"}, {"text": "x"}, 5,
    {"type": "image_url", "image_url": 3}, {"type": "image_url", "image_url": {"url": "x"}},
]
BAD_CONTENT_TYPES = [
    "text/plain", "application/x-www-form-urlencoded", "multipart/form-data", "application/xml",
    "", "application/json; charset=latin-1",
]
BAD_AUTH = [
    {}, {"Authorization": "Bearer nope"}, {"Authorization": "{key}"},
    {"Authorization": "Basic dGVzdA=="},
]
# fmt: on
# Values that are valid but would make the request long-running are not "malformed".
EXPENSIVE = {"max_tokens": [None], "max_completion_tokens": []}


def _valid(kind: str, model: str) -> dict:
    if kind == "chat":
        return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    # min_tokens makes the sampler index logits with stop_token_ids: bad ids must not reach it
    return {"model": model, "prompt": "hi", "max_tokens": 1, "min_tokens": 1}


def _bad_value(rng: random.Random, field: str):
    if field in NESTED_BAD and rng.random() < 0.6:
        return rng.choice(NESTED_BAD[field])
    choices = [v for v in BAD_VALUES if not any(v is e for e in EXPENSIVE.get(field, []))]
    return rng.choice(choices)


def _mutate_messages(rng: random.Random, body: dict) -> None:
    msg: dict = {"role": "user", "content": "hi"}
    kind = rng.randrange(6)
    if kind == 0:
        msg["role"] = _bad_value(rng, "role")
    elif kind == 1:
        msg["content"] = _bad_value(rng, "content")
    elif kind == 2:
        msg["content"] = [rng.choice(BAD_PARTS)]
    elif kind == 3:
        del msg["role"]
    elif kind == 4:
        body["messages"] = rng.choice([[], {}, "hi", [["user", "hi"]], [None]])
        return
    else:
        msg = {"role": "tool", "content": "x", "tool_call_id": 1}
    body["messages"] = [msg]


def _raw_body(rng: random.Random, model: str) -> bytes:
    valid = json.dumps(_valid("completion", model)).encode()
    kind = rng.randrange(8)
    if kind == 0:
        return valid[: rng.randrange(1, len(valid))]  # truncated
    if kind == 1:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    if kind == 2:
        return b'{"model": "\xff\xfe", "prompt": "hi"}'  # not UTF-8
    if kind == 3:
        depth = rng.choice([50, 1000, 100_000])
        return b'{"model": "m", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    if kind == 4:
        return rng.choice([b"null", b"42", b'"text"', b"[]", b"true", b"", b" "])
    if kind == 5:
        return valid.replace(b'"max_tokens": 1', b'"max_tokens": NaN')
    if kind == 6:
        return valid.replace(b'"prompt": "hi"', b'"prompt": "\\ud800"')  # lone surrogate
    return valid + b"garbage"


def _requests(model: str, key: str):
    """Yield (method, path, headers, body bytes) tuples, deterministically."""
    rng = random.Random(1234)
    auth = {"Authorization": f"Bearer {key}"}
    json_ct = {"content-type": "application/json"}
    for _ in range(NUM_REQUESTS):
        if rng.random() < 0.15:  # the tokenizer endpoints and the small GET ones
            yield _other_endpoint(rng, model, headers={**auth, **json_ct})
            continue
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        kind = "chat" if "chat" in path else "completion"
        headers = {**auth, **json_ct}
        roll = rng.random()
        if roll < 0.55:  # one field with a wrong type or value
            body = _valid(kind, model)
            field = rng.choice(CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS)
            if field == "messages":
                _mutate_messages(rng, body)
            else:
                body[field] = _bad_value(rng, field)
            data = json.dumps(body).encode()
        elif roll < 0.65:  # several bad fields at once / a missing required field
            body = _valid(kind, model)
            for field in rng.sample(CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS, 3):
                body[field] = _bad_value(rng, field)
            body.pop(rng.choice(["model", "messages" if kind == "chat" else "prompt"]), None)
            data = json.dumps(body).encode()
        elif roll < 0.80:
            data = _raw_body(rng, model)
        elif roll < 0.87:  # wrong content type
            headers = {**auth, "content-type": rng.choice(BAD_CONTENT_TYPES)}
            data = json.dumps(_valid(kind, model)).encode()
            if headers["content-type"] == "application/x-www-form-urlencoded":
                data = b"model=x&prompt=hi"
        elif roll < 0.92:  # bad credentials
            headers = {**json_ct, **rng.choice(BAD_AUTH)}
            headers = {k: v.format(key=key) for k, v in headers.items()}
            data = json.dumps(_valid(kind, model)).encode()
        elif roll < 0.96:  # unknown paths and wrong methods
            method = rng.choice(["GET", "PUT", "DELETE", "PATCH"])
            path = rng.choice([path, "/v1/nothing", "/v2/completions", "/v1/models/x", "/"])
            yield method, path, headers, b"{}"
            continue
        elif roll < 0.985:  # an unknown model, a huge but valid-looking prompt
            body = _valid(kind, model)
            body["model"] = rng.choice(["gpt-4", "", model.upper(), model + " "])
            if kind == "completion" and rng.random() < 0.5:
                body["model"] = model
                body["prompt"] = "word " * 5000  # beyond the context
            data = json.dumps(body).encode()
        else:  # oversized: beyond the 8 MiB default limit
            data = b'{"model": "m", "prompt": "' + b"a" * (9 << 20) + b'"}'
        yield "POST", path, headers, data


def _other_endpoint(rng: random.Random, model: str, headers: dict):
    kind = rng.randrange(4)
    if kind == 0:
        body: dict = rng.choice(
            [{"prompt": "hi"}, {"messages": [{"role": "user", "content": "hi"}]}]
        )
        for field in rng.sample(TOKENIZE_FIELDS, rng.randrange(1, 3)):
            if field == "messages":
                _mutate_messages(rng, body)
            else:
                body[field] = _bad_value(rng, field)
        return "POST", "/tokenize", headers, json.dumps(body).encode()
    if kind == 1:
        body = {"model": model, "tokens": [1, 2, 3]}
        body[rng.choice(DETOKENIZE_FIELDS)] = _bad_value(rng, "tokens")
        return "POST", "/detokenize", headers, json.dumps(body).encode()
    if kind == 2:
        return "POST", rng.choice(["/tokenize", "/detokenize"]), headers, _raw_body(rng, model)
    method = rng.choice(["GET", "POST", "PUT", "DELETE"])
    path = rng.choice(
        [
            "/tokenizer_info",
            "/ping",
            "/version",
            f"/v1/models/{model}",
            "/v1/models/%00",
            "/v1/models/" + "x" * 300,
            "/v1/models/a/b",
        ]
    )
    return method, path, headers, b"{}"


def test_fuzz_never_5xx_and_server_survives(server):
    statuses: Counter[int] = Counter()
    failures = []
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for method, path, headers, data in _requests(server.model, server.api_key):
            r = http.request(method, path, headers=headers, content=data)
            statuses[r.status_code] += 1
            if r.status_code >= 500:
                failures.append((path, data[:200], r.status_code, r.text[:300]))
            elif r.status_code >= 400:
                err = r.json()["error"]
                assert err["message"] and err["type"], r.text
    assert sum(statuses.values()) == NUM_REQUESTS
    assert not failures, failures[:5]
    assert statuses[400] > NUM_REQUESTS // 2, statuses  # most are rejected at validation
    assert {401, 404, 413} <= set(statuses), statuses
    # still healthy and serving
    assert httpx.get(f"{server.url}/health").status_code == 200
    r = httpx.post(
        f"{server.url}/v1/completions",
        headers=server.headers,
        json={"model": server.model, "prompt": "The capital of France is", "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"]


def test_fuzz_generator_is_deterministic_and_varied():
    a = [r[3] for r in _requests("m", "k")]
    assert a == [r[3] for r in _requests("m", "k")]
    assert len(a) == NUM_REQUESTS and len(set(a)) > NUM_REQUESTS // 3
