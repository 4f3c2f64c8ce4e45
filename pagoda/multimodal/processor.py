"""Engine-side processing of image prompts for Qwen2-VL-style models.

Finds the images in chat messages (vLLM's, OpenAI's and Hugging Face's part shapes), has the chat
template place one placeholder per image, loads and resizes the images, expands each placeholder
to the image's token count, and computes the prompt's M-RoPE positions. The result travels with
the request as `MultiModalInputs`; its image hashes key the prefix cache.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pagoda.config import MultiModalConfig
from pagoda.multimodal.image_loader import ImageLoader
from pagoda.multimodal.image_processor import ImageProcessorConfig, preprocess_image
from pagoda.multimodal.inputs import ImageInput, MultiModalInputs, mrope_positions

_ROLES = ("system", "user", "assistant", "tool", "developer")
# Content part types that carry an image: vLLM / OpenAI ("image_url"), OpenAI responses
# ("input_image"), Hugging Face / qwen-vl-utils ("image"), vLLM's PIL part ("image_pil").
_IMAGE_PART_TYPES = ("image", "image_url", "input_image", "image_pil")
# Keys of an {"type": "image", ...} part that may hold the image, in HF's order.
_IMAGE_KEYS = ("image", "url", "path", "image_url", "base64")


class MultiModalProcessor:
    def __init__(
        self,
        hf_config: Any,
        tokenizer: Any | None,
        image_config: ImageProcessorConfig,
        mm_config: MultiModalConfig,
        max_model_len: int,
    ) -> None:
        self.image_token_id: int = hf_config.image_token_id
        self.video_token_id: int | None = getattr(hf_config, "video_token_id", None)
        self.image_config = image_config
        self.limit = mm_config.limit_per_prompt
        self.max_model_len = max_model_len
        self.loader = ImageLoader(mm_config)
        # What the chat template emits per image, and what prompts for generate() must contain.
        self.image_token = "<|image_pad|>"
        self.placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
        if tokenizer is not None:
            tokens = tokenizer.convert_ids_to_tokens(
                [
                    getattr(hf_config, "vision_start_token_id", None) or 0,
                    self.image_token_id,
                    getattr(hf_config, "vision_end_token_id", None) or 0,
                ]
            )
            if all(isinstance(t, str) for t in tokens):
                self.image_token = tokens[1]
                self.placeholder = "".join(tokens)

    @classmethod
    def from_model(
        cls,
        model_path: str | None,
        hf_config: Any,
        tokenizer: Any | None,
        mm_config: MultiModalConfig,
        max_model_len: int,
    ) -> MultiModalProcessor:
        image_config = ImageProcessorConfig.from_model(
            model_path, hf_config.vision_config, mm_config.processor_kwargs
        )
        if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
            # Qwen-VL releases keep the (vision-aware) template with the processor, in
            # chat_template.json, which AutoTokenizer does not read.
            template = _processor_chat_template(model_path)
            if template:
                tokenizer.chat_template = template
        return cls(hf_config, tokenizer, image_config, mm_config, max_model_len)

    # ------------------------------------------------------------------ chat

    def parse_chat(
        self, messages: Sequence[Any], inline_placeholders: bool = False
    ) -> tuple[list[dict[str, Any]], list[Any]]:
        """Messages ready for the chat template, and the image sources in prompt order.

        A message with images gets list content of {"type": "image"} / {"type": "text"} parts
        (what Qwen-VL templates iterate); other messages keep plain string content. With
        `inline_placeholders` every message becomes a string with the placeholder text where
        each image was, for templates that only know string content.
        """
        out: list[dict[str, Any]] = []
        images: list[Any] = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise TypeError(f"message {i} must be a dict with 'role' and 'content'")
            role = message.get("role")
            if role not in _ROLES:
                raise ValueError(
                    f"message {i} has role {role!r}; allowed roles: {', '.join(_ROLES)}"
                )
            content = message.get("content")
            content = "" if content is None else content
            if isinstance(content, list):
                parts: list[dict[str, Any]] = []
                for j, part in enumerate(content):
                    kind, value = _parse_part(i, j, part)
                    if kind == "image":
                        images.append(value)
                        parts.append({"type": "image"})
                    else:
                        parts.append({"type": "text", "text": value})
                has_image = any(p["type"] == "image" for p in parts)
                if inline_placeholders or not has_image:
                    content = "\n".join(
                        self.placeholder if p["type"] == "image" else p["text"] for p in parts
                    )
                else:
                    content = parts
            elif not isinstance(content, str):
                raise TypeError(f"message {i} content must be a string or a list of parts")
            normalized = dict(message)
            normalized["content"] = content
            out.append(normalized)
        return out, images

    def render_chat(
        self, messages: Sequence[Any], apply_template: Callable[[list[dict[str, Any]]], str]
    ) -> tuple[str, list[Any]]:
        """The rendered conversation (one placeholder per image) and the image sources."""
        normalized, images = self.parse_chat(messages)
        try:
            text = apply_template(normalized)
        except TypeError:  # a text-only template adds content to a string: `+ message.content`
            if not images:
                raise
            text = None
        if images and (text is None or text.count(self.image_token) != len(images)):
            # The template does not iterate content parts (a text model's template prints the
            # list, or fails on it): give it strings with the placeholders already in place,
            # as vLLM does for templates of the "string" content format.
            normalized, _ = self.parse_chat(messages, inline_placeholders=True)
            text = apply_template(normalized)
        return text, images

    # ------------------------------------------------------------------ prompts

    @staticmethod
    def images_of(multi_modal_data: Any) -> list[Any]:
        """The images of vLLM's `multi_modal_data` ({"image": one or a list})."""
        if multi_modal_data is None:
            return []
        if not isinstance(multi_modal_data, Mapping):
            raise TypeError(
                "multi_modal_data must be a dict such as {'image': image or list of images}"
            )
        unknown = set(multi_modal_data) - {"image"}
        if unknown:
            raise ValueError(
                f"multi_modal_data: unsupported modality {', '.join(sorted(map(str, unknown)))}; "
                "pagoda accepts {'image': ...} only"
            )
        images = multi_modal_data.get("image")
        if images is None:
            return []
        return list(images) if isinstance(images, (list, tuple)) else [images]

    def process(
        self, token_ids: Sequence[int], images: Sequence[Any], allow_local_paths: bool = False
    ) -> tuple[list[int], MultiModalInputs | None]:
        """Load the images, expand their placeholders; (token ids, inputs or None if no image).

        Each image's placeholder in `token_ids` is one image token (as the chat template and
        vLLM-style prompts write it) or already the image's full run of tokens.
        """
        if len(images) > self.limit:
            raise ValueError(
                f"the prompt has {len(images)} images, but limit_mm_per_prompt allows "
                f"{self.limit}; raise it with limit_mm_per_prompt={{'image': {len(images)}}}"
            )
        if self.video_token_id is not None and self.video_token_id in token_ids:
            raise ValueError("the prompt contains a video placeholder; videos are not supported")
        runs = _runs(token_ids, self.image_token_id)
        if len(runs) != len(images):
            raise ValueError(
                f"the prompt has {len(runs)} image placeholder(s) but {len(images)} image(s) "
                f"were given; write {self.placeholder} where each image goes"
            )
        if not images:
            return list(token_ids), None
        processed: list[ImageInput] = []
        for i, source in enumerate(images):
            try:
                image = self.loader.load(source, allow_local_paths)
                processed.append(preprocess_image(image, self.image_config))
            except (ValueError, TypeError) as e:
                raise type(e)(f"image {i}: {e}") from None
        ids: list[int] = []
        placeholders: list[tuple[int, int]] = []
        prev = 0
        for i, ((start, length), image) in enumerate(zip(runs, processed, strict=True)):
            if length not in (1, image.num_tokens):
                raise ValueError(
                    f"image {i}: its placeholder is {length} tokens long; it must be one image "
                    f"token or the image's {image.num_tokens} tokens"
                )
            ids.extend(token_ids[prev:start])
            placeholders.append((len(ids), image.num_tokens))
            ids.extend([self.image_token_id] * image.num_tokens)
            prev = start + length
        ids.extend(token_ids[prev:])
        if len(ids) >= self.max_model_len:
            image_tokens = sum(img.num_tokens for img in processed)
            raise ValueError(
                f"the prompt is {len(ids)} tokens long ({image_tokens} of them for "
                f"{len(processed)} image(s)), but max_model_len is {self.max_model_len} and "
                "must leave room for at least one generated token; lower max_pixels with "
                "mm_processor_kwargs={'max_pixels': ...}, send smaller images, or raise "
                "max_model_len"
            )
        positions, delta = mrope_positions(
            len(ids),
            placeholders,
            [img.grid_thw for img in processed],
            self.image_config.merge_size,
        )
        return ids, MultiModalInputs(processed, placeholders, positions, delta)


def _processor_chat_template(model_path: str | None) -> str | None:
    if not model_path or not os.path.isdir(model_path):
        return None
    jinja = os.path.join(model_path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    path = os.path.join(model_path, "chat_template.json")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                template = json.load(f).get("chat_template")
        except (OSError, json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"{path}: cannot read the chat template ({e})") from e
        return template if isinstance(template, str) else None
    return None


def _parse_part(i: int, j: int, part: Any) -> tuple[str, Any]:
    """("text", str) or ("image", source) of one content part."""
    if isinstance(part, str):
        return "text", part
    if not isinstance(part, dict):
        raise TypeError(f"message {i} content part {j} must be a dict or a string")
    kind = part.get("type")
    if kind is None:  # qwen-vl-utils style parts sometimes omit the type
        kind = next((k for k in ("text", "image", "image_url") if k in part), None)
        if kind is None:
            raise ValueError(f"message {i} content part {j} needs a 'type'")
    if kind == "text":
        return "text", str(part.get("text", ""))
    if kind not in _IMAGE_PART_TYPES:
        raise ValueError(
            f"message {i} content part {j} has unsupported type {kind!r}; supported: text, "
            f"{', '.join(_IMAGE_PART_TYPES)}"
        )
    if kind in ("image_url", "input_image"):
        source = part.get("image_url")
        if isinstance(source, dict):
            source = source.get("url")
    elif kind == "image_pil":
        source = part.get("image_pil")
    else:
        key = next((k for k in _IMAGE_KEYS if part.get(k) is not None), None)
        source = None if key is None else part[key]
        if key == "image_url" and isinstance(source, dict):
            source = source.get("url")
        elif key == "base64" and isinstance(source, str):
            source = "data:image;base64," + source
    if source is None:
        raise ValueError(
            f"message {i} content part {j} is an image part without an image: use "
            '{"type": "image_url", "image_url": {"url": ...}} or {"type": "image", "image": ...}'
        )
    return "image", source


def _runs(token_ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `token`."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate(token_ids):
        if t == token:
            if start is None:
                start = i
        elif start is not None:
            runs.append((start, i - start))
            start = None
    if start is not None:
        runs.append((start, len(token_ids) - start))
    return runs
