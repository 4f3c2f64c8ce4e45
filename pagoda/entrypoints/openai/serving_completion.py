"""`/v1/completions`: prompts (text or token ids, one or many) to completions, streamed or not.

Each prompt becomes one engine request (with `n` samples); choices are numbered prompt-major
(`i * n + j`) as OpenAI does. `echo` puts the prompt text in front of the completion.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagoda.engine.async_engine import RequestStream
from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints.openai.metrics import RequestTracker
from pagoda.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from pagoda.entrypoints.openai.serving_engine import (
    OpenAIServing,
    Usage,
    check_stop_token_ids,
    collect,
    completion_logprobs,
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


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint."""

    async def create(self, request: Request) -> Response:
        req = await parse_body(request, CompletionRequest)
        lora = self.check_model(req.model)
        prompts = req.prompt_list()
        explicit = "max_tokens" in req.model_fields_set
        limit = self.engine.max_model_len
        req.to_sampling_params(max_tokens=None)  # validate before touching the engine
        echo_texts: list[str] = []

        def prepare(engine: LLMEngine) -> list:
            check_stop_token_ids(req.stop_token_ids, engine.input_processor.vocab_size)
            items = []
            echo_texts.clear()
            for prompt in prompts:
                processed = engine.input_processor.process(prompt)
                n_prompt = len(processed.prompt_token_ids)
                requested = req.max_tokens if explicit else None
                default = None if explicit else 16
                params = req.to_sampling_params(max_tokens_for(n_prompt, requested, default, limit))
                if req.echo:
                    text = processed.prompt
                    if text is None:
                        if engine.tokenizer is None:
                            raise ValueError("echo: needs a tokenizer to show token-id prompts")
                        text = engine.tokenizer.decode(processed.prompt_token_ids)
                    echo_texts.append(text)
                items.append((processed, params))
            return items

        rid = random_id("cmpl")
        arrival = time.perf_counter()
        streams = await self.add(prepare, rid, lora)
        trackers = [RequestTracker(self.metrics, arrival) for _ in streams]
        if req.stream:
            return EventStream(self._stream(req, rid, streams, trackers, echo_texts))
        result = await unless_disconnected(request, collect(streams, trackers, req.n))
        if result is None:
            return Response(status_code=499)
        choices_by_stream, usage = result
        choices = []
        for i, per_stream in enumerate(choices_by_stream):
            for j, ch in enumerate(per_stream):
                prefix = echo_texts[i] if req.echo else ""
                text = prefix + "".join(ch.text)
                logprobs = None
                if req.logprobs is not None:
                    logprobs = completion_logprobs(
                        ch.token_ids, ch.logprobs, len(prefix), req.logprobs
                    )
                choices.append(
                    CompletionChoice(
                        index=i * req.n + j,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=ch.finish_reason,
                        stop_reason=ch.stop_reason,
                        prompt_token_ids=usage.prompt_ids.get(i),
                        token_ids=ch.token_ids,
                    )
                )
        body = CompletionResponse(
            id=rid, model=self.model_name, choices=choices, usage=usage.info()
        )
        return dump(body, req.return_token_ids)

    async def _stream(
        self,
        req: CompletionRequest,
        rid: str,
        streams: list[RequestStream],
        trackers: list[RequestTracker],
        echo_texts: list[str],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        usage = Usage()
        offsets = [[len(echo_texts[i]) if req.echo else 0] * req.n for i in range(len(streams))]
        done: set[int] = set()
        ids_wanted = req.return_token_ids

        def chunk(
            index: int,
            text: str,
            logprobs: Any = None,
            finish: Any = None,
            stop: Any = None,
            token_ids: list[int] | None = None,
        ) -> str:
            choice = {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish,
                "stop_reason": stop,
            }
            if req.return_token_ids:
                choice["token_ids"] = token_ids or []
            return sse(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": self.model_name,
                    "choices": [choice],
                    **({"usage": None} if req.include_usage else {}),
                }
            )

        try:
            if req.echo:
                for i in range(len(streams)):
                    for j in range(req.n):
                        yield chunk(i * req.n + j, echo_texts[i])
            async for i, out in merge(streams, trackers):
                usage.add(i, out)
                for c in out.outputs:
                    index = i * req.n + c.index
                    if index in done:
                        continue
                    lp = None
                    if req.logprobs is not None and c.logprobs:
                        lp = completion_logprobs(
                            c.token_ids, c.logprobs, offsets[i][c.index], req.logprobs
                        ).model_dump()
                    offsets[i][c.index] += len(c.text)
                    if c.finish_reason is not None:
                        done.add(index)
                    elif not c.text and lp is None and not (ids_wanted and c.token_ids):
                        continue
                    yield chunk(index, c.text, lp, c.finish_reason, c.stop_reason, c.token_ids)
            if req.include_usage:
                yield sse(
                    {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": self.model_name,
                        "choices": [],
                        "usage": usage.info().model_dump(),
                    }
                )
        except Exception as e:
            yield stream_error(e)
        yield DONE
