"""`pagoda COMMAND [MODEL] ...`: one grammar for every command, `--model` as its alias, and
`--image` on chat and generate (vision-language models; a clear error for text-only ones)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from pagoda.cli import build_parser
from pagoda.cli import main as cli
from pagoda.entrypoints.cli_args import merge_model_option
from tests.helpers import save_tiny_model

# each command with the options it needs besides the model
COMMANDS = {
    "chat": [],
    "serve": [],
    "quantize": ["--out", "x"],
    "eval perplexity": [],
    "bench latency": [],
    "bench throughput": [],
}


def _parse(argv: list[str]):
    ns = build_parser().parse_args(argv)
    merge_model_option(ns)
    return ns


@pytest.mark.parametrize("command", list(COMMANDS))
def test_model_is_positional_or_model_flag(command: str):
    words, extra = command.split(), COMMANDS[command]
    assert _parse([*words, "m-dir", *extra]).model == "m-dir"
    assert _parse([*words, "--model", "m-dir", *extra]).model == "m-dir"
    assert _parse([*words, *extra]).model is None  # the embedded model
    with pytest.raises(ValueError, match="two models given: 'a' .* and 'b'"):
        _parse([*words, "a", "--model", "b", *extra])


def test_generate_reads_the_model_from_its_first_word_when_it_names_one(tmp_path: Path):
    from pagoda.cli import _split_generate_words

    model = tmp_path / "m"
    model.mkdir()
    ns = build_parser().parse_args(["generate", str(model), "one", "two"])
    _split_generate_words(ns)
    assert (ns.model, ns.prompt) == (str(model), ["one", "two"])
    ns = build_parser().parse_args(["generate", "The capital of", "France"])
    _split_generate_words(ns)
    assert (ns.model, ns.prompt) == (None, ["The capital of", "France"])
    ns = build_parser().parse_args(["generate", "--model", str(model), "prompt"])
    ns.model = ns.model_option
    _split_generate_words(ns)
    assert (ns.model, ns.prompt) == (str(model), ["prompt"])


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli(argv)
    return rc, out.getvalue(), err.getvalue()


def _png(path: Path) -> Path:
    from PIL import Image

    Image.new("RGB", (56, 56), (10, 200, 30)).save(path)
    return path


def test_image_on_a_text_model_and_a_missing_image_are_one_line_errors(tmp_path: Path):
    tiny = save_tiny_model("llama", tmp_path / "tiny")
    png = _png(tmp_path / "a.png")
    rc, _, err = _run(["chat", str(tiny), "--image", str(png), "--message", "hi"])
    assert rc == 2 and "error: --image needs a vision-language model; tiny reads text" in err
    rc, _, err = _run(["generate", str(tiny), "hi", "--image", str(tmp_path / "no.png")])
    assert rc == 2 and f"error: --image {str(tmp_path / 'no.png')!r}: no such file" in err


def test_image_reaches_a_vision_language_model(tmp_path: Path):
    """`pagoda chat VL --image` and `pagoda generate VL --image` answer what `LLM.chat` with
    the same image part answers."""
    from pagoda import LLM, SamplingParams
    from tests.models.test_qwen2_5_vl import save_tiny_vl

    vl = tmp_path / "vl"
    save_tiny_vl(vl)
    png = _png(tmp_path / "a.png")
    question = "What is in the picture?"
    with LLM(str(vl), max_model_len=512) as llm:
        parts = [{"type": "image_url", "image_url": {"url": str(png)}}]
        parts.append({"type": "text", "text": question})
        params = SamplingParams(max_tokens=4, temperature=0.0)
        want = llm.chat([{"role": "user", "content": parts}], params)[0].outputs[0].text
    for command in (["chat", str(vl), "--message", question], ["generate", str(vl), question]):
        rc, out, err = _run([*command, "--image", str(png), "--max-tokens", "4",
                             "--max-model-len", "512"])  # fmt: skip
        assert rc == 0, err[-2000:]
        assert want.strip() and want in out
