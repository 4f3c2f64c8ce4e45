"""Calibration data for GPTQ: read a file, tokenise, truncate, shuffle, take `num_samples`.

Formats (chosen by content, not only by suffix; `formats_help()` shows one example each): chat
records as OpenAI/HF `messages` (string or list-of-parts content), LLaVA/ShareGPT
`conversations` (`from`/`value`), `text` records, in a JSON list or JSONL, and plain text
(tokenised as one stream, cut into `max_seq_len` chunks). Chats are rendered with the chat
template. With a `MultiModalProcessor` (vision-language models), image / video parts and
`<image>` / `<video>` tags stay in place: the samples carry the media (`mm_inputs`) and the
calibration forward runs them through the vision tower. Without one the decoder is calibrated on
text only and the media are dropped (one line on stderr says how many). Errors name the file and
the record.
"""

from __future__ import annotations

import json
import random
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pagoda.multimodal.inputs import MultiModalInputs
    from pagoda.multimodal.processor import MultiModalProcessor

# Multimodal placeholders in fine-tuning data (LLaVA / ShareGPT `<image>` tags).
_MEDIA_TAG = re.compile(r"<(image|video)>\n?")
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
}
# Content-part types that carry pixels (OpenAI `image_url`, HF `image` / `video`).
_MEDIA_PARTS = ("image", "image_url", "video", "video_url", "input_image")

# One record per format, shown by `pagoda quantize --help` (and loaded by the tests).
FORMAT_EXAMPLES: dict[str, Any] = {
    "messages": {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": "a.jpg"},
                    {"type": "text", "text": "What is this?"},
                ],
            },
            {"role": "assistant", "content": "A cat."},
        ]
    },
    "conversations": {
        "conversations": [
            {"from": "human", "value": "<image>\nWhat is this?"},
            {"from": "gpt", "value": "A cat."},
        ]
    },
    "text": {"text": "Any document."},
}


def formats_help() -> str:
    """The --help epilog: one line per format, with an example record."""
    lines = ["calibration formats (--dataset FILE: a JSON list of records, or JSONL):"]
    for name, record in FORMAT_EXAMPLES.items():
        lines.append(f"  {name:<14}{json.dumps(record, ensure_ascii=False)}")
    lines += [
        f"  {'plain text':<14}any other file: one token stream, cut into --max-seq-len chunks",
        "chats go through the model's chat template; a vision-language model sees their images "
        "and videos (the vision tower runs unquantized; --text-only-calibration drops them)",
    ]
    return "\n".join(lines)


@dataclass
class _Dropped:
    """Media dropped while reading chats (reported once, not per record), and the image
    references met on the way (checked by `check_calibration_file`)."""

    parts: int = 0
    kept: int = 0  # of `parts`: placed in a message's "parts" (a tag without a file is not)
    records: set[str] = field(default_factory=set)
    images: list[tuple[str, Any]] = field(default_factory=list)  # (where, source)

    def add(self, index: str, n: int) -> None:
        if n:
            self.parts += n
            self.records.add(index)


@dataclass(frozen=True)
class CalibrationData:
    """Token sequences ready for the calibration forward, and where they came from."""

    samples: list[torch.Tensor]  # each [T] int64, 1 <= T <= max_seq_len
    source: str
    num_records: int  # records (or plain-text chunks) available before sampling
    # per sample: its images / videos and M-RoPE positions (None: text only); empty when the
    # media were dropped
    mm_inputs: list[MultiModalInputs | None] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(int(s.numel()) for s in self.samples)

    @property
    def num_vision_tokens(self) -> int:
        """Image / video tokens among `num_tokens` (their rows come from the vision tower)."""
        total = 0
        for ids, mm in zip(self.samples, self.mm_inputs):
            if mm is not None:
                n = int(ids.numel())
                total += sum(max(0, min(off + length, n) - off) for off, length in mm.placeholders)
        return total


def _strip_tags(text: str, index: str, dropped: _Dropped) -> str:
    stripped, n = _MEDIA_TAG.subn("", text)
    dropped.add(index, n)
    return stripped


def _tagged_parts(text: str, media: dict[str, list[Any]]) -> list[dict[str, Any]] | None:
    """A LLaVA turn's text as parts, each `<image>` / `<video>` tag the record's next file of
    that kind (None: no tag, or no file left for one)."""
    pieces = _MEDIA_TAG.split(text)  # text, kind, text, kind, ...
    if len(pieces) == 1:
        return None
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            if piece:
                parts.append({"type": "text", "text": piece})
        elif not media[piece]:
            return None
        else:
            parts.append({"type": piece, piece: media[piece].pop(0)})
    return parts


def _record_media(obj: dict[str, Any], key: str) -> list[Any]:
    value = obj.get(key) or obj.get(key + "s") or []
    return list(value) if isinstance(value, list) else [value]


def _messages_from_conversation(
    path: Path, index: str, conv: Any, dropped: _Dropped, media: dict[str, list[Any]]
) -> list[dict[str, Any]]:
    if not isinstance(conv, list) or not conv:
        raise ValueError(f"{path}: {index}: 'conversations' must be a non-empty list")
    messages = []
    for turn_no, turn in enumerate(conv):
        if isinstance(turn, dict) and "value" not in turn and "content" in turn:
            # some ShareGPT exports use role/content inside `conversations`
            messages.append(_message(path, index, turn_no, turn, dropped))
            continue
        if not isinstance(turn, dict) or "value" not in turn:
            raise ValueError(f"{path}: {index}: turn {turn_no} needs 'from' and 'value' keys")
        role = _ROLES.get(str(turn.get("from", "")).lower())
        if role is None:
            raise ValueError(
                f"{path}: {index}: turn {turn_no} has unknown 'from' "
                f"{turn.get('from')!r} (use human/gpt/system)"
            )
        if not isinstance(turn["value"], str):
            raise ValueError(f"{path}: {index}: turn {turn_no} 'value' is not a string")
        message: dict[str, Any] = {
            "role": role,
            "content": _strip_tags(turn["value"], index, dropped).strip(),
        }
        parts = _tagged_parts(turn["value"].strip(), media)
        if parts is not None:
            message["parts"] = parts
            dropped.kept += sum(p["type"] != "text" for p in parts)
        messages.append(message)
    return messages


def _content_text(
    path: Path, index: str, turn_no: int, content: Any, dropped: _Dropped
) -> tuple[str, list[dict[str, Any]] | None]:
    """A message's text (its text parts joined, media parts dropped) and, when it has media,
    its parts in order: {"type": "text" | "image" | "video", ...}."""
    if content is None:
        return "", None  # e.g. an assistant turn that only made tool calls
    if isinstance(content, str):
        return _strip_tags(content, index, dropped), None
    if not isinstance(content, list):
        raise ValueError(
            f"{path}: {index}: message {turn_no} 'content' must be a string or a list "
            f"of parts, got {type(content).__name__}"
        )
    texts = []
    parts: list[dict[str, Any]] = []
    has_media = False
    for part_no, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            parts.append({"type": "text", "text": part})
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text") and isinstance(part.get("text"), str):
            texts.append(_strip_tags(part["text"], index, dropped))
            parts.append({"type": "text", "text": part["text"]})
        elif kind in _MEDIA_PARTS:
            dropped.add(index, 1)
            dropped.kept += 1
            has_media = True
            parts.append(part)  # the serving path's part parser reads every part shape
            source = _image_source(part)
            if source is not None and not kind.startswith("video"):
                dropped.images.append((f"{index}: message {turn_no} part {part_no}", source))
        else:
            raise ValueError(
                f"{path}: {index}: message {turn_no} part {part_no} is not a text or "
                'image part (expected {"type": "text", "text": ...} or {"type": "image", ...})'
            )
    return "\n".join(t for t in texts if t), parts if has_media else None


def _message(path: Path, index: str, turn_no: int, m: Any, dropped: _Dropped) -> dict[str, Any]:
    """{"role", "content": text} and, for a message with media, "parts" (text and media)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
        raise ValueError(f"{path}: {index}: message {turn_no} needs 'role' and 'content' keys")
    text, parts = _content_text(path, index, turn_no, m["content"], dropped)
    message: dict[str, Any] = {"role": m["role"], "content": text}
    if parts is not None:
        message["parts"] = parts
    return message


def _check_messages(
    path: Path, index: str, messages: Any, dropped: _Dropped
) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{path}: {index}: 'messages' must be a non-empty list")
    return [_message(path, index, i, m, dropped) for i, m in enumerate(messages)]


def _record(path: Path, index: str, obj: Any, dropped: _Dropped) -> str | list[dict[str, Any]]:
    """A text string or a chat (list of messages) from one JSON / JSONL record."""
    if isinstance(obj, str):
        return obj  # a JSON list of plain strings
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: {index}: expected a JSON object, got {type(obj).__name__}")
    if "conversations" in obj:
        # LLaVA keeps the image / video file(s) beside the conversation
        media = {kind: _record_media(obj, kind) for kind in ("image", "video")}
        for source in media["image"]:
            dropped.images.append((f"{index}: 'image'", source))
        return _messages_from_conversation(path, index, obj["conversations"], dropped, media)
    if "messages" in obj:
        return _check_messages(path, index, obj["messages"], dropped)
    if "text" in obj:
        if not isinstance(obj["text"], str):
            raise ValueError(f"{path}: {index}: 'text' is not a string")
        return obj["text"]
    raise ValueError(
        f"{path}: {index}: no 'conversations', 'messages' or 'text' key "
        f"(keys: {', '.join(sorted(obj)) or 'none'})"
    )


def read_records(
    path: str | Path, keep_media: bool = False
) -> list[str | list[dict[str, Any]]] | str:
    """The file's records (JSON / JSONL), or its whole text (plain text).

    Chat messages are {"role", "content": text}, with "parts" (text and media, in order) where
    they hold media. Unless `keep_media`, the media count as dropped: one line on stderr.
    """
    path = Path(path)
    dropped = _Dropped()
    records = _read(path, dropped)
    if keep_media and dropped.parts > dropped.kept:
        print(
            f"note: {path.name}: {dropped.parts - dropped.kept} image/video part(s) dropped: "
            "their record names no image / video file for the tag (its text is calibrated on)",
            file=sys.stderr,
        )
    elif dropped.parts and not keep_media:
        print(
            f"note: {path.name}: {dropped.parts} image/video part(s) in {len(dropped.records)} "
            "record(s) dropped: the text decoder is calibrated on the text only (the vision "
            "tower stays unquantized)",
            file=sys.stderr,
        )
    return records


def _read(path: Path, dropped: _Dropped) -> list[str | list[dict[str, Any]]] | str:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: calibration file not found")
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None
    if not raw.strip():
        raise ValueError(f"{path}: calibration file is empty")
    stripped = raw.lstrip()
    if path.suffix == ".jsonl" or (path.suffix != ".json" and stripped.startswith("{")):
        records = []
        for line_no, line in enumerate(raw.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {line_no}: invalid JSON ({e.msg})") from None
            records.append(_record(path, f"line {line_no}", obj, dropped))
        return records
    if path.suffix == ".json" or stripped.startswith("["):
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON at line {e.lineno} ({e.msg})") from None
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        lines = _record_lines(raw, len(data))
        return [
            _record(path, f"record {i} (line {line})", obj, dropped)
            for i, (obj, line) in enumerate(zip(data, lines, strict=True))
        ]
    return raw


def _record_lines(raw: str, count: int) -> list[int]:
    """The line each element of a JSON list (already parsed: valid JSON) starts on."""
    decoder = json.JSONDecoder()
    pos = raw.index("[") + 1
    lines = []
    for _ in range(count):
        while raw[pos] in " \t\r\n,":
            pos += 1
        lines.append(raw.count("\n", 0, pos) + 1)
        _, pos = decoder.raw_decode(raw, pos)
    return lines


def _image_source(part: dict[str, Any]) -> Any:
    """The reference an image part carries (OpenAI `image_url`, HF `image`), if any."""
    for key in ("image_url", "image", "input_image", "url", "path"):
        value = part.get(key)
        if isinstance(value, dict):
            value = value.get("url")
        if isinstance(value, str):
            return value
    return None


@dataclass(frozen=True)
class CalibrationCheck:
    """What `check_calibration_file` found: records, the usable ones, images decoded."""

    records: int
    usable: int  # records (or plain-text chunks) with some text
    images_checked: int
    images_remote: int  # http(s) URLs: not fetched (the decoder is calibrated on text)


def _has_text(record: str | list[dict[str, Any]]) -> bool:
    if isinstance(record, str):
        return bool(record.strip())
    return any(m["content"].strip() for m in record)


def check_calibration_file(path: str | Path) -> CalibrationCheck:
    """Validate a calibration file without a model or tokenizer: its format, at least one
    record with text, and every image it references decodable (local paths relative to the
    file; http(s) URLs are not fetched). Errors name the file and the line of the first bad
    record; `quantize` runs this before it loads anything."""
    from pagoda.config import MultiModalConfig
    from pagoda.multimodal.image_loader import ImageLoader

    path = Path(path)
    dropped = _Dropped()
    records = _read(path, dropped)
    if isinstance(records, str):
        return CalibrationCheck(1, 1, 0, 0)
    usable = sum(_has_text(r) for r in records)
    if not usable:
        raise ValueError(
            f"{path}: no usable calibration sample: every one of the {len(records)} record(s) "
            "is empty once image parts and <image> tags are removed"
        )
    loader = ImageLoader(MultiModalConfig())
    checked = remote = 0
    for where, source in dropped.images:
        if not isinstance(source, str):
            raise ValueError(f"{path}: {where}: an image reference must be a string")
        if source.startswith(("http://", "https://")):
            remote += 1
            continue
        local = source
        if not source.startswith(("data:", "file:")) and not Path(source).is_absolute():
            local = str(path.parent / source)
        try:
            loader.load(local, allow_local_paths=True)
        except ValueError as e:
            raise ValueError(f"{path}: {where}: image not decodable ({e})") from None
        checked += 1
    return CalibrationCheck(len(records), usable, checked, remote)


def _render_chat(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "\n".join(m["content"] for m in messages)


def _local(base: Path, source: Any) -> Any:
    """A relative file reference resolved against the calibration file's folder."""
    if not isinstance(source, str) or source.startswith(("data:", "file:", "http://", "https://")):
        return source
    return source if Path(source).is_absolute() else str(base / source)


def _with_local_media(base: Path, part: dict[str, Any]) -> dict[str, Any]:
    part = dict(part)
    for key in ("image", "video", "url", "path", "image_url", "video_url", "input_image"):
        value = part.get(key)
        if isinstance(value, dict) and "url" in value:
            part[key] = {**value, "url": _local(base, value["url"])}
        elif value is not None:
            part[key] = _local(base, value)
    return part


def _multimodal_sample(
    path: Path,
    tokenizer: Any,
    messages: list[dict[str, Any]],
    processor: MultiModalProcessor,
) -> tuple[list[int], MultiModalInputs | None]:
    """A chat with its media: rendered and expanded as the serving path does it."""
    chat = []
    for m in messages:
        parts = m.get("parts")
        content = (
            m["content"] if parts is None else [_with_local_media(path.parent, p) for p in parts]
        )
        chat.append({"role": m["role"], "content": content})
    text, media = processor.render_chat(
        chat, lambda msgs: tokenizer.apply_chat_template(msgs, tokenize=False)
    )
    ids = _token_ids(tokenizer, text, False)
    images = [source for kind, source in media if kind == "image"]
    videos = [source for kind, source in media if kind == "video"]
    return processor.process(ids, images, allow_local_paths=True, videos=videos)


def _token_ids(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    # verbose=False: a corpus longer than model_max_length is cut into chunks below, so
    # transformers' "Token indices sequence length is longer than ..." warning is noise.
    return list(tokenizer(text, add_special_tokens=add_special_tokens, verbose=False)["input_ids"])


def load_calibration_data(
    path: str | Path,
    tokenizer: Any,
    num_samples: int = 256,
    max_seq_len: int = 2048,
    seed: int = 0,
    mm_processor: MultiModalProcessor | None = None,
) -> CalibrationData:
    """Tokenised calibration samples: every record (or chunk) truncated, shuffled with `seed`.

    With `mm_processor`, chats keep their images and videos: placeholders expanded, media
    loaded and resized as when serving (local files relative to `path`), M-RoPE positions
    computed; a truncated sample keeps the tokens (and positions) before the cut.
    """
    import torch  # here, not at the top: `pagoda --help` shows this module's formats_help

    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
    path = Path(path)
    records = read_records(path, keep_media=mm_processor is not None)
    sequences: list[list[int]] = []
    media: list[MultiModalInputs | None] = []
    if isinstance(records, str):
        # One token stream cut into full-length chunks: a corpus has no record boundaries.
        ids = _token_ids(tokenizer, records, add_special_tokens=True)
        sequences = [ids[i : i + max_seq_len] for i in range(0, len(ids), max_seq_len)]
        sequences = [s for s in sequences if len(s) >= 2]
    else:
        for number, record in enumerate(records):
            mm = None
            if isinstance(record, str):
                ids = _token_ids(tokenizer, record, add_special_tokens=True)
            elif mm_processor is not None and any("parts" in m for m in record):
                try:
                    ids, mm = _multimodal_sample(path, tokenizer, record, mm_processor)
                except (ValueError, TypeError) as e:
                    raise type(e)(f"{path}: record {number}: {e}") from None
            else:
                # The chat template already carries the special tokens (BOS, turn markers).
                ids = _token_ids(tokenizer, _render_chat(tokenizer, record), False)
            if len(ids) >= 2:
                sequences.append(ids[:max_seq_len])
                media.append(mm)
            elif len(records) == 1:
                raise ValueError(f"{path}: the only record has no text after tokenisation")
    if not sequences:
        raise ValueError(f"{path}: no calibration text found (every record is empty)")
    order = list(range(len(sequences)))
    random.Random(seed).shuffle(order)
    chosen = [torch.tensor(sequences[i], dtype=torch.long) for i in order[:num_samples]]
    mm_inputs = [media[i] for i in order[:num_samples]] if any(media) else []
    return CalibrationData(chosen, str(path), len(sequences), mm_inputs)
