"""The OpenAI-compatible server, driven by the official `openai` client over loopback.

Completions and chat, streamed and not (greedy streams reassemble to exactly the non-streamed
text), n > 1, stop strings, logprobs, echo, usage, auth, unknown model, the context-length
error, the 429 / 413 guards, /health, /metrics and /v1/memory.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

openai = pytest.importorskip("openai")

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert models.data[0].max_model_len == 512


def test_completion_stream_reassembles_to_greedy_output(client, server):
    full = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=24, temperature=0
    )
    choice = full.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(
        client.completions.create(
            model=server.model,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
        full.usage.completion_tokens
    )


def test_chat_stream_reassembles_to_greedy_output(client, server):
    full = client.chat.completions.create(
        model=server.model, messages=CHAT, max_completion_tokens=40, temperature=0
    )
    answer = full.choices[0].message.content
    assert "Paris" in answer
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "stop"  # the model ends its answer by itself
    assert full.usage.prompt_tokens > 10

    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=CHAT,
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_chat_accepts_system_assistant_and_content_parts(client, server):
    messages = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": [{"type": "text", "text": "Name a color."}]},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": [{"type": "text", "text": "Another one?"}]},
    ]
    out = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=8, temperature=0
    )
    assert out.choices[0].message.content


def test_n_samples(client, server):
    out = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=6, n=3, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 18 or all(c.finish_reason for c in out.choices)
    again = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=6, n=3, temperature=1.0, seed=7
    )
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded

    chat = client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=5, n=2, temperature=1.0, stream=True
    )
    texts = {0: "", 1: ""}
    for chunk in chat:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert all(texts.values())


def test_multiple_and_token_id_prompts(client, server):
    out = client.completions.create(
        model=server.model, prompt=[PROMPT, "Once upon a time"], max_tokens=4, temperature=0
    )
    assert [c.index for c in out.choices] == [0, 1]
    single = client.completions.create(
        model=server.model, prompt="Once upon a time", max_tokens=4, temperature=0
    )
    assert out.choices[1].text == single.choices[0].text

    ids = httpx.post(
        f"{server.url}/v1/completions",
        headers=server.headers,
        json={"model": server.model, "prompt": PROMPT, "max_tokens": 1, "logprobs": 0},
    ).json()
    assert ids["usage"]["prompt_tokens"] >= 5
    by_ids = client.completions.create(
        model=server.model, prompt=[[1, 504, 3575, 282, 4649, 314]], max_tokens=3, temperature=0
    )
    assert by_ids.usage.prompt_tokens == 6


def test_stop_strings(client, server):
    full = (
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0)
        .choices[0]
        .text
    )
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    expected = full[: full.index(stop)]
    out = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop]
    ).choices[0]
    assert out.text == expected
    assert out.finish_reason == "stop"
    assert out.model_extra["stop_reason"] == stop
    streamed = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_completion_logprobs_and_echo(client, server):
    out = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3, echo=True
    )
    choice = out.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    n_prompt = out.usage.prompt_tokens
    # echo: the prompt's tokens (the first without a log-prob) come before the generated ones
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == choice.text
    assert "".join(lp.tokens[n_prompt:]) == choice.text[len(PROMPT) :]
    assert lp.text_offset[n_prompt] == len(PROMPT)
    for i, (token, logprob, top) in enumerate(
        zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)
    ):
        if i == 0:
            continue
        assert logprob <= 0
        assert 3 <= len(top) <= 4
        assert top[token] == pytest.approx(logprob)
        if i >= n_prompt:
            assert max(top.values()) == pytest.approx(logprob)  # greedy: the sampled is top 1


def test_chat_logprobs(client, server):
    out = client.chat.completions.create(
        model=server.model,
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2
        assert c.top_logprobs[0].token == c.token  # greedy
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert bytes(c.bytes).decode() == c.token


def test_auth_failure(server):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=server.model, prompt="x", max_tokens=1)
    assert e.value.status_code == 401
    r = httpx.get(f"{server.url}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200  # not behind the key


def test_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-17", prompt="x", max_tokens=1)
    assert e.value.status_code == 404
    assert e.value.body["code"] == "model_not_found"


def test_context_length_error_states_the_numbers(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=600)
    message = e.value.body["message"]
    assert "512" in message and "605" in message and "600" in message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="hello " * 600, max_tokens=1)
    assert "512" in e.value.body["message"]


def test_validation_errors_are_openai_shaped(server):
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers=server.headers,
        json={"model": server.model, "messages": [{"role": "user", "content": "hi"}], "n": -1},
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == "n" and err["type"] == "invalid_request_error"


def test_out_of_vocabulary_stop_token_is_a_400_not_an_engine_failure(server):
    body = {"model": server.model, "prompt": "hi", "max_tokens": 4, "min_tokens": 2}
    url = f"{server.url}/v1/completions"
    r = httpx.post(url, headers=server.headers, json={**body, "stop_token_ids": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
    r = httpx.post(url, headers=server.headers, json={**body, "stop_token_ids": [5]}, timeout=60)
    assert r.status_code == 200


def test_concurrency_limit_and_body_limit(small_server, wait_until_idle):
    url = f"{small_server.url}/v1/completions"
    body = {
        "model": small_server.model,
        "prompt": "Count:",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    first_chunk = threading.Event()
    release = threading.Event()

    def hold_a_slot() -> None:
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    first_chunk.set()
                    release.wait(30)
                    return  # leave mid-stream: the request is aborted

    t = threading.Thread(target=hold_a_slot)
    t.start()
    try:
        assert first_chunk.wait(60)
        r = httpx.post(url, json={**body, "stream": False, "max_tokens": 1}, timeout=30)
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert httpx.get(f"{small_server.url}/v1/models").status_code == 200  # not limited
    finally:
        release.set()
        t.join(60)
    r = httpx.post(
        url,
        content=b"{" + b" " * 5000 + b"}",
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413
    live = wait_until_idle(small_server.url, {})
    assert live["num_free_blocks"] == live["num_blocks"]
    r = httpx.post(url, json={**body, "stream": False, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200  # the slot came back


def test_health_metrics_memory(client, server):
    client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3)
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{server.url}/metrics").text
    for name in (
        "pagoda_num_requests_running",
        "pagoda_num_requests_waiting",
        "pagoda_kv_cache_usage_perc",
        "pagoda_kv_cache_free_blocks",
        "pagoda_prefix_cache_hit_rate",
        "pagoda_time_to_first_token_seconds_bucket",
        "pagoda_inter_token_latency_seconds_bucket",
        "pagoda_e2e_request_latency_seconds_count",
        "pagoda_prompt_tokens_total",
        "pagoda_generation_tokens_total",
    ):
        assert name in metrics, name
    mem = httpx.get(f"{server.url}/v1/memory", headers=server.headers).json()
    for key in (
        "weights_bytes",
        "kv_cache_bytes",
        "num_blocks",
        "block_size",
        "kv_token_capacity",
        "load_time_s",
        "live",
    ):
        assert key in mem, key
    assert mem["live"]["num_blocks"] == mem["num_blocks"]


def test_return_token_ids(server):
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    url = f"{server.url}/v1/completions"
    plain = httpx.post(url, headers=server.headers, json=body, timeout=60).json()
    assert "token_ids" not in plain["choices"][0]
    with_ids = httpx.post(
        url, headers=server.headers, json={**body, "return_token_ids": True}, timeout=60
    ).json()["choices"][0]
    assert len(with_ids["token_ids"]) == 4 and len(with_ids["prompt_token_ids"]) >= 5
    with httpx.stream(
        "POST",
        url,
        headers=server.headers,
        timeout=60,
        json={**body, "return_token_ids": True, "stream": True},
    ) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == with_ids["token_ids"]


def test_model_without_tokenizer_streams_token_ids(tmp_path, serve_app):
    from pagoda.engine.args import EngineArgs
    from pagoda.engine.engine_process import start_engine
    from pagoda.entrypoints.openai.server import build_app
    from tests.helpers import save_tiny_model

    path = save_tiny_model("llama", tmp_path / "tiny")
    engine = start_engine(EngineArgs(model=str(path), skip_tokenizer_init=True, max_model_len=128))
    try:
        with serve_app(build_app(engine, "tiny")) as url:
            body = {
                "model": "tiny",
                "prompt": [5, 6, 7],
                "max_tokens": 5,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
            assert sum(len(e["choices"][0]["token_ids"]) for e in events) == 5
            r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": "text"})
            assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
            r = httpx.post(
                f"{url}/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            )
            assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
    finally:
        engine.shutdown()


def test_serve_cli_parses():
    from pagoda.cli import build_parser

    ns = build_parser().parse_args(
        [
            "serve",
            "--port",
            "0",
            "--api-key",
            "k",
            "--served-model-name",
            "m",
            "--max-concurrent-requests",
            "4",
            "--max-model-len",
            "256",
        ]
    )
    assert (ns.host, ns.port, ns.api_key, ns.served_model_name) == ("127.0.0.1", 0, "k", "m")
    assert ns.max_concurrent_requests == 4 and ns.max_model_len == 256 and ns.model is None
