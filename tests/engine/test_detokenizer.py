"""IncrementalDetokenizer on the Qwen2.5 tokenizer: UTF-8 safe streaming and stop strings."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda.engine.detokenizer import IncrementalDetokenizer

transformers = pytest.importorskip("transformers")

TOKENIZER_DIR = Path(__file__).parent.parent / "fixtures" / "qwen2.5-tokenizer"
KOREAN = "안녕하세요, 오늘 서울의 날씨는 맑고 따뜻합니다. 한국어 토큰화 테스트입니다!"
# Rare characters that byte-level BPE splits over several tokens.
CHINESE = "魑魅魍魉，饕餮盛宴。龘靐齉，鬱鬱蔥蔥的森林里有一只🦊狐狸在跳舞。"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def _prompt(tokenizer) -> list[int]:
    return tokenizer.encode(f"{IM_START}user\n말해 주세요{IM_END}\n{IM_START}assistant\n")


def _stream(detok: IncrementalDetokenizer, ids: list[int], delta: bool = True) -> list[str]:
    """Feed tokens one at a time; return each step's output (the last one with finished=True)."""
    chunks = []
    for i, token_id in enumerate(ids):
        stop = detok.update([token_id])
        finished = stop is not None or i == len(ids) - 1
        chunks.append(detok.get_next_output_text(finished=finished, delta=delta))
        if stop is not None:
            break
    return chunks


@pytest.mark.parametrize("text", [KOREAN, CHINESE], ids=["korean", "chinese"])
def test_streaming_is_exact_and_never_broken(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    # The test only means something if some characters really are split over tokens.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer))
    chunks = _stream(detok, ids)
    assert all("\ufffd" not in chunk for chunk in chunks)
    assert "".join(chunks) == tokenizer.decode(ids) == text
    assert detok.output_text == text and detok.token_ids == ids


def test_first_token_leading_space(tokenizer) -> None:
    prompt = tokenizer.encode("The weather today is")
    ids = tokenizer.encode(" sunny and warm.")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(_stream(detok, ids)) == " sunny and warm."


def test_stop_string_trimmed(tokenizer) -> None:
    ids = tokenizer.encode("Hello world. Stop here please")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["Stop"])
    chunks = _stream(detok, ids)
    assert detok.stop_reason == "Stop"
    assert "".join(chunks) == detok.output_text == "Hello world. "


def test_stop_string_spanning_tokens_is_held_back(tokenizer) -> None:
    # "안녕히 계세요" spans several tokens; none of its first characters may be streamed.
    stop = "안녕히 계세요"
    text = "네, 알겠습니다. 안녕히 계세요 그리고 더 많은 텍스트"
    ids = tokenizer.encode(text)
    assert len(tokenizer.encode(stop)) > 2
    detok = IncrementalDetokenizer(tokenizer, [], stop=[stop, "zzz"])
    chunks = _stream(detok, ids)
    assert detok.stop_reason == stop
    assert "".join(chunks) == detok.output_text == "네, 알겠습니다. "
    # Before the stop matched, nothing streamed ever contained the start of the stop string.
    streamed = ""
    for chunk in chunks[:-1]:
        streamed += chunk
        assert "안" not in streamed


def test_cumulative_output_holds_back_partial_stop(tokenizer) -> None:
    ids = tokenizer.encode("abc END")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["ENDX"])
    outputs = _stream(detok, ids, delta=False)
    assert detok.stop_reason is None
    assert all(not out.endswith(("E", "EN", "END")) for out in outputs[:-1])
    assert outputs[-1] == "abc END"  # finished: everything is released


def test_include_stop_str_in_output(tokenizer) -> None:
    ids = tokenizer.encode("one two three four")
    detok = IncrementalDetokenizer(tokenizer, [], stop=[" three"], include_stop_str_in_output=True)
    chunks = _stream(detok, ids)
    assert "".join(chunks) == detok.output_text == "one two three"


def test_earliest_stop_string_wins(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], stop=["cd", "bc"])
    assert detok.update(tokenizer.encode("abcdef")) == "bc"
    assert detok.output_text == "a"
    assert detok.update(tokenizer.encode("more")) == "bc"  # finished: further tokens ignored
    assert detok.output_text == "a"


def test_skip_special_tokens(tokenizer) -> None:
    ids = tokenizer.encode(f"Hi there{IM_END}")
    skipping = IncrementalDetokenizer(tokenizer, _prompt(tokenizer))
    assert "".join(_stream(skipping, ids)) == "Hi there"
    keeping = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), skip_special_tokens=False)
    assert "".join(_stream(keeping, ids)) == f"Hi there{IM_END}"


def test_decode_token(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [])
    (hello,) = tokenizer.encode(" hello")
    assert detok.decode_token(hello) == " hello"
    assert detok.decode_token(tokenizer.convert_tokens_to_ids(IM_END)) == IM_END


def test_fast_decode_equals_the_tokenizers_decode(tokenizer) -> None:
    """The Rust-tokenizer shortcut gives the transformers wrapper's text, specials skipped or
    not, split UTF-8 included; a tokenizer overriding `_decode` keeps the wrapper."""
    from pagoda.engine.detokenizer import fast_decoder

    ids = tokenizer.encode(f"{IM_START}{KOREAN}{IM_END} {CHINESE}")
    for skip in (True, False):
        fast = fast_decoder(tokenizer, skip)
        assert fast is not None
        for i in range(len(ids)):
            window = ids[max(0, i - 6) : i + 1]
            expect = tokenizer.decode(
                window, skip_special_tokens=skip, clean_up_tokenization_spaces=False
            )
            assert fast(window) == expect

    class Custom(type(tokenizer)):
        def _decode(self, token_ids, **kwargs):  # a model-specific override
            return "x" * len(token_ids)

    custom = Custom.__new__(Custom)
    custom.__dict__.update(tokenizer.__dict__)
    assert fast_decoder(custom, True) is None
    detok = IncrementalDetokenizer(custom, [])
    detok.update(tokenizer.encode("hello world"))
    assert detok.output_text == "xx"
