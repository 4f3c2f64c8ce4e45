"""Calibration data: every format, truncation, seeded shuffling, and errors naming the record."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pagoda.quantizer.calibration import (
    FORMAT_EXAMPLES,
    check_calibration_file,
    formats_help,
    load_calibration_data,
)


class _Tok:
    """Whitespace tokenizer with a chat template stand-in (ids are word lengths)."""

    chat_template = "yes"

    def __call__(self, text: str, add_special_tokens: bool = True, verbose: bool = True) -> dict:
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
        ("nokey.jsonl", '{"text": "ok"}\n{"prompt": "x"}', "nokey.jsonl: line 2: no"),
        (
            "conv.json",
            '[{"conversations": [{"from": "robot", "value": "x"}]}]',
            "conv.json: record 0 (line 1): turn 0 has unknown 'from'",
        ),
        ("obj.json", '{"text": 1}', "obj.json: expected a JSON list"),
    ],
)
def test_errors_name_file_and_record(tmp_path: Path, name, content, message) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises((ValueError, FileNotFoundError), match=re.escape(message)):
        load_calibration_data(path, _Tok())


def _chat(tok: _Tok, *messages: tuple[str, str]) -> list[int]:
    text = tok.apply_chat_template([{"role": r, "content": c} for r, c in messages])
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("layout", ["json", "jsonl"])
def test_every_help_example_loads(tmp_path: Path, layout: str, capsys) -> None:
    tok = _Tok()
    expected = {
        "messages": _chat(tok, ("user", "What is this?"), ("assistant", "A cat.")),
        "conversations": _chat(tok, ("user", "What is this?"), ("assistant", "A cat.")),
        "text": tok("Any document.")["input_ids"],
    }
    for name, record in FORMAT_EXAMPLES.items():
        path = tmp_path / f"{name}.{layout}"
        path.write_text(json.dumps([record]) if layout == "json" else json.dumps(record) + "\n")
        data = load_calibration_data(path, tok, num_samples=4, max_seq_len=64)
        assert [s.tolist() for s in data.samples] == [expected[name]], name
        assert json.dumps(record, ensure_ascii=False) in formats_help()
    err = capsys.readouterr().err
    # one line per file with media: the image part, then the <image> tag
    assert err.count("\n") == 2
    assert f"note: messages.{layout}: 1 image/video part(s) in 1 record(s) dropped" in err


def test_multimodal_messages_join_text_parts_and_drop_images(tmp_path: Path, capsys) -> None:
    records = [
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                        {"type": "text", "text": "first part"},
                        {"type": "image", "path": "b.jpg"},
                        {"type": "text", "text": "second"},
                    ],
                },
                {"role": "assistant", "content": [{"type": "text", "text": "answer"}]},
            ]
        }
        for _ in range(3)
    ]
    path = tmp_path / "mm.json"
    path.write_text(json.dumps(records))
    data = load_calibration_data(path, _Tok(), num_samples=8, max_seq_len=64)
    tok = _Tok()
    want = _chat(
        tok, ("system", "be brief"), ("user", "first part\nsecond"), ("assistant", "answer")
    )
    assert [s.tolist() for s in data.samples] == [want] * 3
    err = capsys.readouterr().err
    assert err == (
        "note: mm.json: 6 image/video part(s) in 3 record(s) dropped: the text decoder is "
        "calibrated on the text only (the vision tower stays unquantized)\n"
    )


def test_bad_content_part_names_record_and_part(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}))
    with pytest.raises(ValueError, match="bad.jsonl: line 1: message 0 part 0 is not a text or"):
        load_calibration_data(path, _Tok())
    path.write_text(json.dumps({"messages": [{"role": "user", "content": 3}]}))
    with pytest.raises(ValueError, match="'content' must be a string or a list of parts, got int"):
        load_calibration_data(path, _Tok())


def test_long_plain_text_prints_no_tokenizer_warning(tmp_path: Path, capfd) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        Path(__file__).parents[1] / "fixtures" / "qwen2.5-tokenizer"
    )
    tok.model_max_length = 64
    path = tmp_path / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 100)
    data = load_calibration_data(path, tok, num_samples=100, max_seq_len=32)
    assert len(data.samples) > 10 and all(len(s) <= 32 for s in data.samples)
    out, err = capfd.readouterr()
    assert "Token indices sequence length" not in out + err


def _png_data_url() -> str:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_chat(url: str) -> dict:
    image = {"type": "image_url", "image_url": {"url": url}}
    return {"messages": [{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}]}


def test_check_accepts_decodable_images_and_names_the_line_of_a_bad_one(tmp_path: Path) -> None:
    (tmp_path / "ok.png").write_bytes(__import__("base64").b64decode(_png_data_url()[22:]))
    (tmp_path / "broken.png").write_bytes(b"not a png at all")
    rows = [
        _image_chat(_png_data_url()),
        {"image": "ok.png", "conversations": [{"from": "human", "value": "<image>\nWhat?"}]},
        _image_chat("https://example.com/a.png"),  # not fetched
    ]
    path = tmp_path / "cal.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    check = check_calibration_file(path)
    assert (check.records, check.usable, check.images_checked, check.images_remote) == (3, 3, 2, 1)
    rows.insert(1, _image_chat("broken.png"))
    path.write_text("\n" + "".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"cal.jsonl: line 3: message 0 part 0: image not deco"):
        check_calibration_file(path)


def test_check_names_the_line_of_a_bad_record_in_a_json_list(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    path.write_text('[\n  {"text": "fine"},\n\n  {"messages": []}\n]\n')
    with pytest.raises(ValueError, match=r"cal.json: record 1 \(line 4\): 'messages' must be"):
        check_calibration_file(path)


def test_check_needs_one_usable_sample(tmp_path: Path) -> None:
    path = tmp_path / "cal.jsonl"
    rows = [{"text": "  "}, {"conversations": [{"from": "human", "value": "<image>\n"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match="no usable calibration sample: every one of the 2"):
        check_calibration_file(path)


def test_quantize_checks_the_calibration_file_before_loading_the_model(tmp_path: Path) -> None:
    """A bad record fails in `quantize` before the model is resolved: even a model path that
    does not exist is not reached."""
    from pagoda.quantizer import quantize

    path = tmp_path / "cal.jsonl"
    path.write_text('{"text": "ok"}\n{"text": 3}\n')
    with pytest.raises(ValueError, match="cal.jsonl: line 2: 'text' is not a string"):
        quantize(tmp_path / "no-such-model", tmp_path / "out", dataset=path)
