"""`/tokenize`, `/detokenize` and `/tokenizer_info`, as vLLM's server answers them.

`/tokenize` takes a prompt (completion form) or messages (chat form, rendered by the template as
the chat endpoint would); `/tokenizer_info` is what lm-eval's remote tokenizer reads (special
tokens, chat template). The tokenizer runs on the engine's one tokenizer thread (`run`): it is not
thread-safe.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from pagoda.entrypoints.openai.serving_engine import (
    OpenAIServing,
    parse_body,
    process_chat_prompt,
)

_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


def _tokenizer(engine: LLMEngine) -> Any:
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer (a bare config)", code="no_tokenizer")
    return engine.tokenizer


def _token_text(value: Any) -> str | None:
    if value is None:
        return None
    return str(getattr(value, "content", value))  # AddedToken or str


class OpenAIServingTokenization(OpenAIServing):
    """The tokenizer endpoints."""

    async def tokenize(self, request: Request) -> Response:
        try:
            obj = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError, RecursionError):
            obj = None  # parse_body states the error
        is_chat = isinstance(obj, dict) and "messages" in obj
        model = TokenizeChatRequest if is_chat else TokenizeCompletionRequest
        req = await parse_body(request, model)
        self.check_model(req.model)
        self.warn_ignored(req, "tokenize")
        want_strs = req.return_token_strs

        def run(engine: LLMEngine) -> TokenizeResponse:
            tok = _tokenizer(engine)
            if isinstance(req, TokenizeChatRequest):
                kwargs = dict(req.chat_template_kwargs or {})
                if req.tools:
                    kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
                processed = process_chat_prompt(
                    engine,
                    [m.to_dict() for m in req.messages],
                    chat_template=req.chat_template or self.options.chat_template,
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    template_kwargs=kwargs,
                    add_special_tokens=req.add_special_tokens,
                )
                ids = processed.prompt_token_ids
            else:
                ids = list(tok(req.prompt, add_special_tokens=req.add_special_tokens).input_ids)
            strs = tok.convert_ids_to_tokens(ids) if want_strs else None
            return TokenizeResponse(
                count=len(ids),
                max_model_len=engine.model_config.max_model_len,
                tokens=ids,
                token_strs=strs,
            )

        out = await self.engine.run(run)
        return Response(out.model_dump_json(exclude_none=True), media_type="application/json")

    async def detokenize(self, request: Request) -> Response:
        req = await parse_body(request, DetokenizeRequest)
        self.check_model(req.model)
        self.warn_ignored(req, "detokenize")

        def run(engine: LLMEngine) -> DetokenizeResponse:
            tok = _tokenizer(engine)
            vocab = engine.input_processor.vocab_size
            bad = [t for t in req.tokens if t >= vocab]
            if bad:
                raise APIError(
                    400,
                    f"tokens: {bad[:5]} are outside the vocabulary [0, {vocab})",
                    param="tokens",
                )
            return DetokenizeResponse(prompt=tok.decode(req.tokens))

        out = await self.engine.run(run)
        return Response(out.model_dump_json(), media_type="application/json")

    async def tokenizer_info(self) -> Response:
        def run(engine: LLMEngine) -> dict[str, Any]:
            tok = _tokenizer(engine)
            info: dict[str, Any] = {
                "tokenizer_class": type(tok).__name__,
                "model_max_length": engine.model_config.max_model_len,
                "vocab_size": engine.input_processor.vocab_size,
                "chat_template": getattr(tok, "chat_template", None),
            }
            for name in _SPECIAL:
                info[name] = _token_text(getattr(tok, name, None))
                info[f"{name}_id"] = getattr(tok, f"{name}_id", None)
            return info

        return JSONResponse(await self.engine.run(run))
