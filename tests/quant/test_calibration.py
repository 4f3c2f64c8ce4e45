"""Calibration data: every format, truncation, seeded shuffling, and errors naming the record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagoda.quant.calibration import load_calibration_data


class _Tok:
    """Whitespace tokenizer with a chat template stand-in (ids are word lengths)."""

    chat_template = "yes"

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = [len(w) for w in text.split()]
        return {"input_ids": ([0] if add_special_tokens else []) + ids}

    def apply_chat_template(self, messages, tokenize: bool = False) -> str:
        return " ".join(f"<{m['role']}> {m['content']}" for m in messages)


def test_qwen_vl_conversation_json(tmp_path: Path) -> None:
    records = [
        {
            "id": i,
            "image": "a.jpg",
            "conversations": [
                {"from": "human", "value": "<image>\nwhat is shown here"},
                {"from": "gpt", "value": "a cat " * i},
            ],
        }
        for i in range(1, 6)
    ]
    path = tmp_path / "train.json"
    path.write_text(json.dumps(records))
    data = load_calibration_data(path, _Tok(), num_samples=3, max_seq_len=6, seed=0)
    assert len(data.samples) == 3 and data.num_records == 5
    assert all(2 <= len(s) <= 6 for s in data.samples)
    # "<image>" is stripped: the first user word is "what" (4), after "<user>" (6).
    assert data.samples[0].tolist()[:2] == [6, 4]
    again = load_calibration_data(path, _Tok(), num_samples=3, max_seq_len=6, seed=0)
    assert [s.tolist() for s in again.samples] == [s.tolist() for s in data.samples]


def test_jsonl_text_and_messages(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"text": "one two three"})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi there"}]})
        + "\n"
    )
    data = load_calibration_data(path, _Tok(), num_samples=10, max_seq_len=100)
    assert sorted(s.tolist() for s in data.samples) == sorted([[0, 3, 3, 5], [6, 2, 5]])


def test_plain_text_is_chunked(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text("word " * 25)
    data = load_calibration_data(path, _Tok(), num_samples=100, max_seq_len=8)
    assert sorted(len(s) for s in data.samples) == [2, 8, 8, 8]  # 26 ids: BOS + 25 words


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("missing.json", None, "missing.json: calibration file not found"),
        ("empty.txt", "  \n", "empty.txt: calibration file is empty"),
        ("bad.jsonl", '{"text": "ok"}\n{"text": ', "bad.jsonl: line 2: invalid JSON"),
        ("nokey.jsonl", '{"text": "ok"}\n{"prompt": "x"}', "nokey.jsonl: record 2: no"),
        (
            "conv.json",
            '[{"conversations": [{"from": "robot", "value": "x"}]}]',
            "conv.json: record 0: turn 0 has unknown 'from'",
        ),
        ("obj.json", '{"text": 1}', "obj.json: expected a JSON list"),
    ],
)
def test_errors_name_file_and_record(tmp_path: Path, name, content, message) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises((ValueError, FileNotFoundError), match=message.replace("(", r"\(")):
        load_calibration_data(path, _Tok())
