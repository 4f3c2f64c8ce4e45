"""`pagoda quantize` / `pagoda eval perplexity` at the edges: errors, staging, ignore, reports."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from pagoda.cli import main
from pagoda.quantizer import api
from pagoda.quantizer.api import quantize
from pagoda.quantizer.pipeline import matches_ignore


def test_group_size_error_is_short_and_names_working_sizes(tiny_llama, tmp_path, capsys) -> None:
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
    assert err == (
        "error: group size 48 does not divide the input size (64, 128) of 14 layer(s) "
        "(down_proj, gate_proj, k_proj, o_proj, ...); use --group-size 32 or --group-size 64 "
        "or -1 (per channel)\n"
    )
    assert not (tmp_path / "o").exists()


def test_default_group_size_is_the_largest_that_divides_every_input(
    tiny_llama, tmp_path, capsys
) -> None:
    """No --group-size: 128 does not divide the tiny model's hidden size 64, so 64 (as 576 =
    9 x 64 gives SmolLM2 64), with one note; an explicit size is still checked as given."""
    out = tmp_path / "o"
    assert main(["quantize", str(tiny_llama), "--out", str(out), "--method", "rtn"]) == 0
    err = capsys.readouterr().err
    assert "note: LlamaForCausalLM: group size 64, the largest of 128/64/32 that divides" in err
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    groups = [g["weights"]["group_size"] for g in config["config_groups"].values()]
    assert groups == [64]
    assert json.loads((out / "quantization_report.json").read_text())["group_size"] == 64


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
    # what made the checkpoint: the calibration file (by hash), the ignore list, the seed
    digest = hashlib.sha256(calib_text.read_bytes()).hexdigest()
    assert report["dataset"] == {
        "path": str(calib_text.resolve()),
        "sha256": digest,
        "bytes": calib_text.stat().st_size,
    }
    assert report["ignore"] == ["lm_head", "re:model\\.layers\\.1\\.mlp\\."]
    assert report["seed"] == 0
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


def _cli_error(capsys, argv: list[str]) -> str:
    """Run the CLI, which must fail with exit code 2 and exactly one line on stderr."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_gptq_without_dataset_names_the_flag(tiny_llama, tmp_path, capsys) -> None:
    err = _cli_error(capsys, ["quantize", str(tiny_llama), "--out", str(tmp_path / "o")])
    assert "pass --dataset FILE" in err and "--method rtn" in err


def test_cheap_checks_fire_before_the_model_loads(
    tiny_llama, calib_text, tmp_path, capsys, monkeypatch
) -> None:
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the argument checks")

    monkeypatch.setattr(api, "resolve_model", no_load)
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    err = _cli_error(
        capsys, ["quantize", str(tiny_llama), "--out", str(full), "--dataset", str(calib_text)]
    )
    assert "already exists and is not empty; choose another output directory" in err
    missing = tmp_path / "nope.jsonl"
    err = _cli_error(
        capsys,
        ["quantize", str(tiny_llama), "--out", str(tmp_path / "o"), "--dataset", str(missing)],
    )
    assert f"{missing}: calibration file not found" in err


def test_truncated_safetensors_is_one_line(tiny_llama, tmp_path, capsys) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_llama.iterdir():
        data = f.read_bytes()
        (broken / f.name).write_bytes(
            data[: len(data) // 2] if f.suffix == ".safetensors" else data
        )
    err = _cli_error(
        capsys,
        ["quantize", str(broken), "--out", str(tmp_path / "o"), "--method", "rtn",
         "--group-size", "32"],
    )  # fmt: skip
    assert "model.safetensors: not a readable safetensors file" in err
    assert "probably truncated" in err and "copy it again" in err
    assert not (tmp_path / "o").exists()


def test_ignore_pattern_that_matches_nothing_is_an_error(tiny_llama, tmp_path, capsys) -> None:
    err = _cli_error(
        capsys,
        ["quantize", str(tiny_llama), "--out", str(tmp_path / "o"), "--method", "rtn",
         "--group-size", "32", "--ignore", "re:.*down_prj", "--ignore", "re:.*up_proj",
         "--ignore", "model.layers.0.mlp"],
    )  # fmt: skip
    assert "--ignore 're:.*down_prj' 'model.layers.0.mlp' matches no linear module" in err
    assert "'model.layers.0.self_attn.q_proj'" in err
    assert not (tmp_path / "o").exists()


_SLOW_QUANTIZE = """
import sys, time
from pagoda.quantizer import api
def slow(*a, **k):
    print("ready", flush=True)
    time.sleep(120)
api.quantize_layers = slow
api.quantize(sys.argv[1], sys.argv[2], method="rtn", group_size=32, progress=False)
"""


def test_sigterm_removes_the_staging_directory_and_stale_ones_are_swept(
    tiny_llama, tmp_path
) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_QUANTIZE, str(tiny_llama), str(out)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout.readline().strip() == "ready"
    assert [p.name for p in tmp_path.iterdir()] == [f".out.incomplete-{proc.pid}"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []

    # a run killed harder leaves its directory; the next run removes it (its pid is gone)
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    stale = tmp_path / f".other.incomplete-{dead.pid}"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    live = tmp_path / f".mine.incomplete-{os.getpid()}"
    live.mkdir()
    quantize(str(tiny_llama), out, method="rtn", group_size=32, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "out"]


def test_calibration_dtype_follows_the_cpus_bf16_support(monkeypatch) -> None:
    """A GPU calibrates in the checkpoint's dtype; a CPU in bf16 only for a bf16 checkpoint on a
    CPU with native bf16 GEMM (oneDNN's check), else float32 (fp16 is emulated on CPUs)."""
    import torch

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    for half in (torch.bfloat16, torch.float16):
        assert api.calibration_dtype(gpu, half) == half
    monkeypatch.setattr(api, "cpu_has_bf16_gemm", lambda: True)
    assert api.calibration_dtype(cpu, torch.bfloat16) == torch.bfloat16
    assert api.calibration_dtype(cpu, torch.float16) == torch.float32
    assert api.calibration_dtype(cpu, torch.float32) == torch.float32
    monkeypatch.setattr(api, "cpu_has_bf16_gemm", lambda: False)
    assert api.calibration_dtype(cpu, torch.bfloat16) == torch.float32


@pytest.mark.parametrize("native", [True, False])
def test_report_names_the_calibration_dtype(
    tiny_llama, calib_text, tmp_path, monkeypatch, native
) -> None:
    monkeypatch.setattr(api, "cpu_has_bf16_gemm", lambda: native)
    report = quantize(
        str(tiny_llama), tmp_path / "q", method="gptq", group_size=32, dataset=str(calib_text),
        num_samples=2, max_seq_len=16, device="cpu", dtype="bfloat16", progress=False,
    )  # fmt: skip
    assert report.calibration_dtype == ("bfloat16" if native else "float32")
    saved = json.loads((tmp_path / "q" / "quantization_report.json").read_text())
    assert saved["calibration_dtype"] == report.calibration_dtype
    assert f"({report.calibration_dtype} forward)" in report.summary()


def test_awq_clips_only_when_asked(tiny_llama, calib_text, tmp_path) -> None:
    """AWQ's clip search is opt-in (`awq_clip` / --awq-clip): the guard's candidates show
    whether it ran; asking for it with another method is an error."""
    common = dict(method="awq", group_size=32, dataset=str(calib_text), num_samples=2,
                  max_seq_len=16, device="cpu", dtype="float32", progress=False)  # fmt: skip
    plain = quantize(str(tiny_llama), tmp_path / "a", **common)
    clipped = quantize(str(tiny_llama), tmp_path / "b", awq_clip=True, **common)
    assert all(set(lr.awq_errors) == {"rtn", "scales"} for lr in plain.layers)
    assert all(set(lr.awq_errors) == {"rtn", "scales", "scales+clip"} for lr in clipped.layers)
    with pytest.raises(ValueError, match="awq_clip applies to method 'awq', not 'gptq'"):
        quantize(str(tiny_llama), tmp_path / "c", method="gptq", awq_clip=True)
