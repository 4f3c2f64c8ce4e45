"""Real client libraries against the server: OpenAI `.parse()`, LangChain, LiteLLM.

Each structured call returns output valid for its schema (the grammar guarantees it even for
the 135M embedded model), streamed and not; `bind_tools` does one tool-call round trip. Skipped
when the client library or xgrammar is not installed (`dev` and `structured` extras).
"""

from __future__ import annotations

import json
import os

import pytest
from pydantic import BaseModel, Field

pytest.importorskip("xgrammar")  # every call here is grammar-constrained


class City(BaseModel):
    """A city and its country."""

    name: str = Field(description="the city's name")
    country: str
    # Bounded: without a bound the 135M model can write digits until max_tokens (the grammar
    # keeps the JSON valid, not short).
    population: int = Field(ge=0, le=99_999_999)


def get_weather(city: str, unit: str) -> str:
    """The current weather in a city.

    Args:
        city: the city
        unit: C or F
    """
    return f"21 {unit} and sunny in {city}"


QUESTION = "Describe Paris as a city record."


def test_openai_parse_with_pydantic_model(client, server):
    out = client.chat.completions.parse(
        model=server.model,
        messages=[{"role": "user", "content": QUESTION}],
        response_format=City,
        max_tokens=120,
        temperature=0,
    )
    assert isinstance(out.choices[0].message.parsed, City)
    with client.chat.completions.stream(
        model=server.model,
        messages=[{"role": "user", "content": QUESTION}],
        response_format=City,
        max_tokens=120,
        temperature=0,
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == out.choices[0].message.parsed  # greedy: same


@pytest.fixture(scope="module")
def chat_model(server):
    lc = pytest.importorskip("langchain_openai")
    return lc.ChatOpenAI(
        base_url=f"{server.url}/v1",
        api_key=server.api_key,
        model=server.model,
        temperature=0,
        max_tokens=120,
        max_retries=0,
    )


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(chat_model, method):
    structured = chat_model.with_structured_output(City, method=method)
    city = structured.invoke(QUESTION)
    assert isinstance(city, City)
    streamed = list(structured.stream(QUESTION))
    assert streamed and City.model_validate(streamed[-1]) == city


def test_langchain_json_mode(chat_model):
    # json_mode only promises a JSON object (OpenAI's contract); the schema is the prompt's job.
    structured = chat_model.with_structured_output(City.model_json_schema(), method="json_mode")
    value = structured.invoke(QUESTION + " Answer in JSON.")
    assert isinstance(value, dict)
    streamed = list(structured.stream(QUESTION + " Answer in JSON."))
    assert streamed[-1] == value


@pytest.mark.parametrize("stream", [False, True])
def test_langchain_bind_tools_round_trip(chat_model, stream):
    from langchain_core.messages import HumanMessage, ToolMessage

    with_tools = chat_model.bind_tools([get_weather], tool_choice="get_weather")
    history = [HumanMessage("What is the weather in Paris?")]
    if stream:
        ai = None
        for chunk in with_tools.stream(history):
            ai = chunk if ai is None else ai + chunk
    else:
        ai = with_tools.invoke(history)
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}
    result = get_weather(**call["args"])
    history += [ai, ToolMessage(result, tool_call_id=call["id"])]
    answer = chat_model.bind_tools([get_weather]).invoke(history)  # tool_choice auto
    assert answer.content or answer.tool_calls


@pytest.fixture(scope="module")
def litellm_module():
    # Offline: LiteLLM must not fetch its model price list at import.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    return pytest.importorskip("litellm")


@pytest.mark.parametrize("stream", [False, True])
def test_litellm_json_mode(server, litellm_module, stream):
    kwargs = dict(
        model=f"openai/{server.model}",
        api_base=f"{server.url}/v1",
        api_key=server.api_key,
        messages=[{"role": "user", "content": QUESTION + " Answer in JSON."}],
        max_tokens=120,
        temperature=0,
    )
    for response_format in ({"type": "json_object"}, City):
        out = litellm_module.completion(**kwargs, response_format=response_format, stream=stream)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in out)
        else:
            text = out.choices[0].message.content
        value = json.loads(text)
        assert isinstance(value, dict)
        if response_format is City:
            City.model_validate(value)
