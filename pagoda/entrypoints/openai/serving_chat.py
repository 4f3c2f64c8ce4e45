"""`/v1/chat/completions`: a conversation rendered by the model's chat template, then generated.

The template runs on the engine thread (the tokenizer is not thread-safe); streamed responses
open with a role delta per choice, then content deltas, as OpenAI's chunk format does.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from pagoda.engine.async_engine import RequestStream
from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints.openai.metrics import RequestTracker
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    random_id,
)
from pagoda.entrypoints.openai.serving_engine import (
    OpenAIServing,
    Usage,
    chat_logprobs,
    check_stop_token_ids,
    collect,
    max_tokens_for,
    parse_body,
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


class OpenAIServingChat(OpenAIServing):
    """The chat completions endpoint."""

    async def create(self, request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest)
        lora = self.check_model(req.model)
        messages = [m.to_dict() for m in req.messages]
        requested = req.requested_max_tokens
        limit = self.engine.max_model_len
        req.to_sampling_params(max_tokens=None)

        def prepare(engine: LLMEngine) -> list:
            from jinja2 import TemplateError

            check_stop_token_ids(req.stop_token_ids, engine.input_processor.vocab_size)
            try:
                processed = engine.input_processor.process_chat(
                    messages,
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                )
            except TemplateError as e:
                raise ValueError(f"messages: the model's chat template rejected them: {e}") from e
            n_prompt = len(processed.prompt_token_ids)
            params = req.to_sampling_params(max_tokens_for(n_prompt, requested, None, limit))
            return [(processed, params)]

        rid = random_id("chatcmpl")
        arrival = time.perf_counter()
        streams = await self.add(prepare, rid, lora)
        trackers = [RequestTracker(self.metrics, arrival)]
        k = req.top_logprobs or 0
        if req.stream:
            return EventStream(self._stream(req, rid, streams, trackers))
        result = await unless_disconnected(request, collect(streams, trackers, req.n))
        if result is None:
            return Response(status_code=499)
        (per_stream,), usage = result
        choices = [
            ChatCompletionChoice(
                index=j,
                message=ChatResponseMessage(content="".join(ch.text)),
                logprobs=chat_logprobs(ch.token_ids, ch.logprobs, k) if req.logprobs else None,
                finish_reason=ch.finish_reason,
                stop_reason=ch.stop_reason,
                prompt_token_ids=usage.prompt_ids.get(0),
                token_ids=ch.token_ids,
            )
            for j, ch in enumerate(per_stream)
        ]
        body = ChatCompletionResponse(
            id=rid, model=self.model_name, choices=choices, usage=usage.info()
        )
        return dump(body, req.return_token_ids)

    async def _stream(
        self,
        req: ChatCompletionRequest,
        rid: str,
        streams: list[RequestStream],
        trackers: list[RequestTracker],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        usage = Usage()
        k = req.top_logprobs or 0
        done: set[int] = set()
        ids_wanted = req.return_token_ids

        def chunk(choice: ChatCompletionStreamChoice) -> str:
            body = ChatCompletionStreamResponse(
                id=rid, created=created, model=self.model_name, choices=[choice]
            ).model_dump(exclude={"usage"} if not req.include_usage else set())
            for c in body["choices"]:
                c["delta"] = {key: v for key, v in c["delta"].items() if v is not None}
                if not ids_wanted:
                    del c["token_ids"]
            return sse(body)

        try:
            for j in range(req.n):
                yield chunk(
                    ChatCompletionStreamChoice(
                        index=j, delta=DeltaMessage(role="assistant", content="")
                    )
                )
            async for _, out in merge(streams, trackers):
                usage.add(0, out)
                for c in out.outputs:
                    if c.index in done:
                        continue
                    lp = None
                    if req.logprobs and c.logprobs:
                        lp = chat_logprobs(c.token_ids, c.logprobs, k)
                    if c.finish_reason is not None:
                        done.add(c.index)
                    elif not c.text and lp is None and not (ids_wanted and c.token_ids):
                        continue
                    yield chunk(
                        ChatCompletionStreamChoice(
                            index=c.index,
                            delta=DeltaMessage(content=c.text or None),
                            logprobs=lp,
                            finish_reason=c.finish_reason,
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
