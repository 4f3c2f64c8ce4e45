"""`/v1/responses`: OpenAI's Responses API (text, streams, function tools, JSON schema output).

A request is translated to the chat pipeline: `instructions` becomes a system message, `input`
items become messages (function calls and their outputs as tool turns), `tools` and
`text.format` become chat tools and `response_format`. The answer is a Response object with
`message`, `function_call` and (with --reasoning-parser) `reasoning` output items; streams send
the typed events (`response.created`, `response.output_text.delta`, ..., `response.completed`).
Responses are not stored, so `previous_response_id` is refused.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field, ValidationError

from pagoda.engine.async_engine import RequestStream
from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints.openai.errors import APIError, validation_error
from pagoda.entrypoints.openai.generation_config import apply_defaults
from pagoda.entrypoints.openai.metrics import RequestTracker
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, Int, _TopLevel, random_id
from pagoda.entrypoints.openai.reasoning_parsers import ReasoningParser, thinking_disabled
from pagoda.entrypoints.openai.serving_chat import OpenAIServingChat
from pagoda.entrypoints.openai.serving_engine import (
    Usage,
    check_stop_token_ids,
    collect,
    max_tokens_for,
    parse_body,
    process_chat_prompt,
)
from pagoda.entrypoints.openai.streaming import (
    EventStream,
    merge,
    sse,
    stream_error,
    unless_disconnected,
)
from pagoda.entrypoints.openai.tool_parsers import ParsedToolCall, ToolParser


class ResponsesRequest(_TopLevel):
    """The fields of `POST /v1/responses` that pagoda acts on (others are logged as ignored)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    request_id: str | None = None

    def to_chat(self) -> dict[str, Any]:
        """The equivalent chat completions body (a ValueError names a field it cannot take)."""
        if self.previous_response_id is not None:
            raise ValueError(
                "previous_response_id: responses are not stored; send the conversation in input"
            )
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = (
            [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        )
        for i, item in enumerate(items):
            messages.extend(_item_messages(i, item))
        body: dict[str, Any] = {"model": self.model, "messages": _merge_tool_calls(messages)}
        for name in (
            "temperature",
            "top_p",
            "seed",
            "stop",
            "top_k",
            "min_p",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [_chat_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        fmt = (self.text or {}).get("format")
        if fmt:
            kind = fmt.get("type")
            if kind == "json_schema":
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {
                        "name": fmt.get("name"),
                        "schema": fmt.get("schema"),
                        "strict": fmt.get("strict"),
                    },
                }
            elif kind == "json_object":
                body["response_format"] = {"type": "json_object"}
            elif kind != "text":
                raise ValueError(
                    f"text.format.type: {kind!r} is not text, json_object or json_schema"
                )
        if self.request_id is not None:
            body["request_id"] = self.request_id
        return body


def _text_of(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content: expected text or a list of parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": part.get("image_url")}})
        else:
            raise ValueError(f"{where}.content[{j}].type: {kind!r} is not supported")
    return parts


def _item_messages(i: int, item: Any) -> list[dict[str, Any]]:
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected an object")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise ValueError(f"{where}.role: {role!r} is not user, assistant, system or developer")
        return [{"role": role, "content": _text_of(item.get("content", ""), where)}]
    if kind == "function_call":
        call = {
            "id": item.get("call_id") or item.get("id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
        }
        return [{"role": "assistant", "content": None, "tool_calls": [call]}]
    if kind == "function_call_output":
        output = item.get("output", "")
        if not isinstance(output, str):
            output = json.dumps(output)
        return [{"role": "tool", "tool_call_id": item.get("call_id"), "content": output}]
    if kind == "reasoning":
        return []  # earlier reasoning is not replayed to the model
    raise ValueError(f"{where}.type: {kind!r} is not supported")


def _merge_tool_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive function_call items are one assistant turn with several tool calls."""
    out: list[dict[str, Any]] = []
    for m in messages:
        prev = out[-1] if out else None
        if (
            m.get("tool_calls")
            and prev is not None
            and prev.get("tool_calls")
            and prev["role"] == "assistant"
        ):
            prev["tool_calls"].extend(m["tool_calls"])
        else:
            out.append(m)
    return out


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise ValueError(
            f"tools[{i}].type: {tool.get('type')!r} is not supported (function tools only)"
        )
    fn = {"name": tool.get("name"), "parameters": tool.get("parameters")}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise ValueError(f"tool_choice: {choice!r} is not supported")


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": random_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _call_item(call: ParsedToolCall) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": random_id("fc"),
        "call_id": random_id("call"),
        "name": call.name,
        "arguments": call.arguments,
        "status": "completed",
    }


def _reasoning_item(text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": random_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


class OpenAIServingResponses(OpenAIServingChat):
    """The Responses endpoint, on the chat pipeline (template, tool parsers, reasoning)."""

    async def create(self, request: Request) -> Response:  # type: ignore[override]
        req = await parse_body(request, ResponsesRequest)
        self.warn_ignored(req, "responses")
        try:
            chat = ChatCompletionRequest.model_validate(req.to_chat(), strict=False)
        except ValidationError as e:
            raise validation_error(e.errors(include_url=False)) from None
        lora = self.check_model(chat.model)
        apply_defaults(chat, self.options.sampling_defaults)
        default_max_tokens = self.options.sampling_defaults.get("max_tokens")
        chat_template = self.options.chat_template
        messages = [m.to_dict() for m in chat.messages]
        limit = self.engine.max_model_len
        requested = chat.requested_max_tokens
        chat.to_sampling_params(max_tokens=None)  # validate before touching the engine
        template_used: list[str | None] = [None]
        rid = random_id("resp") if chat.request_id is None else chat.request_id

        def prepare(engine: LLMEngine) -> list:
            check_stop_token_ids(chat.stop_token_ids, engine.input_processor.vocab_size)
            processed = process_chat_prompt(
                engine,
                messages,
                chat_template=chat_template,
                add_generation_prompt=True,
                continue_final_message=False,
                template_kwargs=chat.template_kwargs(),
                add_special_tokens=chat.add_special_tokens,
            )
            template_used[0] = chat_template or getattr(engine.tokenizer, "chat_template", None)
            n_prompt = len(processed.prompt_token_ids)
            params = chat.to_sampling_params(
                max_tokens_for(n_prompt, requested, default_max_tokens, limit)
            )
            self.log_request(rid, processed.prompt or processed.prompt_token_ids, params)
            return [(processed, params)]

        arrival = time.perf_counter()
        streams = await self.add(prepare, rid, lora)
        trackers = [RequestTracker(self.metrics, arrival)]
        parser = self._parser(chat, template_used[0])
        reasoning = self.reasoning
        if reasoning is not None and thinking_disabled(chat.chat_template_kwargs):
            reasoning = None
        base = self._base(req, rid)
        if req.stream:
            return EventStream(self._stream(base, streams, trackers, parser, reasoning))
        result = await unless_disconnected(request, collect(streams, trackers, 1))
        if result is None:
            return Response(status_code=499)
        ((choice,),), usage = result
        text = "".join(choice.text)
        output = self._output(text, parser, reasoning)
        body = self._finish(base, output, choice.finish_reason, usage)
        return Response(json.dumps(body), media_type="application/json")

    def _base(self, req: ResponsesRequest, rid: str) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "model": self.model_name,
            "output": [],
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": True
            if req.parallel_tool_calls is None
            else req.parallel_tool_calls,
            "text": req.text or {"format": {"type": "text"}},
            "metadata": req.metadata,
            "previous_response_id": None,
            "incomplete_details": None,
            "error": None,
            "usage": None,
        }

    @staticmethod
    def _output(
        text: str, parser: ToolParser | None, reasoning: ReasoningParser | None
    ) -> list[dict[str, Any]]:
        output = []
        if reasoning is not None:
            thought, content = reasoning.extract(text)
            text = content or ""
            if thought:
                output.append(_reasoning_item(thought))
        calls: list[ParsedToolCall] = []
        if parser is not None:
            parsed = parser.parse(text)
            text, calls = parsed.content, parsed.tool_calls
        if text or not calls:
            output.append(_message_item(text))
        output.extend(_call_item(c) for c in calls)
        return output

    @staticmethod
    def _finish(
        base: dict[str, Any], output: list[dict[str, Any]], reason: str | None, usage: Usage
    ) -> dict[str, Any]:
        body = dict(base, output=output, usage=_usage(usage))
        if reason == "length":
            body["status"] = "incomplete"
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            body["status"] = "completed"
        return body

    async def _stream(
        self,
        base: dict[str, Any],
        streams: list[RequestStream],
        trackers: list[RequestTracker],
        parser: ToolParser | None,
        reasoning: ReasoningParser | None,
    ) -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\n" + sse({"type": kind, "sequence_number": seq - 1, **fields})

        usage = Usage()
        yield event("response.created", response=base)
        yield event("response.in_progress", response=base)
        # Text streams live as a message item; tool calls (which need the whole text to be
        # parsed) and reasoning come as complete items at the end.
        stream_text = parser is None
        thinker = reasoning.stream() if reasoning is not None else None
        message = _message_item("", status="in_progress")
        msg_id = message["id"]
        opened = False
        parts: list[str] = []
        thoughts: list[str] = []
        finish: str | None = None
        try:
            async for _, out in merge(streams, trackers):
                usage.add(0, out)
                for c in out.outputs:
                    final = c.finish_reason is not None
                    text = c.text
                    if thinker is not None:
                        thought, text = thinker.feed(text, final)
                        thoughts.append(thought)
                    parts.append(text)
                    if final:
                        finish = c.finish_reason
                    if not stream_text or not text:
                        continue
                    if not opened:
                        opened = True
                        yield event("response.output_item.added", output_index=0, item=message)
                        yield event(
                            "response.content_part.added",
                            item_id=msg_id,
                            output_index=0,
                            content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []},
                        )
                    yield event(
                        "response.output_text.delta",
                        item_id=msg_id,
                        output_index=0,
                        content_index=0,
                        delta=text,
                        logprobs=[],
                    )
            text = "".join(parts)
            thought = "".join(thoughts)
            output: list[dict[str, Any]] = []
            if thought:
                output.append(_reasoning_item(thought))
            calls: list[ParsedToolCall] = []
            if parser is not None:
                parsed = parser.parse(text)
                text, calls = parsed.content, parsed.tool_calls
            if stream_text or text or not calls:
                done = dict(message, status="completed")
                done["content"] = [
                    {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                ]
                index = len(output)
                if not opened:
                    yield event("response.output_item.added", output_index=index, item=message)
                    yield event(
                        "response.content_part.added",
                        item_id=msg_id,
                        output_index=index,
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []},
                    )
                    if text:
                        yield event(
                            "response.output_text.delta",
                            item_id=msg_id,
                            output_index=index,
                            content_index=0,
                            delta=text,
                            logprobs=[],
                        )
                yield event(
                    "response.output_text.done",
                    item_id=msg_id,
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
                yield event(
                    "response.content_part.done",
                    item_id=msg_id,
                    output_index=index,
                    content_index=0,
                    part=done["content"][0],
                )
                yield event("response.output_item.done", output_index=index, item=done)
                output.append(done)
            for call in calls:
                item = _call_item(call)
                index = len(output)
                pending = dict(item, arguments="", status="in_progress")
                yield event("response.output_item.added", output_index=index, item=pending)
                yield event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=item["arguments"],
                )
                yield event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
                yield event("response.output_item.done", output_index=index, item=item)
                output.append(item)
            body = self._finish(base, output, finish, usage)
            kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
            yield event(kind, response=body)
        except Exception as e:
            if isinstance(e, APIError):
                yield stream_error(e)
            else:
                yield event(
                    "response.failed",
                    response=dict(
                        base, status="failed", error={"code": "server_error", "message": str(e)}
                    ),
                )
