"""`pagoda quantize` / `pagoda eval perplexity` at the edges: errors, staging, ignore, reports."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from pagoda.entrypoints.cli import main
from pagoda.quant import api
from pagoda.quant.api import quantize
from pagoda.quant.pipeline import matches_ignore


def test_group_size_error_lists_layers_and_working_sizes(tiny_llama, tmp_path, capsys) -> None:
    code = main(
        [
            "quantize",
            str(tiny_llama),
            "--out",
            str(tmp_path / "o"),
            "--method",
            "rtn",
            "--group-size",
            "48",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "group size 48 does not divide the input size of 14 layers" in err
    assert "model.layers.*.mlp.down_proj (in_features 128)" in err
    assert "--group-size 32 or 64 or -1" in err and "--ignore 're:model" in err
    assert not (tmp_path / "o").exists()


def test_unsupported_scheme_and_architecture(tiny_llama, tmp_path) -> None:
    with pytest.raises(ValueError, match="use one of W4A16, W4A16_ASYM, W8A16"):
        quantize(str(tiny_llama), tmp_path / "o", scheme="W3A16", method="rtn")
    from transformers import GPT2Config

    gpt2 = tmp_path / "gpt2"
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(gpt2)
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM, Qwen2ForCausalLM"):
        quantize(str(gpt2), tmp_path / "o", method="rtn")
    with pytest.raises(ValueError, match="GPTQ needs calibration data"):
        quantize(str(tiny_llama), tmp_path / "o", group_size=32)


def test_interrupted_run_leaves_no_directory(tiny_llama, tmp_path, monkeypatch) -> None:
    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "quantize_layers", boom)
    with pytest.raises(KeyboardInterrupt):
        quantize(str(tiny_llama), tmp_path / "out", method="rtn", group_size=32)
    assert list(tmp_path.iterdir()) == []  # neither out nor its staging directory


def test_ignore_patterns_and_report(tiny_llama, calib_text, tmp_path, capsys) -> None:
    assert matches_ignore("model.layers.1.mlp.down_proj", ["re:.*down_proj"])
    assert not matches_ignore("model.layers.1.mlp.down_proj", ["re:down_proj"])  # at the start
    assert not matches_ignore("model.layers.1.mlp.down_proj", ["down_proj"])  # exact names
    out = tmp_path / "q"
    code = main(
        [
            "quantize",
            str(tiny_llama),
            "--out",
            str(out),
            "--group-size",
            "32",
            "--dataset",
            str(calib_text),
            "--num-samples",
            "4",
            "--max-seq-len",
            "32",
            "--ignore",
            "lm_head",
            "--ignore",
            "re:model\\.layers\\.1\\.mlp\\.",
            "--no-progress",
        ]
    )
    assert code == 0
    assert "gptq W4A16 group 32: 2 layers, 4 samples" in capsys.readouterr().out
    tensors = load_file(out / "model.safetensors")
    assert "model.layers.1.mlp.down_proj.weight" in tensors  # ignored: kept dense
    assert "model.layers.0.mlp.down_proj.weight_packed" in tensors
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head", "re:model\\.layers\\.1\\.mlp\\."]
    report = json.loads((out / "quantization_report.json").read_text())
    assert len(report["layers"]) == 2 and report["num_samples"] == 4
    assert all(m["relative_error"] < 0.05 for lr in report["layers"] for m in lr["modules"])

    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{i % 97}" for i in range(300)))
    results = []
    for model in (tiny_llama, out):
        assert (
            main(
                [
                    "eval",
                    "perplexity",
                    str(model),
                    "--text",
                    str(text),
                    "--window",
                    "64",
                    "--stride",
                    "32",
                    "--device",
                    "cpu",
                    "--json",
                    str(tmp_path / "p.json"),
                ]
            )
            == 0
        )
        results.append(json.loads((tmp_path / "p.json").read_text()))
    assert results[0]["tokens_sha256"] == results[1]["tokens_sha256"]
    assert results[0]["num_scored"] == 299
    assert results[1]["weights_bytes"] < results[0]["weights_bytes"]
    assert abs(results[0]["perplexity"] - results[1]["perplexity"]) < 0.1 * results[0]["perplexity"]
