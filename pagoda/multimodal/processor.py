"""Engine-side processing of image and video prompts for Qwen2-VL-style models.

Finds the images and videos in chat messages (vLLM's, OpenAI's and Hugging Face's part shapes),
has the chat template place one placeholder per item, loads and resizes them (videos: frames
sampled and decoded first), expands each placeholder to the item's token count, and computes the
prompt's M-RoPE positions. The result travels with the request as `MultiModalInputs`; the items'
content hashes key the prefix cache. Qwen3-VL writes a video as its temporal patches, each after
a "<t seconds>" timestamp and between vision start / end tokens, as its own processor does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from pagoda.config import MultiModalConfig
from pagoda.multimodal.image_loader import ImageLoader
from pagoda.multimodal.image_processor import ImageProcessorConfig, preprocess_image
from pagoda.multimodal.inputs import ImageInput, MultiModalInputs, mrope_positions
from pagoda.multimodal.video_loader import VideoLoader
from pagoda.multimodal.video_processor import (
    VideoOptions,
    preprocess_video,
    sample_frame_indices,
    split_temporal_patches,
    temporal_patch_times,
)

_ROLES = ("system", "user", "assistant", "tool", "developer")
# Content part types that carry an image: vLLM / OpenAI ("image_url"), OpenAI responses
# ("input_image"), Hugging Face / qwen-vl-utils ("image"), vLLM's PIL part ("image_pil").
_IMAGE_PART_TYPES = ("image", "image_url", "input_image", "image_pil")
# Keys of an {"type": "image", ...} part that may hold the image, in HF's order.
_IMAGE_KEYS = ("image", "url", "path", "image_url", "base64")
# Video parts: vLLM / OpenAI-style ("video_url"), Hugging Face / qwen-vl-utils ("video").
_VIDEO_PART_TYPES = ("video", "video_url")
_VIDEO_KEYS = ("video", "url", "path", "video_url")


class MultiModalProcessor:
    def __init__(
        self,
        hf_config: Any,
        tokenizer: Any | None,
        image_config: ImageProcessorConfig,
        mm_config: MultiModalConfig,
        max_model_len: int,
        video_options: VideoOptions | None = None,
    ) -> None:
        self.image_token_id: int = hf_config.image_token_id
        self.video_token_id: int | None = getattr(hf_config, "video_token_id", None)
        self.image_config = image_config
        self.video_options = video_options or VideoOptions()
        self.limit = mm_config.limit_per_prompt
        self.video_supported = self.video_token_id is not None
        # Qwen3-VL: timestamp text before each temporal patch instead of time positions.
        self.timestamped_video = getattr(hf_config, "model_type", None) == "qwen3_vl"
        self.tokenizer = tokenizer
        self.vision_start_id: int | None = getattr(hf_config, "vision_start_token_id", None)
        self.vision_end_id: int | None = getattr(hf_config, "vision_end_token_id", None)
        self.video_limit = mm_config.video_limit_per_prompt if self.video_supported else 0
        # Qwen2.5-VL spaces a video's temporal positions by its frame timing; Qwen2-VL (no
        # tokens_per_second) by one per temporal patch.
        self.tokens_per_second = getattr(hf_config.vision_config, "tokens_per_second", None)
        self.max_model_len = max_model_len
        self.loader = ImageLoader(mm_config)
        self.video_loader = VideoLoader(mm_config)
        # What the chat template emits per item, and what prompts for generate() must contain.
        self.image_token = "<|image_pad|>"
        self.placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
        self.video_token = "<|video_pad|>"
        self.video_placeholder = "<|vision_start|><|video_pad|><|vision_end|>"
        if tokenizer is not None:
            start = getattr(hf_config, "vision_start_token_id", None) or 0
            end = getattr(hf_config, "vision_end_token_id", None) or 0
            tokens = tokenizer.convert_ids_to_tokens([start, self.image_token_id, end])
            if all(isinstance(t, str) for t in tokens):
                self.image_token = tokens[1]
                self.placeholder = "".join(tokens)
            if self.video_token_id is not None:
                tokens = tokenizer.convert_ids_to_tokens([start, self.video_token_id, end])
                if all(isinstance(t, str) for t in tokens):
                    self.video_token = tokens[1]
                    self.video_placeholder = "".join(tokens)

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
        video_options = VideoOptions.from_model(
            model_path, mm_config.processor_kwargs, image_config.factor
        )
        return cls(hf_config, tokenizer, image_config, mm_config, max_model_len, video_options)

    # ------------------------------------------------------------------ chat

    def parse_chat(
        self, messages: Sequence[Any], inline_placeholders: bool = False
    ) -> tuple[list[dict[str, Any]], list[tuple[str, Any]]]:
        """Messages ready for the chat template, and the (kind, source) media in prompt order.

        A message with images or videos gets list content of {"type": "image"} / {"type":
        "video"} / {"type": "text"} parts (what Qwen-VL templates iterate); other messages keep
        plain string content. With `inline_placeholders` every message becomes a string with
        the placeholder text where each item was, for templates that only know string content.
        """
        out: list[dict[str, Any]] = []
        media: list[tuple[str, Any]] = []
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
                    if kind == "text":
                        parts.append({"type": "text", "text": value})
                    else:
                        media.append((kind, value))
                        parts.append({"type": kind})
                has_media = any(p["type"] != "text" for p in parts)
                if inline_placeholders or not has_media:
                    marks = {"image": self.placeholder, "video": self.video_placeholder}
                    content = "\n".join(marks.get(p["type"]) or p["text"] for p in parts)
                else:
                    content = parts
            elif not isinstance(content, str):
                raise TypeError(f"message {i} content must be a string or a list of parts")
            normalized = dict(message)
            normalized["content"] = content
            out.append(normalized)
        return out, media

    def render_chat(
        self, messages: Sequence[Any], apply_template: Callable[[list[dict[str, Any]]], str]
    ) -> tuple[str, list[tuple[str, Any]]]:
        """The rendered conversation (one placeholder per item) and the (kind, source) media."""
        normalized, media = self.parse_chat(messages)
        try:
            text = apply_template(normalized)
        except TypeError:  # a text-only template adds content to a string: `+ message.content`
            if not media:
                raise
            text = None
        n_images = sum(kind == "image" for kind, _ in media)
        n_videos = len(media) - n_images
        if media and (
            text is None
            or text.count(self.image_token) != n_images
            or text.count(self.video_token) != n_videos
        ):
            # The template does not iterate content parts (a text model's template prints the
            # list, or fails on it): give it strings with the placeholders already in place,
            # as vLLM does for templates of the "string" content format.
            normalized, _ = self.parse_chat(messages, inline_placeholders=True)
            text = apply_template(normalized)
        return text, media

    @staticmethod
    def multi_modal_data(media: Sequence[tuple[str, Any]]) -> dict[str, list[Any]]:
        """(kind, source) pairs -> vLLM's multi_modal_data {"image": [...], "video": [...]}."""
        data: dict[str, list[Any]] = {}
        for kind, source in media:
            data.setdefault(kind, []).append(source)
        return data

    # ------------------------------------------------------------------ prompts

    @staticmethod
    def media_of(multi_modal_data: Any) -> tuple[list[Any], list[Any]]:
        """(images, videos) of vLLM's `multi_modal_data` ({"image": one or a list, "video":
        one or a list}). A video is an array [T, H, W, 3], a path / URL / bytes, or a list of
        frames (PIL images or [H, W, 3] arrays)."""
        if multi_modal_data is None:
            return [], []
        if not isinstance(multi_modal_data, Mapping):
            raise TypeError(
                "multi_modal_data must be a dict such as {'image': image or list of images, "
                "'video': video or list of videos}"
            )
        unknown = set(multi_modal_data) - {"image", "video"}
        if unknown:
            raise ValueError(
                f"multi_modal_data: unsupported modality {', '.join(sorted(map(str, unknown)))}; "
                "pagoda accepts {'image': ..., 'video': ...}"
            )
        images = multi_modal_data.get("image")
        images = (
            []
            if images is None
            else (list(images) if isinstance(images, (list, tuple)) else [images])
        )
        videos = multi_modal_data.get("video")
        if videos is None:
            videos = []
        elif isinstance(videos, (list, tuple)) and videos and not _is_frame(videos[0]):
            videos = list(videos)  # several videos
        else:
            videos = [videos]  # one video: an array, a reference, or a list of frames
        return images, videos

    def process(
        self,
        token_ids: Sequence[int],
        images: Sequence[Any],
        allow_local_paths: bool = False,
        videos: Sequence[Any] = (),
    ) -> tuple[list[int], MultiModalInputs | None]:
        """Load the media, expand their placeholders; (token ids, inputs or None if none).

        Each item's placeholder in `token_ids` is one image / video token (as the chat template
        and vLLM-style prompts write it) or already the item's full run of tokens.
        """
        if videos and not self.video_supported:
            raise ValueError("this model does not accept videos; send images (or frames) instead")
        for kind, given, limit in (
            ("image", images, self.limit),
            ("video", videos, self.video_limit),
        ):
            if len(given) > limit:
                raise ValueError(
                    f"the prompt has {len(given)} {kind}s, but limit_mm_per_prompt allows "
                    f"{limit}; raise it with limit_mm_per_prompt={{'{kind}': {len(given)}}}"
                )
        runs = [(start, length, "image") for start, length in _runs(token_ids, self.image_token_id)]
        if self.video_token_id is not None:
            runs += [(s, n, "video") for s, n in _runs(token_ids, self.video_token_id)]
        runs.sort()
        for kind, given, placeholder in (
            ("image", images, self.placeholder),
            ("video", videos, self.video_placeholder),
        ):
            found = sum(r[2] == kind for r in runs)
            if found != len(given):
                raise ValueError(
                    f"the prompt has {found} {kind} placeholder(s) but {len(given)} {kind}(s) "
                    f"were given; write {placeholder} where each {kind} goes"
                )
        if not runs:
            return list(token_ids), None
        clips = [self._load_video(i, s, allow_local_paths) for i, s in enumerate(videos)]
        loaded: dict[str, list[ImageInput]] = {
            "image": [self._load_image(i, s, allow_local_paths) for i, s in enumerate(images)],
            "video": [video for video, _ in clips],
        }
        order = {"image": iter(loaded["image"]), "video": iter(clips)}
        index = {"image": 0, "video": 0}
        video_tokens: list[int] = []  # each video's tokens in the prompt (timestamps included)
        items: list[ImageInput] = []
        ids: list[int] = []
        placeholders: list[tuple[int, int]] = []
        prev = 0
        for start, length, kind in runs:
            item = next(order[kind])
            if kind == "video" and self.timestamped_video:
                if length != 1:
                    raise ValueError(
                        f"video {index[kind]}: its placeholder is {length} tokens long; write "
                        f"one video token ({self.video_placeholder}) where the video goes"
                    )
                index[kind] += 1
                ids.extend(token_ids[prev:start])
                prev = start + 1
                if (
                    ids
                    and ids[-1] == self.vision_start_id
                    and prev < len(token_ids)
                    and token_ids[prev] == self.vision_end_id
                ):
                    # the template's start / end tokens give way to each patch's own
                    ids.pop()
                    prev += 1
                before = len(ids)
                self._write_timestamped_video(*item, ids, placeholders, items)
                video_tokens.append(len(ids) - before)
                continue
            if kind == "video":
                item = item[0]
            if length not in (1, item.num_tokens):
                raise ValueError(
                    f"{kind} {index[kind]}: its placeholder is {length} tokens long; it must be "
                    f"one {kind} token or the {kind}'s {item.num_tokens} tokens"
                )
            index[kind] += 1
            token = self.image_token_id if kind == "image" else self.video_token_id
            ids.extend(token_ids[prev:start])
            placeholders.append((len(ids), item.num_tokens))
            ids.extend([token] * item.num_tokens)
            prev = start + length
            items.append(item)
        ids.extend(token_ids[prev:])
        if len(ids) >= self.max_model_len:
            raise ValueError(self._too_long(len(ids), loaded, video_tokens))
        positions, delta = mrope_positions(
            len(ids),
            placeholders,
            [item.grid_thw for item in items],
            self.image_config.merge_size,
            [self._time_scale(item) for item in items],
        )
        return ids, MultiModalInputs(items, placeholders, positions, delta)

    def _load_image(self, i: int, source: Any, allow_local_paths: bool) -> ImageInput:
        try:
            image = self.loader.load(source, allow_local_paths)
            return preprocess_image(image, self.image_config)
        except (ValueError, TypeError) as e:
            raise type(e)(f"image {i}: {e}") from None

    def _write_timestamped_video(
        self,
        video: ImageInput,
        times: Sequence[float],
        ids: list[int],
        placeholders: list[tuple[int, int]],
        items: list[ImageInput],
    ) -> None:
        """Append a Qwen3-VL video: per temporal patch "<t seconds>", vision start, its
        tokens, vision end; each patch becomes its own item."""
        patches = split_temporal_patches(video, self.image_config.temporal_patch_size)
        for patch, seconds in zip(patches, times, strict=True):
            ids.extend(self._timestamp_ids(seconds))
            ids.append(self.vision_start_id)
            placeholders.append((len(ids), patch.num_tokens))
            ids.extend([self.video_token_id] * patch.num_tokens)
            ids.append(self.vision_end_id)
            items.append(patch)

    def _timestamp_ids(self, seconds: float) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("Qwen3-VL videos need the tokenizer (their frames carry timestamps)")
        return list(self.tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False))

    def _load_video(
        self, i: int, source: Any, allow_local_paths: bool
    ) -> tuple[ImageInput, list[float]]:
        """The preprocessed video and the time of each temporal patch, in seconds."""
        options, tp = self.video_options, self.image_config.temporal_patch_size
        try:
            if isinstance(source, (list, tuple)) and any(
                isinstance(f, (str, bytes, os.PathLike)) for f in source
            ):
                # qwen-vl-utils' frame lists: each frame an image reference (same rules)
                source = [self.loader.load(f, allow_local_paths) for f in source]
            video = self.video_loader.load(
                source,
                lambda total, fps: sample_frame_indices(total, fps, options, tp),
                allow_local_paths,
            )
            # Frames given as arrays were sampled by the caller at `fps` frames a second.
            fps = options.fps if video.sample_fps is None else video.sample_fps
            count = video.frames.shape[0]
            if count > options.max_frames:
                raise ValueError(
                    f"the video has {count} frames, more than max_frames={options.max_frames}; "
                    "send fewer frames or raise the limit with mm_processor_kwargs="
                    f"{{'max_frames': {count}}}"
                )
            times = video.frame_times
            if times is None:  # given frames: one every 1 / fps seconds from the start
                times = np.arange(count, dtype=np.float64) / fps
            item = preprocess_video(video.frames, fps, options, self.image_config)
            return item, temporal_patch_times(times, tp)
        except (ValueError, TypeError) as e:
            raise type(e)(f"video {i}: {e}") from None

    def _time_scale(self, item: ImageInput) -> tuple[float, ...]:
        if item.modality != "video" or self.tokens_per_second is None:
            return (1.0,)
        return (item.second_per_grid, float(self.tokens_per_second))

    def _too_long(
        self, length: int, loaded: Mapping[str, list[ImageInput]], video_tokens: Sequence[int]
    ) -> str:
        parts = []
        videos = loaded["video"]
        counts = list(video_tokens) or [v.num_tokens for v in videos]
        if len(videos) == 1:
            v = videos[0]
            parts.append(
                f"the video needs {counts[0]} tokens ({v.pixels.shape[0]} frames of "
                f"{v.pixels.shape[2]}x{v.pixels.shape[1]})"
            )
        elif videos:
            parts.append(f"the videos need {', '.join(map(str, counts))} tokens")
        image_tokens = sum(img.num_tokens for img in loaded["image"])
        if loaded["image"]:
            parts.append(f"{len(loaded['image'])} image(s) need {image_tokens} tokens")
        hint = (
            "lower fps, max_frames, total_pixels or max_pixels with mm_processor_kwargs"
            if videos
            else "lower max_pixels with mm_processor_kwargs={'max_pixels': ...}, send smaller "
            "images"
        )
        return (
            f"the prompt is {length} tokens long ({'; '.join(parts)}), but max_model_len is "
            f"{self.max_model_len} and must leave room for at least one generated token; "
            f"{hint}, or raise max_model_len"
        )


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
    """("text", str), ("image", source) or ("video", source) of one content part."""
    if isinstance(part, str):
        return "text", part
    if not isinstance(part, dict):
        raise TypeError(f"message {i} content part {j} must be a dict or a string")
    kind = part.get("type")
    if kind is None:  # qwen-vl-utils style parts sometimes omit the type
        kind = next((k for k in ("text", "image", "image_url", "video") if k in part), None)
        if kind is None:
            raise ValueError(f"message {i} content part {j} needs a 'type'")
    if kind == "text":
        return "text", str(part.get("text", ""))
    if kind in _VIDEO_PART_TYPES:
        return "video", _video_source(i, j, part)
    if kind not in _IMAGE_PART_TYPES:
        raise ValueError(
            f"message {i} content part {j} has unsupported type {kind!r}; supported: text, "
            f"{', '.join(_IMAGE_PART_TYPES + _VIDEO_PART_TYPES)}"
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


def _video_source(i: int, j: int, part: dict[str, Any]) -> Any:
    key = next((k for k in _VIDEO_KEYS if part.get(k) is not None), None)
    source = None if key is None else part[key]
    if key == "video_url" and isinstance(source, dict):
        source = source.get("url")
    if source is None:
        raise ValueError(
            f"message {i} content part {j} is a video part without a video: use "
            '{"type": "video_url", "video_url": {"url": ...}} or {"type": "video", "video": ...}'
        )
    return source


def _is_frame(value: Any) -> bool:
    """A single video frame (PIL image or [H, W, C] array), not a whole video."""
    if hasattr(value, "getpixel"):  # PIL image
        return True
    shape = getattr(value, "shape", None)
    return shape is not None and len(shape) == 3


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
