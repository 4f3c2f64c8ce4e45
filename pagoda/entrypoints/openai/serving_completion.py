"""`/v1/completions`: prompts (text or token ids, one or many) to completions, streamed or not.

Each prompt becomes one engine request (with `n` samples); choices are numbered prompt-major
(`i * n + j`) as OpenAI does. `echo` puts the prompt in front of the completion, with
`logprobs` the prompt's log-probs too (lm-eval's loglikelihood requests: `echo`, `logprobs: 1`,
`max_tokens: 1`); `max_tokens: 0` with echo scores the prompt and generates nothing.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagoda.engine.async_engine import RequestStream
from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints.openai.generation_config import apply_defaults
from pagoda.entrypoints.openai.metrics import RequestTracker
from pagoda.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
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
    echo_logprobs,
    max_tokens_for,
    parse_body,
    process_text_prompt,
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


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint."""

    async def create(self, request: Request) -> Response:
        req = await parse_body(request, CompletionRequest)
        lora = self.check_model(req.model)
        self.warn_ignored(req, "completions")
        self.check_logprobs(logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs)
        apply_defaults(req, self.options.sampling_defaults)
        if req.stream and req.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: not available when stream is true")
        prompts = req.prompt_list()
        explicit = "max_tokens" in req.model_fields_set
        score_only = req.max_tokens == 0  # echo the prompt with its log-probs, generate nothing
        limit = self.engine.max_model_len
        req.to_sampling_params(max_tokens=None)  # validate before touching the engine
        echo_texts: list[str] = []
        first_tokens: list[str] = []  # the first prompt token's text (it has no log-prob)
        rid = req.request_id or random_id("cmpl")

        def prepare(engine: LLMEngine) -> list:
            check_stop_token_ids(req.stop_token_ids, engine.input_processor.vocab_size)
            items = []
            echo_texts.clear()
            first_tokens.clear()
            for prompt in prompts:
                processed = process_text_prompt(
                    engine, prompt, req.add_special_tokens, req.truncate_prompt_tokens
                )
                ids = processed.prompt_token_ids
                requested = (1 if score_only else req.max_tokens) if explicit else None
                default = None if explicit else self.options.sampling_defaults.get("max_tokens", 16)
                params = req.to_sampling_params(max_tokens_for(len(ids), requested, default, limit))
                if req.echo:
                    text = processed.prompt
                    if text is None:
                        if engine.tokenizer is None:
                            raise ValueError("echo: needs a tokenizer to show token-id prompts")
                        text = engine.tokenizer.decode(ids)
                    echo_texts.append(text)
                    tok = engine.tokenizer
                    first_tokens.append(tok.decode(ids[:1]) if tok is not None else "")
                items.append((processed, params))
                self.log_request(rid, prompt, params)
            return items

        arrival = time.perf_counter()
        streams = await self.add(prepare, rid, lora)
        trackers = [RequestTracker(self.metrics, arrival) for _ in streams]
        if req.stream:
            return EventStream(self._stream(req, rid, streams, trackers, echo_texts, first_tokens))
        result = await unless_disconnected(request, collect(streams, trackers, req.n))
        if result is None:
            return Response(status_code=499)
        choices_by_stream, usage = result
        choices = []
        for i, per_stream in enumerate(choices_by_stream):
            plp = usage.prompt_logprobs.get(i)
            for j, ch in enumerate(per_stream):
                if score_only:
                    ch.text, ch.token_ids, ch.logprobs = [], [], []
                    ch.finish_reason, ch.stop_reason = "length", None
                prefix = echo_texts[i] if req.echo else ""
                text = prefix + "".join(ch.text)
                logprobs = None
                if req.logprobs is not None:
                    logprobs = completion_logprobs(
                        ch.token_ids, ch.logprobs, len(prefix), req.logprobs
                    )
                    if req.echo:
                        logprobs = self._with_prompt(
                            logprobs, usage.prompt_ids[i], plp, first_tokens[i], req.logprobs
                        )
                choices.append(
                    CompletionChoice(
                        index=i * req.n + j,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=ch.finish_reason,
                        stop_reason=ch.stop_reason,
                        prompt_logprobs=(
                            prompt_logprobs_json(plp) if req.prompt_logprobs is not None else None
                        ),
                        prompt_token_ids=usage.prompt_ids.get(i),
                        token_ids=ch.token_ids,
                    )
                )
        if score_only:
            usage.completion_tokens = 0
        body = CompletionResponse(
            id=rid, model=self.model_name, choices=choices, usage=usage.info()
        )
        return dump(body, req.return_token_ids)

    @staticmethod
    def _with_prompt(
        generated: CompletionLogProbs,
        prompt_ids: list[int],
        plp: list | None,
        first_token: str,
        k: int,
    ) -> CompletionLogProbs:
        """The echoed prompt's log-probs in front of the generated tokens' ones."""
        if plp is None:  # the engine always returns them when asked; this is a bug
            raise RuntimeError("the engine returned no prompt log-probs for an echo request")
        out = echo_logprobs(prompt_ids, plp, first_token, k)
        out.tokens += generated.tokens
        out.token_logprobs += generated.token_logprobs
        out.top_logprobs += generated.top_logprobs
        out.text_offset += generated.text_offset
        return out

    async def _stream(
        self,
        req: CompletionRequest,
        rid: str,
        streams: list[RequestStream],
        trackers: list[RequestTracker],
        echo_texts: list[str],
        first_tokens: list[str],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        usage = Usage()
        offsets = [[len(echo_texts[i]) if req.echo else 0] * req.n for i in range(len(streams))]
        done: set[int] = set()
        echo_pending = {(i, j) for i in range(len(streams)) for j in range(req.n)}
        if not req.echo:
            echo_pending.clear()
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
            body = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [choice],
            }
            if req.continuous_usage:
                body["usage"] = usage.info().model_dump()
            elif req.include_usage:
                body["usage"] = None
            return sse(body)

        try:
            async for i, out in merge(streams, trackers):
                usage.add(i, out)
                for c in out.outputs:
                    index = i * req.n + c.index
                    if index in done:
                        continue
                    if (i, c.index) in echo_pending:
                        # The echo goes first; with logprobs it waits for the prompt's, which
                        # come with the request's first output.
                        echo_pending.discard((i, c.index))
                        lp = None
                        if req.logprobs is not None:
                            lp = echo_logprobs(
                                usage.prompt_ids[i],
                                usage.prompt_logprobs.get(i) or [],
                                first_tokens[i],
                                req.logprobs,
                            ).model_dump()
                        yield chunk(index, echo_texts[i], lp)
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
