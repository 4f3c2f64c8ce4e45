"""Calibration data for GPTQ: read a file, tokenise, truncate, shuffle, take `num_samples`.

Formats (chosen by content, not only by suffix): the conversation JSON of Qwen-VL fine-tuning
repos (`[{"conversations": [{"from": "human", "value": "<image>\\n..."}, ...]}]`, image/video
tags stripped, rendered with the chat template), JSONL records with `text` or `messages`, and
plain text (tokenised as one stream, cut into `max_seq_len` chunks). Errors name file and record.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Multimodal placeholders in fine-tuning data; the text-only calibration never sees pixels.
_MEDIA_TAG = re.compile(r"<(image|video)>\n?")
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


@dataclass(frozen=True)
class CalibrationData:
    """Token sequences ready for the calibration forward, and where they came from."""

    samples: list[torch.Tensor]  # each [T] int64, 1 <= T <= max_seq_len
    source: str
    num_records: int  # records (or plain-text chunks) available before sampling

    @property
    def num_tokens(self) -> int:
        return sum(int(s.numel()) for s in self.samples)


def _messages_from_conversation(path: Path, index: int, conv: Any) -> list[dict[str, str]]:
    if not isinstance(conv, list) or not conv:
        raise ValueError(f"{path}: record {index}: 'conversations' must be a non-empty list")
    messages = []
    for turn_no, turn in enumerate(conv):
        if not isinstance(turn, dict) or "value" not in turn:
            raise ValueError(
                f"{path}: record {index}: turn {turn_no} needs 'from' and 'value' keys"
            )
        role = _ROLES.get(str(turn.get("from", "")).lower())
        if role is None:
            raise ValueError(
                f"{path}: record {index}: turn {turn_no} has unknown 'from' "
                f"{turn.get('from')!r} (use human/gpt/system)"
            )
        if not isinstance(turn["value"], str):
            raise ValueError(f"{path}: record {index}: turn {turn_no} 'value' is not a string")
        messages.append({"role": role, "content": _MEDIA_TAG.sub("", turn["value"]).strip()})
    return messages


def _check_messages(path: Path, index: int, messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{path}: record {index}: 'messages' must be a non-empty list")
    for turn_no, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
            raise ValueError(
                f"{path}: record {index}: message {turn_no} needs 'role' and string 'content'"
            )
    return [{"role": m["role"], "content": _MEDIA_TAG.sub("", m["content"])} for m in messages]


def _record(path: Path, index: int, obj: Any) -> str | list[dict[str, str]]:
    """A text string or a chat (list of messages) from one JSON / JSONL record."""
    if not isinstance(obj, dict):
        raise ValueError(
            f"{path}: record {index}: expected a JSON object, got {type(obj).__name__}"
        )
    if "conversations" in obj:
        return _messages_from_conversation(path, index, obj["conversations"])
    if "messages" in obj:
        return _check_messages(path, index, obj["messages"])
    if "text" in obj:
        if not isinstance(obj["text"], str):
            raise ValueError(f"{path}: record {index}: 'text' is not a string")
        return obj["text"]
    raise ValueError(
        f"{path}: record {index}: no 'conversations', 'messages' or 'text' key "
        f"(keys: {', '.join(sorted(obj)) or 'none'})"
    )


def read_records(path: str | Path) -> list[str | list[dict[str, str]]] | str:
    """The file's records (JSON / JSONL), or its whole text (plain text)."""
    path = Path(path)
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
            records.append(_record(path, line_no, obj))
        return records
    if path.suffix == ".json" or stripped.startswith("["):
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON at line {e.lineno} ({e.msg})") from None
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        return [_record(path, i, obj) for i, obj in enumerate(data)]
    return raw


def _render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "\n".join(m["content"] for m in messages)


def _token_ids(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def load_calibration_data(
    path: str | Path,
    tokenizer: Any,
    num_samples: int = 256,
    max_seq_len: int = 2048,
    seed: int = 0,
) -> CalibrationData:
    """Tokenised calibration samples: every record (or chunk) truncated, shuffled with `seed`."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
    path = Path(path)
    records = read_records(path)
    sequences: list[list[int]] = []
    if isinstance(records, str):
        # One token stream cut into full-length chunks: a corpus has no record boundaries.
        ids = _token_ids(tokenizer, records, add_special_tokens=True)
        sequences = [ids[i : i + max_seq_len] for i in range(0, len(ids), max_seq_len)]
        sequences = [s for s in sequences if len(s) >= 2]
    else:
        for index, record in enumerate(records):
            if isinstance(record, str):
                ids = _token_ids(tokenizer, record, add_special_tokens=True)
            else:
                # The chat template already carries the special tokens (BOS, turn markers).
                ids = _token_ids(tokenizer, _render_chat(tokenizer, record), False)
            if len(ids) >= 2:
                sequences.append(ids[:max_seq_len])
            elif len(records) == 1:
                raise ValueError(f"{path}: record {index} has no text after tokenisation")
    if not sequences:
        raise ValueError(f"{path}: no calibration text found (every record is empty)")
    order = list(range(len(sequences)))
    random.Random(seed).shuffle(order)
    chosen = [torch.tensor(sequences[i], dtype=torch.long) for i in order[:num_samples]]
    return CalibrationData(chosen, str(path), len(sequences))
