"""What the completion and chat endpoints share: `OpenAIServing` and the response builders.

`OpenAIServing` holds the engine, the served names (base model + LoRA adapters) and the metrics,
parses request bodies into protocol models and adds engine requests; the helpers accumulate
delta outputs into choices and usage and turn pagoda's `Logprob`s into OpenAI's two formats.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from pagoda.engine.async_engine import EngineDeadError, RequestStream
from pagoda.engine.engine_process import ServerEngine
from pagoda.engine.input_processor import ProcessedPrompt
from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints.openai.errors import APIError, validation_error
from pagoda.entrypoints.openai.metrics import Metrics, RequestTracker
from pagoda.entrypoints.openai.protocol import (
    IGNORED_FIELDS,
    ChatChoiceLogProbs,
    ChatLogProb,
    ChatLogProbContent,
    CompletionLogProbs,
    PromptTokensDetails,
    UsageInfo,
)
from pagoda.entrypoints.openai.streaming import merge
from pagoda.outputs import Logprob, RequestOutput

logger = logging.getLogger("pagoda")


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
    prompt_logprobs: dict[int, list] = field(default_factory=dict)  # by stream, once computed

    def add(self, stream_index: int, out: RequestOutput) -> None:
        if stream_index not in self.prompt_ids:
            self.prompt_ids[stream_index] = out.prompt_token_ids
            self.prompt_tokens += len(out.prompt_token_ids)
        plp = getattr(out, "prompt_logprobs", None)
        if plp is not None and stream_index not in self.prompt_logprobs:
            self.prompt_logprobs[stream_index] = plp
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
        engine: ServerEngine,
        model_name: str,
        metrics: Metrics,
        lora_requests: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.lora_requests = lora_requests or {}

    def check_model(self, model: str | None) -> Any:
        """The LoRARequest the model name selects (None for the base model), or 404."""
        if model is None or model == self.model_name:  # no model: the served one, as vLLM
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

    def warn_ignored(self, req: Any, endpoint: str) -> None:
        """Log the request's fields that change nothing (never dropped without a word)."""
        names = req.ignored_fields()
        if not names:
            return
        reasons = [f"{n} ({IGNORED_FIELDS[n]})" if n in IGNORED_FIELDS else n for n in names]
        logger.warning("%s: ignoring the request fields %s", endpoint, ", ".join(reasons))

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


def prompt_logprobs_json(plp: Sequence[dict[int, Logprob] | None] | None) -> list | None:
    """vLLM's `prompt_logprobs` field: per prompt token None or {id: {logprob, rank, token}}."""
    if plp is None:
        return None
    return [
        None
        if entry is None
        else {
            tid: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in entry.items()
        }
        for entry in plp
    ]


def echo_logprobs(
    prompt_ids: Sequence[int],
    plp: Sequence[dict[int, Logprob] | None],
    first_token: str,
    k: int,
) -> CompletionLogProbs:
    """The prompt's part of an echoed completion's logprobs (OpenAI's legacy format).

    The first token has no log-prob (None), as in OpenAI's and vLLM's answers; each later one
    carries its own log-prob and the top `k` alternatives (at least itself).
    """
    out = CompletionLogProbs()
    offset = 0
    for i, tid in enumerate(prompt_ids):
        entry = plp[i] if i < len(plp) else None
        if entry is None or tid not in entry:
            token = first_token if i == 0 else ""
            out.tokens.append(token)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            lp = entry[tid]
            token = lp.decoded_token or ""
            out.tokens.append(token)
            out.token_logprobs.append(lp.logprob)
            top: dict[str, float] = {}
            for other in sorted(entry.values(), key=lambda x: -x.logprob)[: max(k, 1)]:
                top.setdefault(other.decoded_token or "", other.logprob)
            top.setdefault(token, lp.logprob)
            out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def truncated(ids: list[int], truncate: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last k tokens (-1: what the context allows)."""
    if truncate is None:
        return ids
    keep = max_model_len - 1 if truncate == -1 else truncate
    return ids[-keep:] if len(ids) > keep else ids


def process_text_prompt(
    engine: LLMEngine,
    prompt: str | list[int],
    add_special_tokens: bool,
    truncate: int | None,
) -> ProcessedPrompt:
    """Tokenize (honouring add_special_tokens), truncate, then the engine's own checks."""
    ip = engine.input_processor
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            return ip.process(prompt)  # the input processor's own "no tokenizer" error
        ids = list(engine.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)
        short = truncated(ids, truncate, ip.max_model_len)
        text = prompt if len(short) == len(ids) else None
        return ip.process({"prompt": text, "prompt_token_ids": short})
    return ip.process(truncated(list(prompt), truncate, ip.max_model_len))


def process_chat_prompt(
    engine: LLMEngine,
    messages: list[dict[str, Any]],
    *,
    chat_template: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    template_kwargs: dict[str, Any],
    add_special_tokens: bool,
    truncate: int | None = None,
) -> ProcessedPrompt:
    """Render the conversation with the (model's or request's) template, tokenize, truncate."""
    from jinja2 import TemplateError

    ip = engine.input_processor
    media: list[tuple[str, Any]] = []
    try:
        text = ip.render_chat(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=template_kwargs,
            media=media,
        )
    except (ValueError, TypeError):
        raise
    except TemplateError as e:
        raise ValueError(f"messages: the chat template rejected them: {e}") from e
    except Exception as e:  # a request's own template may fail in any way: still its fault
        if chat_template is None:
            raise
        raise ValueError(f"chat_template: rendering failed: {type(e).__name__}: {e}") from e
    ids = list(engine.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
    short = truncated(ids, truncate, ip.max_model_len)
    prompt: dict[str, Any] = {"prompt": text if len(short) == len(ids) else None}
    prompt["prompt_token_ids"] = short
    if media:
        prompt["multi_modal_data"] = ip.mm_processor.multi_modal_data(media)
    return ip.process(prompt)
