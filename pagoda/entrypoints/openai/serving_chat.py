"""`/v1/chat/completions`: a conversation rendered by the chat template, then generated.

The template (the model's, or the request's `chat_template`) runs on the engine's tokenizer
thread (the tokenizer is not thread-safe) with `tools`, `documents` and `chat_template_kwargs`.
With tools, each choice's text goes through a tool-call parser: the template family's for
`auto`, the grammar-forced JSON for `required` / named. Streams open with a role delta per
choice, then content and `tool_calls` deltas, as OpenAI's chunk format does.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.engine.async_engine import RequestStream
from pagoda.engine.engine_process import ServerEngine
from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.generation_config import apply_defaults
from pagoda.entrypoints.openai.metrics import Metrics, RequestTracker
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
    random_id,
)
from pagoda.entrypoints.openai.reasoning_parsers import (
    ReasoningParser,
    get_reasoning_parser,
    thinking_disabled,
)
from pagoda.entrypoints.openai.serving_engine import (
    OpenAIServing,
    ServingOptions,
    Usage,
    chat_logprobs,
    check_stop_token_ids,
    collect,
    max_tokens_for,
    parse_body,
    process_chat_prompt,
    prompt_logprobs_json,
)
from pagoda.entrypoints.openai.streaming import (
    DONE,
    EventStream,
    dump,
    merge,
    sse,
    stream_error,
    unless_disconnected,
)
from pagoda.entrypoints.openai.tool_parsers import (
    ForcedToolParser,
    ParsedToolCall,
    ToolParser,
    get_tool_parser,
    parser_for_template,
)

logger = logging.getLogger(__name__)

# A tool the probe renders the template with: a template that renders tools shows its name.
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "pagoda_probe_tool",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}
TOOLS_DROPPED = (
    "the chat template does not render `tools`: the model never saw the tool definitions, so "
    'tool_choice "auto" cannot produce a tool call; serve with --chat-template <a template that '
    'renders tools>, or force a call with tool_choice "required" or a named tool'
)


def template_drops_tools(input_processor: Any, chat_template: str | None) -> bool:
    """Whether the template renders a conversation the same with and without a tool.

    False where it cannot be told (no tokenizer or template, or the probe fails to render).
    """
    conversation = [{"role": "user", "content": "hi"}]
    try:
        with_tool = input_processor.render_chat(
            conversation, chat_template=chat_template, chat_template_kwargs={"tools": [_PROBE_TOOL]}
        )
        without = input_processor.render_chat(conversation, chat_template=chat_template)
    except Exception:  # noqa: BLE001 - any failure means "unknown", and requests report their own
        return False
    return with_tool == without


def _finish_reason(reason: str | None, calls: int) -> str | None:
    # A generation that ended by itself with tool calls asks the client to run them.
    return "tool_calls" if calls and reason == "stop" else reason


def _tool_call(call: ParsedToolCall) -> ToolCallOut:
    return ToolCallOut(function=FunctionCallOut(name=call.name, arguments=call.arguments))


class OpenAIServingChat(OpenAIServing):
    """The chat completions endpoint."""

    def __init__(
        self,
        engine: ServerEngine,
        model_name: str,
        metrics: Metrics,
        lora_requests: dict[str, Any] | None = None,
        tool_call_parser: str | None = None,
        options: ServingOptions | None = None,
    ) -> None:
        super().__init__(engine, model_name, metrics, lora_requests, options)
        self.reasoning = get_reasoning_parser(self.options.reasoning_parser)
        # Checked now: a bad --tool-call-parser fails at start-up, not on the first request.
        self.tool_call_parser = tool_call_parser
        if tool_call_parser is not None:
            get_tool_parser(tool_call_parser)
        self._drops_tools: dict[str | None, bool] = {}  # by template text

    def drops_tools(self, input_processor: Any, template: str | None) -> bool:
        """`template_drops_tools`, remembered per template (called on the tokenizer thread)."""
        if template not in self._drops_tools:
            self._drops_tools[template] = template_drops_tools(input_processor, template)
        return self._drops_tools[template]

    async def check_template(self) -> None:
        """At start-up: warn when the served template drops tools while auto tool choice is on."""
        if self.options.enable_auto_tool_choice is False:
            return
        template = self.options.chat_template

        def probe(engine: Any) -> bool:
            ip = engine.input_processor
            used = template or getattr(ip.tokenizer, "chat_template", None)
            return used is not None and self.drops_tools(ip, used)

        if await self.engine.run(probe):
            logger.warning("%s; requests that send tools get this note", TOOLS_DROPPED)

    def _parser(self, req: ChatCompletionRequest, template: str | None) -> ToolParser | None:
        mode = req.tool_call_mode
        if mode == "none":
            return None
        if mode == "named":
            assert req.named_tool is not None
            return ForcedToolParser(req.named_tool.function.name)
        if mode == "required":
            return ForcedToolParser(None)
        if self.tool_call_parser is not None:
            return get_tool_parser(self.tool_call_parser)
        return parser_for_template(template)

    async def create(self, request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest)
        lora = self.check_model(req.model)
        self.warn_ignored(req, "chat/completions")
        if (
            self.options.enable_auto_tool_choice is False
            and req.tools
            and req.tool_call_mode == "auto"
        ):
            raise APIError(
                400,
                'tool_choice "auto" needs --enable-auto-tool-choice (this server was started '
                "with --disable-auto-tool-choice)",
                param="tool_choice",
            )
        self.check_logprobs(
            top_logprobs=req.top_logprobs if req.logprobs else None,
            prompt_logprobs=req.prompt_logprobs,
        )
        apply_defaults(req, self.options.sampling_defaults)
        default_max_tokens = self.options.sampling_defaults.get("max_tokens")
        chat_template = req.chat_template or self.options.chat_template
        if req.stream and req.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: not available when stream is true")
        messages = [m.to_dict() for m in req.messages]
        requested = req.requested_max_tokens
        limit = self.engine.max_model_len
        req.to_sampling_params(max_tokens=None)  # validate before touching the engine
        template_used: list[str | None] = [None]
        tools_dropped = [False]
        rid = req.request_id or random_id("chatcmpl")

        def prepare(engine: LLMEngine) -> list:
            check_stop_token_ids(req.stop_token_ids, engine.input_processor.vocab_size)
            processed = process_chat_prompt(
                engine,
                messages,
                chat_template=chat_template,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                template_kwargs=req.template_kwargs(),
                add_special_tokens=req.add_special_tokens,
                truncate=req.truncate_prompt_tokens,
            )
            tokenizer = engine.tokenizer
            template_used[0] = chat_template or getattr(tokenizer, "chat_template", None)
            if req.tools and req.tool_call_mode == "auto" and template_used[0] is not None:
                tools_dropped[0] = self.drops_tools(engine.input_processor, template_used[0])
            n_prompt = len(processed.prompt_token_ids)
            max_tokens = max_tokens_for(n_prompt, requested, default_max_tokens, limit)
            params = req.to_sampling_params(max_tokens)
            self.log_request(rid, processed.prompt or processed.prompt_token_ids, params)
            return [(processed, params)]

        arrival = time.perf_counter()
        streams = await self.add(prepare, rid, lora)
        trackers = [RequestTracker(self.metrics, arrival)]
        parser = self._parser(req, template_used[0])
        reasoning = self.reasoning
        if reasoning is not None and thinking_disabled(req.chat_template_kwargs):
            reasoning = None
        echo = ""
        last = req.messages[-1]
        if req.echo and last.role == "assistant" and isinstance(last.content, str):
            echo = last.content
        # The note on a dropped tool list: a Warning header (RFC 9111 code 299), and `warnings`
        # in a non-streamed body.
        note = {"Warning": f'299 pagoda "{TOOLS_DROPPED}"'} if tools_dropped[0] else {}
        if req.stream:
            stream = EventStream(self._stream(req, rid, streams, trackers, parser, echo, reasoning))
            stream.headers.update(note)
            return stream
        result = await unless_disconnected(request, collect(streams, trackers, req.n))
        if result is None:
            return Response(status_code=499)
        (per_stream,), usage = result
        k = req.top_logprobs or 0
        choices = []
        for j, ch in enumerate(per_stream):
            text = echo + "".join(ch.text)
            thought = None
            if reasoning is not None:
                thought, content = reasoning.extract(text)
                text = content or ""
            calls: list[ParsedToolCall] = []
            if parser is not None:
                parsed = parser.parse(text)
                text, calls = parsed.content, parsed.tool_calls
            message = ChatResponseMessage(
                content=text if text or not (calls or thought) else None,
                tool_calls=[_tool_call(c) for c in calls],
                reasoning=thought,
                reasoning_content=thought,
            )
            choices.append(
                ChatCompletionChoice(
                    index=j,
                    message=message,
                    logprobs=chat_logprobs(ch.token_ids, ch.logprobs, k) if req.logprobs else None,
                    finish_reason=_finish_reason(ch.finish_reason, len(calls)),
                    stop_reason=ch.stop_reason,
                    prompt_token_ids=usage.prompt_ids.get(0),
                    token_ids=ch.token_ids,
                )
            )
        body = ChatCompletionResponse(
            id=rid,
            model=self.model_name,
            choices=choices,
            usage=usage.info(),
            prompt_logprobs=(
                prompt_logprobs_json(usage.prompt_logprobs.get(0))
                if req.prompt_logprobs is not None
                else None
            ),
        )
        response = dump(body, req.return_token_ids)
        if not note:
            return response
        data = json.loads(response.body)
        data["warnings"] = [TOOLS_DROPPED]
        return JSONResponse(data, headers=note)

    async def _stream(
        self,
        req: ChatCompletionRequest,
        rid: str,
        streams: list[RequestStream],
        trackers: list[RequestTracker],
        parser: ToolParser | None,
        echo: str,
        reasoning: ReasoningParser | None = None,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        usage = Usage()
        k = req.top_logprobs or 0
        done: set[int] = set()
        ids_wanted = req.return_token_ids
        parsers = [parser.streaming() if parser is not None else None for _ in range(req.n)]
        thinkers = [reasoning.stream() if reasoning is not None else None for _ in range(req.n)]
        num_calls = [0] * req.n

        def chunk(choice: ChatCompletionStreamChoice) -> str:
            body = ChatCompletionStreamResponse(
                id=rid, created=created, model=self.model_name, choices=[choice]
            ).model_dump(exclude={"usage"} if not req.include_usage else set())
            if req.continuous_usage:
                body["usage"] = usage.info().model_dump()
            for c in body["choices"]:
                c["delta"] = {key: v for key, v in c["delta"].items() if v is not None}
                if not ids_wanted:
                    del c["token_ids"]
            return sse(body)

        def deltas(j: int, text: str, final: bool) -> tuple[str | None, list[DeltaToolCall]]:
            stream = parsers[j]
            if stream is None:
                return text or None, []
            out = stream.feed(text)
            if final:
                rest = stream.finish()
                out.content += rest.content
                out.tool_calls += rest.tool_calls
            calls = []
            for call in out.tool_calls:
                tc = _tool_call(call)
                calls.append(
                    DeltaToolCall(
                        index=num_calls[j],
                        id=tc.id,
                        type="function",
                        function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
                    )
                )
                num_calls[j] += 1
            return out.content or None, calls

        try:
            for j in range(req.n):
                yield chunk(
                    ChatCompletionStreamChoice(
                        index=j, delta=DeltaMessage(role="assistant", content="")
                    )
                )
            pending_echo = {j: echo for j in range(req.n)} if echo else {}
            async for _, out in merge(streams, trackers):
                usage.add(0, out)
                for c in out.outputs:
                    if c.index in done:
                        continue
                    lp = None
                    if req.logprobs and c.logprobs:
                        lp = chat_logprobs(c.token_ids, c.logprobs, k)
                    final = c.finish_reason is not None
                    text = pending_echo.pop(c.index, "") + c.text
                    thought = None
                    thinker = thinkers[c.index]
                    if thinker is not None:
                        thought, text = thinker.feed(text, final)
                    content, calls = deltas(c.index, text, final)
                    if final:
                        done.add(c.index)
                    elif (
                        content is None
                        and not thought
                        and not calls
                        and lp is None
                        and not (ids_wanted and c.token_ids)
                    ):
                        continue
                    yield chunk(
                        ChatCompletionStreamChoice(
                            index=c.index,
                            delta=DeltaMessage(
                                content=content,
                                tool_calls=calls or None,
                                reasoning=thought or None,
                                reasoning_content=thought or None,
                            ),
                            logprobs=lp,
                            finish_reason=_finish_reason(c.finish_reason, num_calls[c.index]),
                            stop_reason=c.stop_reason,
                            token_ids=c.token_ids if ids_wanted else None,
                        )
                    )
            if req.include_usage:
                yield sse(
                    ChatCompletionStreamResponse(
                        id=rid,
                        created=created,
                        model=self.model_name,
                        choices=[],
                        usage=usage.info(),
                    )
                )
        except Exception as e:
            yield stream_error(e)
        yield DONE
