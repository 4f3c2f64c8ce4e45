"""What the completion and chat endpoints share: `OpenAIServing` and the response builders.

`OpenAIServing` holds the engine, the served names (base model + LoRA adapters) and the metrics,
parses request bodies into protocol models and adds engine requests; the helpers accumulate
delta outputs into choices and usage and turn pagoda's `Logprob`s into OpenAI's two formats.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from pagoda.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints.openai.errors import APIError, validation_error
from pagoda.entrypoints.openai.metrics import Metrics, RequestTracker
from pagoda.entrypoints.openai.protocol import (
    ChatChoiceLogProbs,
    ChatLogProb,
    ChatLogProbContent,
    CompletionLogProbs,
    PromptTokensDetails,
    UsageInfo,
)
from pagoda.entrypoints.openai.streaming import merge
from pagoda.outputs import Logprob, RequestOutput


@dataclass
class Choice:
    """One choice accumulated from delta outputs."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_ids: dict[int, list[int]] = field(default_factory=dict)  # by stream

    def add(self, stream_index: int, out: RequestOutput) -> None:
        if stream_index not in self.prompt_ids:
            self.prompt_ids[stream_index] = out.prompt_token_ids
            self.prompt_tokens += len(out.prompt_token_ids)
        if out.finished:
            self.cached_tokens += out.num_cached_tokens
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)

    def info(self) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )


def _sampled_entry(entry: dict[int, Logprob], token_id: int | None) -> tuple[int, Logprob]:
    if token_id is not None and token_id in entry:
        return token_id, entry[token_id]
    return next(iter(entry.items()))  # the sampled token is always inserted first


def completion_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]], offset: int, k: int
) -> CompletionLogProbs:
    out = CompletionLogProbs()
    for i, entry in enumerate(logprobs):
        tid, lp = _sampled_entry(entry, token_ids[i] if i < len(token_ids) else None)
        token = lp.decoded_token or ""
        out.tokens.append(token)
        out.token_logprobs.append(lp.logprob)
        out.text_offset.append(offset)
        offset += len(token)
        top: dict[str, float] = {}
        for other in sorted(entry.values(), key=lambda x: -x.logprob)[: max(k, 1)]:
            top.setdefault(other.decoded_token or "", other.logprob)
        top.setdefault(token, lp.logprob)
        out.top_logprobs.append(top)
    return out


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]], k: int
) -> ChatChoiceLogProbs:
    content = []
    for i, entry in enumerate(logprobs):
        _, lp = _sampled_entry(entry, token_ids[i] if i < len(token_ids) else None)
        token = lp.decoded_token or ""
        top = [
            ChatLogProb(
                token=o.decoded_token or "",
                logprob=o.logprob,
                bytes=list((o.decoded_token or "").encode()),
            )
            for o in sorted(entry.values(), key=lambda x: -x.logprob)[:k]
        ]
        content.append(
            ChatLogProbContent(
                token=token, logprob=lp.logprob, bytes=list(token.encode()), top_logprobs=top
            )
        )
    return ChatChoiceLogProbs(content=content)


def check_stop_token_ids(ids: Sequence[int] | None, vocab_size: int) -> None:
    # Checked here because an id outside the vocabulary would fail the whole batch's step
    # (the min_tokens mask indexes the logits with it).
    bad = [t for t in ids or () if not 0 <= t < vocab_size]
    if bad:
        raise APIError(
            400,
            f"stop_token_ids: {bad[:5]} are outside the vocabulary [0, {vocab_size})",
            param="stop_token_ids",
        )


def max_tokens_for(prompt_len: int, requested: int | None, default: int | None, limit: int) -> int:
    """The max_tokens to use; a request beyond the context is a 400 that states the numbers."""
    room = limit - prompt_len  # >= 1: the input processor keeps one token free
    if requested is None:
        return room if default is None else max(1, min(default, room))
    if prompt_len + requested > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
            "completion). Please reduce the length of the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


class OpenAIServing:
    """The state every endpoint shares: engine, served names (base + adapters) and metrics."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        model_name: str,
        metrics: Metrics,
        lora_requests: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.lora_requests = lora_requests or {}

    def check_model(self, model: str) -> Any:
        """The LoRARequest the model name selects (None for the base model), or 404."""
        if model == self.model_name:
            return None
        if model in self.lora_requests:
            return self.lora_requests[model]
        names = ", ".join(repr(n) for n in [self.model_name, *self.lora_requests])
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {names}",
            param="model",
            code="model_not_found",
        )

    async def add(
        self, prepare: Callable[[LLMEngine], list], request_id: str, lora: Any = None
    ) -> Any:
        if lora is not None:
            inner = prepare

            def prepare(engine: LLMEngine) -> list:
                return [(*item, lora) for item in inner(engine)]

        try:
            return await self.engine.add_requests(prepare, request_id)
        except EngineDeadError as e:
            raise APIError(503, str(e)) from e

    # -- /v1/completions ---------------------------------------------------------------


async def collect(
    streams: list[RequestStream], trackers: list[RequestTracker], n: int
) -> tuple[list[list[Choice]], Usage]:
    choices = [[Choice() for _ in range(n)] for _ in streams]
    usage = Usage()
    async for i, out in merge(streams, trackers):
        usage.add(i, out)
        for c in out.outputs:
            ch = choices[i][c.index]
            ch.text.append(c.text)
            ch.token_ids.extend(c.token_ids)
            if c.logprobs:
                ch.logprobs.extend(c.logprobs)
            if c.finish_reason is not None:
                ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
    return choices, usage


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    content_type = request.headers.get("content-type", "application/json")
    mime = content_type.split(";", 1)[0].strip().lower()
    if mime and mime != "application/json" and not mime.endswith("+json"):
        raise APIError(400, f"Content-Type must be application/json, got {content_type!r}")
    body = await request.body()
    if not body:
        raise APIError(400, "the request body is empty: send a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None
