"""`pagoda quantize --evaluate TEXT`: held-out perplexity of the result beside the original's.

Oracle: `pagoda.bench.perplexity.evaluate` run on its own over each model, same settings.
"""

from __future__ import annotations

import json

from pagoda.bench.perplexity import evaluate
from pagoda.cli import main
from tests.quant.test_api import _cli_error


def test_evaluate_prints_both_perplexities(tiny_llama, calib_text, tmp_path, capsys) -> None:
    out, report = tmp_path / "q", tmp_path / "report.json"
    argv = ["quantize", str(tiny_llama), "--out", str(out), "--method", "rtn", "--group-size",
            "32", "--evaluate", str(calib_text), "--eval-tokens", "300", "--eval-window", "64",
            "--device", "cpu", "--no-progress", "--report", str(report)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    evaluation = json.loads(report.read_text())["evaluation"]
    for name, model in (("unquantized", tiny_llama), ("quantized", out)):
        alone = evaluate(str(model), str(calib_text), 300, 64, 64, device="cpu", dtype="float32")
        assert evaluation[name]["perplexity"] == alone.perplexity
        assert evaluation[name]["tokens_sha256"] == alone.tokens_sha256
        assert f"{name:<11} {alone.perplexity:10.4f}" in printed
    # Rounding to 4 bits costs something on a random model: the two figures differ.
    assert evaluation["quantized"]["perplexity"] != evaluation["unquantized"]["perplexity"]


def test_evaluate_missing_text_fails_before_quantizing(tiny_llama, tmp_path, capsys) -> None:
    out = tmp_path / "q"
    argv = ["quantize", str(tiny_llama), "--out", str(out), "--method", "rtn",
            "--evaluate", str(tmp_path / "nope.txt")]  # fmt: skip
    err = _cli_error(capsys, argv)
    assert "--evaluate" in err and "not found" in err
    assert not out.exists()
