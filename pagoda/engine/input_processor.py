"""Turn user prompts and chat conversations into token ids, validated at the edge.

Accepted prompts: a string, a list of token ids, or a dict with `prompt` or
`prompt_token_ids` (vLLM's shapes), plus `multi_modal_data` for vision-language models. Chat
messages are rendered with the model's own chat template; image parts go through the model's
`MultiModalProcessor`. Every failure is a `ValueError`/`TypeError` that says what was wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagoda.multimodal.inputs import MultiModalInputs
    from pagoda.multimodal.processor import MultiModalProcessor


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]  # image placeholders already expanded
    mm_inputs: MultiModalInputs | None = None  # images / videos of a vision-language prompt


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any | None,
        vocab_size: int,
        max_model_len: int,
        mm_processor: MultiModalProcessor | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.mm_processor = mm_processor  # set for vision-language models

    def process(
        self,
        prompt: Any,
        allow_local_paths: bool = False,
        truncate_prompt_tokens: int | None = None,
    ) -> ProcessedPrompt:
        """`allow_local_paths`: media may name local files (the offline API, not a server).

        `truncate_prompt_tokens` (SamplingParams' field): keep only the last k tokens; -1 keeps
        as many as the context allows with room for one generated token.
        """
        text: str | None = None
        ids: list[int] | None = None
        images: list[Any] = []
        videos: list[Any] = []
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = self._check_ids(prompt["prompt_token_ids"])
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                text = prompt["prompt"]
                if not isinstance(text, str):
                    raise TypeError(f"prompt must be a string, got {type(text).__name__}")
            else:
                raise ValueError("a prompt dict needs a 'prompt' or 'prompt_token_ids' key")
            if "multi_modal_data" in prompt and prompt["multi_modal_data"]:
                if self.mm_processor is None:
                    raise ValueError(
                        "this model does not accept images or videos (multi_modal_data)"
                    )
                images, videos = self.mm_processor.media_of(prompt["multi_modal_data"])
        elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
            ids = self._check_ids(prompt)
        else:
            raise TypeError(
                "a prompt must be a string, a list of token ids, or a dict with 'prompt' / "
                f"'prompt_token_ids'; got {type(prompt).__name__}"
            )
        if ids is None:
            assert text is not None
            if self.tokenizer is None:
                raise ValueError(
                    "this model has no tokenizer (a bare config): pass token ids instead of text"
                )
            ids = list(self.tokenizer(text).input_ids)
        mm_inputs = None
        if self.mm_processor is not None:  # expands image placeholders, checks stray ones
            ids, mm_inputs = self.mm_processor.process(ids, images, allow_local_paths, videos)
        if truncate_prompt_tokens is not None:
            ids, text = self.truncate(ids, text, truncate_prompt_tokens, mm_inputs is not None)
        if not ids:
            raise ValueError("the prompt is empty: it must contain at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt is {len(ids)} tokens long, but the model's context "
                f"(max_model_len) is {self.max_model_len} tokens, which must also leave room "
                "for at least one generated token; shorten the prompt or raise max_model_len"
            )
        return ProcessedPrompt(text, ids, mm_inputs)

    def truncate(
        self, ids: list[int], text: str | None, k: int, has_images: bool = False
    ) -> tuple[list[int], str | None]:
        """The last `k` tokens (vLLM's left truncation); the text is dropped when it changes."""
        keep = self.max_model_len - 1 if k == -1 else k
        if len(ids) <= keep:
            return ids, text
        if has_images:
            raise ValueError(
                "truncate_prompt_tokens cannot cut a prompt with images or videos (it would "
                "split their tokens); shorten the prompt instead"
            )
        return ids[-keep:], None

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)):
            raise TypeError("prompt_token_ids must be a list of integers")
        out = []
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise TypeError(f"prompt token {i} is {t!r}: token ids must be integers")
            if not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"prompt token {i} is {t}, outside the vocabulary [0, {self.vocab_size})"
                )
            out.append(t)
        return out

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        media: list[tuple[str, Any]] | None = None,
    ) -> str:
        """The conversation as the model's chat template renders it.

        Vision-language models: each image / video part becomes one placeholder, and its
        ("image" | "video", source) is appended to `media` (in prompt order).
        """
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot render chat messages")
        if self.mm_processor is None:
            normalized = [_normalize_message(i, m) for i, m in enumerate(messages)]
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError(
                "the model has no chat template; pass chat_template=... or use generate()"
            )

        def apply(conversation: list[dict[str, Any]]) -> str:
            return self.tokenizer.apply_chat_template(
                conversation,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )

        if self.mm_processor is not None:
            text, found = self.mm_processor.render_chat(messages, apply)
            if media is not None:
                media.extend(found)
            return text
        return apply(normalized)

    def process_chat(
        self, messages: list[dict[str, Any]], allow_local_paths: bool = False, **kwargs: Any
    ) -> ProcessedPrompt:
        """Render, tokenize and (for vision-language models) load the images of a conversation.

        Image parts: {"type": "image_url", "image_url": {"url": ...}}, {"type": "image",
        "image" | "url" | "path": ...}, {"type": "input_image", "image_url": ...}; video parts:
        {"type": "video_url", "video_url": {"url": ...}}, {"type": "video", "video": ...}; a URL
        is a data: URL, or http(s) when remote media are enabled, or a local path when
        `allow_local_paths` (the offline API). The server calls this with the parts as is.
        """
        truncate = kwargs.pop("truncate_prompt_tokens", None)
        media: list[tuple[str, Any]] = []
        text = self.render_chat(messages, media=media, **kwargs)
        # The template already contains the special tokens (BOS included where the model uses
        # one), so they are not added again.
        ids = list(self.tokenizer(text, add_special_tokens=False).input_ids)
        prompt = {"prompt": text, "prompt_token_ids": ids}
        if media:
            prompt["multi_modal_data"] = self.mm_processor.multi_modal_data(media)
        return self.process(prompt, allow_local_paths, truncate_prompt_tokens=truncate)


_ROLES = ("system", "user", "assistant", "tool", "developer")


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise TypeError(f"message {index} must be a dict with 'role' and 'content'")
    role = message.get("role")
    if role not in _ROLES:
        raise ValueError(f"message {index} has role {role!r}; allowed roles: {', '.join(_ROLES)}")
    content = message.get("content", "")
    if content is None:
        content = ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, dict) or "type" not in part:
                raise ValueError(f"message {index} content part {j} needs a 'type'")
            if part["type"] == "text":
                texts.append(str(part.get("text", "")))
            elif part["type"] in ("image", "image_url", "input_image", "video", "video_url"):
                kind = "a video" if part["type"].startswith("video") else "an image"
                raise ValueError(
                    f"message {index} content part {j} is {kind}, but this model is text-only"
                )
            else:
                raise ValueError(
                    f"message {index} content part {j} has unsupported type {part['type']!r}"
                )
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise TypeError(f"message {index} content must be a string or a list of parts")
    out = dict(message)
    out["content"] = content
    return out
