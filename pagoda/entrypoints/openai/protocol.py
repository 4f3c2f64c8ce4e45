"""Pydantic models of the OpenAI API subset that `pagoda serve` speaks (requests and responses).

Requests are validated strictly (no type coercion but integral floats for integers, no NaN/inf,
bounded numbers; OpenAI's fields plus vLLM's extensions). Fields that change nothing are listed
in `IGNORED_FIELDS`; they and unknown fields are kept so that the server logs them.
`to_sampling_params()` maps a request onto `SamplingParams`, which validates the rest.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from pagoda.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_N = 128  # samples per prompt
MAX_PROMPTS = 256  # prompts per completions request
MAX_STOP = 16  # stop strings per request
MAX_STOP_TOKEN_IDS = 256
MAX_TOP_K = 1 << 20
MAX_BAD_WORDS = 256
MAX_ALLOWED_TOKEN_IDS = 1 << 20
MAX_TOOLS = 128
MAX_TEMPLATE_CHARS = 1 << 20
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def _integral(value: Any) -> Any:
    """`5.0` → `5`: integer fields take integral floats, as vLLM's (lax) models do."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


# An int that also accepts an integral float (`max_tokens: 5.0`); strings and bools stay refused.
Int = Annotated[int, BeforeValidator(_integral)]
TokenId = Annotated[int, BeforeValidator(_integral), Field(ge=0, le=INT64_MAX)]


class _Request(BaseModel):
    # Unknown top-level fields are kept (`extra="allow"`) so that the server can log them as
    # ignored instead of dropping them silently; nested objects ignore extras.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class _TopLevel(_Request):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def ignored_fields(self) -> list[str]:
        return self.unknown_fields()


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and not (self.json_schema and self.json_schema.schema_):
            raise ValueError("response_format: type json_schema needs json_schema.schema")
        return self


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` request field; unknown keys are refused (not silently lost)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


# Fields accepted for compatibility that change nothing here: logged as ignored when set.
IGNORED_FIELDS = {
    "user": "end-user ids are not used",
    "metadata": "not stored",
    "store": "responses are not stored",
    "service_tier": "one tier",
    "safety_identifier": "not used",
    "prompt_cache_key": "the prefix cache keys on tokens",
    "verbosity": "not a sampling setting here",
    "reasoning_effort": "not passed to the template (use chat_template_kwargs)",
    "guided_decoding_backend": "one grammar backend",
    "guided_whitespace_pattern": "the grammar's own whitespace rules apply",
    "priority": "requests are scheduled first come, first served",
    "cache_salt": "the prefix cache is shared by all requests",
    "kv_transfer_params": "no disaggregated prefill",
    "vllm_xargs": "no extra engine arguments",
    "mm_processor_kwargs": "images and videos use the server's processor settings",
    "length_penalty": "only used by beam search, which is not supported",
}


class _SamplingRequest(_TopLevel):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # None: the served model
    n: Int = Field(1, ge=1, le=MAX_N)
    best_of: Int | None = Field(None, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    seed: Int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: Int = Field(0, ge=0, le=INT64_MAX)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False  # vLLM extension: token ids beside the text
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions
    prompt_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    truncate_prompt_tokens: Int | None = Field(None, ge=-1, le=INT64_MAX)
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    allowed_token_ids: list[TokenId] | None = Field(None, max_length=MAX_ALLOWED_TOKEN_IDS)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    use_beam_search: bool = False
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool = False
    request_id: str | None = Field(None, min_length=1, max_length=256)
    # accepted and ignored (IGNORED_FIELDS says why)
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    verbosity: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    priority: Int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    length_penalty: float = 1.0

    @model_validator(mode="after")
    def _check_common(self) -> _SamplingRequest:
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise ValueError(f"stop: at most {MAX_STOP} stop strings, got {len(self.stop)}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported (use allowed_token_ids or bad_words)")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: must equal n ({self.n}) if given, got {self.best_of}")
        if self.use_beam_search:
            raise ValueError("use_beam_search: beam search is not supported")
        if self.logits_processors:
            raise ValueError("logits_processors: custom logits processors are not supported")
        if self.return_tokens_as_token_ids:
            raise ValueError("return_tokens_as_token_ids: not supported")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens: must be >= 1, or -1 for max_model_len")
        if self.bad_words is not None and any(not w for w in self.bad_words):
            raise ValueError("bad_words: must not contain an empty string")
        self.structured_outputs_kwargs()  # conflicts are a 400 before any work
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def ignored_fields(self) -> list[str]:
        """Set fields that change nothing (IGNORED_FIELDS), then unknown ones."""
        names = [
            name
            for name in IGNORED_FIELDS
            if name in self.model_fields_set and getattr(self, name) not in (None, 0, 1.0, False)
        ]
        return names + self.unknown_fields()

    def structured_outputs_kwargs(self) -> dict[str, Any] | None:
        """The `StructuredOutputsParams` arguments of whichever field asked for a constraint.

        At most one of `structured_outputs`, `guided_*` and a JSON `response_format` may be
        given (two would be ambiguous); a bad value is a ValueError naming the field.
        """
        found: list[tuple[str, dict[str, Any]]] = []
        if self.structured_outputs is not None:
            so = self.structured_outputs
            kw = {
                "json": so.json_,
                "regex": so.regex,
                "choice": so.choice,
                "grammar": so.grammar,
                "json_object": bool(so.json_object),
            }
            kw = {k: v for k, v in kw.items() if v not in (None, False)}
            if so.disable_any_whitespace:
                kw["disable_any_whitespace"] = True
            found.append(("structured_outputs", kw))
        if self.guided_json is not None:
            found.append(("guided_json", {"json": _json_value("guided_json", self.guided_json)}))
        if self.guided_regex is not None:
            found.append(("guided_regex", {"regex": self.guided_regex}))
        if self.guided_choice is not None:
            found.append(("guided_choice", {"choice": list(self.guided_choice)}))
        if self.guided_grammar is not None:
            found.append(("guided_grammar", {"grammar": self.guided_grammar}))
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            assert rf.json_schema is not None
            found.append(("response_format", {"json": rf.json_schema.schema_}))
        if len(found) > 1:
            names = " and ".join(name for name, _ in found)
            raise ValueError(f"{found[0][0]}: give one structured-output constraint, got {names}")
        if not found:
            return None
        name, kw = found[0]
        if not any(k != "disable_any_whitespace" for k in kw):
            raise ValueError(f"{name}: needs one of json, regex, choice, grammar or json_object")
        if isinstance(kw.get("json"), str):
            kw["json"] = _json_value(name, kw["json"])
        return kw

    def _sampling_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = dict(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=(
                1.0 if self.repetition_penalty is None else self.repetition_penalty
            ),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )
        # Passed only when set, so that a request that does not use them needs nothing more
        # of SamplingParams than the basic fields.
        if self.prompt_logprobs is not None:
            kw["prompt_logprobs"] = self.prompt_logprobs
        if self.truncate_prompt_tokens is not None:
            kw["truncate_prompt_tokens"] = self.truncate_prompt_tokens
        if self.bad_words:
            kw["bad_words"] = list(self.bad_words)
        if self.allowed_token_ids is not None:
            kw["allowed_token_ids"] = list(self.allowed_token_ids)
        return kw


def _json_value(name: str, value: Any) -> Any:
    """A JSON schema given as a string is parsed here, so that a typo is a 400 naming the field."""
    if not isinstance(value, str):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}: not valid JSON ({e})") from None
    if not isinstance(parsed, (dict, bool)):
        raise ValueError(f"{name}: a JSON schema must be an object, got {type(parsed).__name__}")
    return parsed


def structured_outputs_params(kwargs: dict[str, Any] | None) -> Any:
    """`StructuredOutputsParams(**kwargs)`, or None (imported only when a request needs it)."""
    if kwargs is None:
        return None
    from pagoda.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(**kwargs)


PromptType = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingRequest):
    prompt: PromptType
    max_tokens: Int | None = Field(16, ge=0)  # 0: only with echo (prompt log-probs, no output)
    echo: bool = False
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix: not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only allowed with echo (scoring the prompt)")
        if self.max_tokens == 0 and self.stream:
            raise ValueError("max_tokens: 0 is not supported with stream")
        return self

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts, each a string or a token-id list; raises ValueError when malformed."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list[str | list[int]] = [p]
        elif not p:
            raise ValueError("prompt: must not be an empty list")
        elif isinstance(p[0], int):
            prompts = [p]  # type: ignore[list-item]
        else:
            prompts = list(p)  # type: ignore[arg-type]
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts, got {len(prompts)}")
        for i, item in enumerate(prompts):
            if isinstance(item, list) and any(t < 0 for t in item):
                raise ValueError(f"prompt: token ids must be >= 0 (prompt {i})")
        return prompts

    @property
    def echo_prompt_logprobs(self) -> int | None:
        """Prompt log-probs the response needs: `prompt_logprobs`, or `logprobs` with echo."""
        wanted = [k for k in (self.prompt_logprobs,) if k is not None]
        if self.echo and self.logprobs is not None:
            wanted.append(self.logprobs)
        return max(wanted) if wanted else None

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        kw = self._sampling_kwargs()
        if self.echo_prompt_logprobs is not None:
            kw["prompt_logprobs"] = self.echo_prompt_logprobs
        so = structured_outputs_params(self.structured_outputs_kwargs())
        if so is not None:
            kw["structured_outputs"] = so
        return SamplingParams(max_tokens=max_tokens, logprobs=self.logprobs, **kw)


class TextContent(_Request):
    type: Literal["text"]
    text: str


class ImageURL(_Request):
    url: str
    detail: str | None = None


class ImageContent(_Request):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Request):
    url: str


class VideoContent(_Request):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextContent | ImageContent | VideoContent, Field(discriminator="type")]


class FunctionCall(_Request):
    name: str = Field(min_length=1)
    arguments: str = ""  # JSON text, as OpenAI sends it


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: which call this answers
    reasoning_content: str | None = None  # Qwen3-style templates render it

    @model_validator(mode="after")
    def _check_message(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages carry them, not {self.role}")
        return self

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if isinstance(self.content, list):
            d["content"] = [part.model_dump() for part in self.content]
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            # Templates (Qwen2.5, Llama 3.1, Hermes) render `arguments` as a mapping; OpenAI
            # sends it as JSON text, so it is parsed back when it is valid JSON.
            d["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.function.name, "arguments": _arguments(tc)},
                }
                for tc in self.tool_calls
            ]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            d["reasoning_content"] = self.reasoning_content
        return d


def _arguments(tc: ToolCall) -> Any:
    text = tc.function.arguments
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    echo: bool = False
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    chat_template: str | None = Field(None, max_length=MAX_TEMPLATE_CHARS)
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message: the last message must be the assistant's")
        if self.continue_final_message and self.add_generation_prompt:
            # vLLM refuses the pair too: a generation prompt would open a new turn.
            self.add_generation_prompt = False
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: deprecated by OpenAI and not supported; use tools")
        for name in ("audio", "prediction", "web_search_options"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: not supported")
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            raise ValueError(f"modalities: only 'text' is supported, got {self.modalities}")
        if self.chat_template_kwargs:
            reserved = {"tools", "documents", "add_generation_prompt", "continue_final_message"}
            clash = sorted(reserved & set(self.chat_template_kwargs))
            if clash:
                raise ValueError(f"chat_template_kwargs: set {clash[0]} as a request field")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: two tools have the same name")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool named {choice.function.name!r} in tools")
        if choice in ("required",) and not names:
            raise ValueError("tool_choice: 'required' needs tools")
        if self.tool_call_mode in ("required", "named") and self.structured_outputs_kwargs():
            raise ValueError(
                "tool_choice: a required or named tool call cannot be combined with another "
                "structured-output constraint"
            )
        return self

    @property
    def tool_call_mode(self) -> str:
        """none | auto | required | named (OpenAI's default: auto when tools are given)."""
        if not self.tools:
            return "none"
        choice = self.tool_choice
        if choice is None:
            return "auto"
        if isinstance(choice, NamedToolChoice):
            return "named"
        return choice

    @property
    def named_tool(self) -> ChatTool | None:
        choice = self.tool_choice
        if not isinstance(choice, NamedToolChoice):
            return None
        return next(t for t in self.tools or [] if t.function.name == choice.function.name)

    def tool_call_schema(self) -> dict[str, Any] | None:
        """The JSON schema that makes the grammar produce the forced tool call(s), or None.

        Named: the tool's parameters (the whole output is the arguments object). Required: an
        array of `{"name", "parameters"}` objects, one alternative per tool, as vLLM builds it.
        """
        mode = self.tool_call_mode
        if mode == "named":
            tool = self.named_tool
            assert tool is not None
            return _parameters_schema(tool)
        if mode != "required":
            return None
        alternatives = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "parameters": _parameters_schema(t),
                },
                "required": ["name", "parameters"],
            }
            for t in self.tools or []
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
        if self.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return schema

    def template_kwargs(self) -> dict[str, Any]:
        """Extra variables for the chat template: tools, documents, chat_template_kwargs."""
        kw: dict[str, Any] = dict(self.chat_template_kwargs or {})
        if self.tools and self.tool_call_mode != "none":
            kw["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        if self.documents is not None:
            kw["documents"] = self.documents
        return kw

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        kw = self._sampling_kwargs()
        so_kwargs = self.structured_outputs_kwargs()
        schema = self.tool_call_schema()
        if schema is not None:
            so_kwargs = {"json": schema}
        so = structured_outputs_params(so_kwargs)
        if so is not None:
            kw["structured_outputs"] = so
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kw)


def _parameters_schema(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


# ---------------------------------------------------------------------------- tokenizer


class TokenizeCompletionRequest(_TopLevel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_TopLevel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template: str | None = Field(None, max_length=MAX_TEMPLATE_CHARS)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)

    @model_validator(mode="after")
    def _check(self) -> TokenizeChatRequest:
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message: the last message must be the assistant's")
        return self


class DetokenizeRequest(_TopLevel):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


# ---------------------------------------------------------------------------- responses


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "pagoda"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


# vLLM's prompt_logprobs: one entry per prompt token (None for the first), id -> Logprob
PromptLogprobs = list[dict[int, dict[str, Any]] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # only with return_token_ids
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ChatLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatChoiceLogProbs(BaseModel):
    content: list[ChatLogProbContent] | None = None
    refusal: list[ChatLogProbContent] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # only with return_token_ids
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # only with return_token_ids


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
