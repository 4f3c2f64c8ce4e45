"""A quantized lm_head end to end: quantizer, checkpoint, pagoda's loader, transformers, dummies.

Oracles: the same model served unquantized with the checkpoint's dequantized weights,
transformers + compressed-tensors on the same directory, and (GPTQ vs RTN) the lm_head output
error measured directly on the calibration inputs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagoda.cli import main
from pagoda.engine.args import EngineArgs
from pagoda.layers.linear import UnquantizedLinearMethod
from pagoda.layers.quantized_linear import WNA16LinearMethod
from pagoda.model_files import resolve_model
from pagoda.models.loader import load_model
from pagoda.models.registry import get_model_class
from pagoda.quant.scheme import parse_quantization_config
from pagoda.quantizer.api import quantize
from pagoda.quantizer.checkpoint import dequantized_state_dict
from tests.helpers import save_tiny_model
from tests.quant.conftest import FIXTURES

IDS = torch.tensor([5, 17, 99, 3, 250, 42, 7, 301, 11, 64, 128, 2, 77, 190, 33, 8])
# transformers 5 loads a qwen2 directory's tokenizer as Qwen2Tokenizer whatever
# tokenizer_config.json says, which turns the fixture's word-level text into nothing: the
# tiny Qwen2 calibrates on random token ids (`dataset="random"`, reproduced by _samples).
CALIB = dict(dataset="random", num_samples=8, max_seq_len=48, seed=0)


def _samples(vocab: int = 384) -> list[torch.Tensor]:
    """The calibration samples `quantize(dataset="random", **CALIB)` draws."""
    g = torch.Generator().manual_seed(CALIB["seed"])
    shape = (CALIB["max_seq_len"],)
    return [torch.randint(0, vocab, shape, generator=g) for _ in range(CALIB["num_samples"])]


def _with_tokenizer(path: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "sym" / name, path / name)
    return path


@pytest.fixture(scope="module")
def untied_qwen2(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lm_head") / "qwen2"
    return _with_tokenizer(save_tiny_model("qwen2", path, seed=3, tie_word_embeddings=False))


@pytest.fixture(scope="module")
def tied_qwen2(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lm_head") / "qwen2_tied"
    return _with_tokenizer(save_tiny_model("qwen2", path, seed=4, tie_word_embeddings=True))


def _pagoda(model_dir: Path):
    _, config, *_ = EngineArgs(model=str(model_dir), dtype="float32", device="cpu").create_configs()
    return load_model(config, "cpu"), config


def _logits(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids))))


def _dense_logits(config, state: dict[str, torch.Tensor]) -> torch.Tensor:
    cls = get_model_class(config.hf_config.architectures)
    dense = cls(config.hf_config).eval()
    dense.load_weights(state.items())
    assert not dense.lm_head.quantized
    return _logits(dense)


def _hf_logits(model_dir: Path) -> torch.Tensor:
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(IDS[None]).logits[0].float()


def _quantize(src: Path, out: Path, **kwargs):
    return quantize(str(src), out, progress=False, **CALIB, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(scheme="W4A16", method="gptq", group_size=32),
        dict(scheme="W4A16_ASYM", method="rtn", group_size=32),
    ],
    ids=["w4a16-gptq-g32", "w4a16-asym-rtn-g32"],
)
def test_quantized_lm_head_checkpoint(untied_qwen2, tmp_path, kwargs) -> None:
    out = tmp_path / "q"
    report = _quantize(untied_qwen2, out, ignore=[], **kwargs)

    # The checkpoint: lm_head in the same pack-quantized layout as the decoder's linears.
    tensors = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in tensors
    assert tensors["lm_head.weight_packed"].dtype == torch.int32
    assert tensors["lm_head.weight_packed"].shape == (384, 64 // 8)
    assert tensors["lm_head.weight_scale"].shape == (384, 64 // 32)
    assert tensors["lm_head.weight_shape"].tolist() == [384, 64]
    asym = kwargs["scheme"].endswith("ASYM")
    assert ("lm_head.weight_zero_point" in tensors) == asym
    assert "model.embed_tokens.weight" in tensors  # untied: the embedding stays as it is
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "lm_head" not in qc["ignore"]
    assert report.lm_head is not None and report.lm_head.shape == (384, 64)
    assert 0 < report.lm_head.relative_error < 0.05
    assert (report.lm_head.loss is None) == (kwargs["method"] == "rtn")
    saved = json.loads((out / "quantization_report.json").read_text())
    assert saved["lm_head"]["name"] == "lm_head"
    assert "lm_head" in report.summary()

    # pagoda serves it quantized, equal to the dequantized weights served dense.
    model, config = _pagoda(out)
    assert model.lm_head.quantized and isinstance(model.lm_head.linear_method, WNA16LinearMethod)
    assert not hasattr(model.lm_head, "weight")
    ours = _logits(model)
    assert ours.dtype == torch.float32 and ours.shape == (len(IDS), 384)
    torch.testing.assert_close(
        ours, _dense_logits(config, dequantized_state_dict(out)), rtol=1e-4, atol=1e-4
    )
    # The head really is quantized: it differs from the original dense head.
    original, _ = _pagoda(untied_qwen2)
    assert not original.lm_head.quantized
    assert (ours - _logits(original)).abs().max() > 1e-3
    # transformers + compressed-tensors read the same checkpoint to the same logits.
    torch.testing.assert_close(ours, _hf_logits(out), rtol=2e-4, atol=2e-4)


def test_default_keeps_lm_head_dense(untied_qwen2, tmp_path) -> None:
    report = _quantize(untied_qwen2, tmp_path / "q", method="rtn", group_size=32)
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    assert "lm_head.weight" in tensors and "lm_head.weight_packed" not in tensors
    assert report.lm_head is None
    model, _ = _pagoda(tmp_path / "q")
    assert not model.lm_head.quantized and model.lm_head.linear_method is None


def test_tied_model_keeps_lm_head_dense_with_warning(tied_qwen2, tmp_path, capsys) -> None:
    out = tmp_path / "q"
    report = _quantize(tied_qwen2, out, method="rtn", group_size=32, ignore=[])
    err = capsys.readouterr().err
    assert err.count("lm_head is tied to the embeddings") == 1 and "warning:" in err
    assert len(report.notes) == 1 and "tied" in report.notes[0]
    assert report.lm_head is None
    tensors = load_file(out / "model.safetensors")
    assert not any(n.startswith("lm_head.") for n in tensors)
    assert "model.layers.0.mlp.down_proj.weight_packed" in tensors
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head"]  # so that no loader looks for a quantized head
    model, config = _pagoda(out)
    assert model.lm_head.tied and not model.lm_head.quantized
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ours = _logits(model)
    torch.testing.assert_close(
        ours, _dense_logits(config, dequantized_state_dict(out)), rtol=1e-4, atol=1e-4
    )
    torch.testing.assert_close(ours, _hf_logits(out), rtol=2e-4, atol=2e-4)


def test_gptq_lowers_lm_head_output_error(untied_qwen2, tmp_path) -> None:
    """||X (Q - W)ᵀ|| on the calibration inputs X of lm_head (final-norm outputs of the GPTQ
    model's quantized decoder, which is what GPTQ calibrated on): GPTQ beats RTN."""
    common = dict(scheme="W4A16", group_size=32, ignore=[])
    gptq = _quantize(untied_qwen2, tmp_path / "gptq", method="gptq", **common)
    rtn = _quantize(untied_qwen2, tmp_path / "rtn", method="rtn", **common)

    model, _ = _pagoda(tmp_path / "gptq")
    with torch.no_grad():
        x = torch.cat([model(ids, torch.arange(len(ids))) for ids in _samples()])  # [N, hidden]
    w = load_file(untied_qwen2 / "model.safetensors")["lm_head.weight"].float()
    errors = {}
    for name in ("gptq", "rtn"):
        q = dequantized_state_dict(tmp_path / name)["lm_head.weight"]
        errors[name] = float(((x @ (q - w).t()) ** 2).sum() / ((x @ w.t()) ** 2).sum())
    print(
        f"lm_head output error on {x.shape[0]} calibration tokens: gptq {errors['gptq']:.4g}, "
        f"rtn {errors['rtn']:.4g} (ratio {errors['gptq'] / errors['rtn']:.3f}); report: gptq "
        f"{gptq.lm_head.relative_error:.4g}, rtn {rtn.lm_head.relative_error:.4g}"
    )
    assert errors["gptq"] < 0.8 * errors["rtn"]
    assert gptq.lm_head.relative_error < rtn.lm_head.relative_error


def test_cli_quantize_lm_head_flag(untied_qwen2, tmp_path, capsys) -> None:
    base = ["quantize", str(untied_qwen2), "--method", "rtn", "--group-size", "32"]
    flagged = tmp_path / "flagged"
    assert main([*base, "--out", str(flagged), "--quantize-lm-head", "--no-progress"]) == 0
    assert "lm_head.weight_packed" in load_file(flagged / "model.safetensors")
    qc = json.loads((flagged / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == []
    # Without the flag lm_head is ignored even when other --ignore patterns replace nothing.
    plain = tmp_path / "plain"
    args = [*base, "--out", str(plain), "--ignore", "re:.*down_proj", "--no-progress"]
    assert main(args) == 0
    assert "lm_head.weight" in load_file(plain / "model.safetensors")
    qc = json.loads((plain / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head", "re:.*down_proj"]
    capsys.readouterr()
    bad = [*base, "--out", str(tmp_path / "bad"), "--quantize-lm-head", "--ignore", "lm_head"]
    assert main(bad) == 2
    assert "--quantize-lm-head contradicts --ignore lm_head" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_legacy_gptq_lm_head_quantized_flag() -> None:
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True}
    assert parse_quantization_config(qc).args_for("lm_head") is None
    assert parse_quantization_config(qc).args_for("model.layers.0.mlp.down_proj") is not None
    quantized = parse_quantization_config({**qc, "lm_head_quantized": True})
    assert quantized.args_for("lm_head") is not None


def _dummy_config(tmp_path: Path, tied: bool) -> Path:
    from tests.helpers import tiny_config

    config = tiny_config(
        "qwen2", hidden_size=128, intermediate_size=256, tie_word_embeddings=tied
    ).to_dict()
    config["architectures"] = ["Qwen2ForCausalLM"]
    path = tmp_path / ("tied.json" if tied else "untied.json")
    path.write_text(json.dumps(config))
    return path


def test_dummy_spec_quantizes_lm_head(tmp_path) -> None:
    from pagoda import LLM
    from pagoda.bench import compare_worker
    from pagoda.sampling_params import SamplingParams

    untied = _dummy_config(tmp_path, tied=False)
    assert resolve_model(f"config:{untied}:w4a16-lm_head").quant_override == "w4a16-lm_head"
    assert resolve_model(f"config:{untied}:W8A16-lm_head").quant_override == "w8a16-lm_head"
    with pytest.raises(FileNotFoundError):
        resolve_model(f"config:{untied}:w4a16-lmhead")  # not a suffix: part of the path

    heads, weight_bytes = {}, {}
    for suffix in ("w4a16", "w4a16-lm_head", "w8a16-lm_head"):
        spec = f"config:{untied}:{suffix}"
        _, config, *_ = EngineArgs(model=spec, dtype="float32", device="cpu").create_configs()
        assert ("lm_head" in config.quantization["ignore"]) == (suffix == "w4a16")
        model = load_model(config, "cpu")
        heads[suffix] = model.lm_head
        # What the runner's memory report counts on CPUs: parameters and buffers.
        tensors = [*model.parameters(), *model.buffers()]
        weight_bytes[suffix] = sum(t.numel() * t.element_size() for t in tensors)
        logits = _logits(model)
        assert logits.shape == (len(IDS), 384) and torch.isfinite(logits).all()
        assert logits.std() > 1e-3  # dummy codes and scales give a real spread
    assert heads["w4a16"].linear_method is None and not heads["w4a16"].quantized
    # The fp32 head (384 x 128 x 4 B) becomes int8 codes (1 B each) + one scale per 128.
    saved = 384 * 128 * 4 - (384 * 128 + 384 * 4)
    assert weight_bytes["w4a16"] - weight_bytes["w4a16-lm_head"] == saved
    for suffix, bits in (("w4a16-lm_head", 4), ("w8a16-lm_head", 8)):
        method = heads[suffix].linear_method
        assert isinstance(method, WNA16LinearMethod) and method.args.num_bits == bits
        assert heads[suffix].wna16_backend == "dequant"  # processed after the dummy init
    # A tied model keeps its head dense whatever the suffix says.
    tied = _dummy_config(tmp_path, tied=True)
    _, config, *_ = EngineArgs(
        model=f"config:{tied}:w4a16-lm_head", dtype="float32", device="cpu"
    ).create_configs()
    head = load_model(config, "cpu").lm_head
    assert head.tied and not head.quantized

    # The engine and `pagoda compare`'s check see the quantized head.
    llm = LLM(f"config:{untied}:w4a16-lm_head", max_model_len=64, print_memory_report=False)
    info = compare_worker._check_quantization(llm)
    assert info["lm_head"] == "quantized" and info["quantization"] == "W4A16 g128"
    assert info["quantized_linear_layers"] == info["linear_layers"] > 0
    out = llm.generate([[5, 17, 99]], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    llm = LLM(f"config:{untied}:w4a16", max_model_len=64, print_memory_report=False)
    assert compare_worker._check_quantization(llm)["lm_head"] == "dense"


def test_dense_head_rejects_a_quantized_method_when_tied() -> None:
    from pagoda.layers.embedding import LMHead, VocabEmbedding
    from pagoda.quant.weights import WeightQuantArgs

    embed = VocabEmbedding(16, 32)
    assert LMHead(16, 32, linear_method=UnquantizedLinearMethod()).linear_method is None
    with pytest.raises(ValueError, match="tied"):
        LMHead(16, 32, tie_to=embed, linear_method=WNA16LinearMethod(WeightQuantArgs()))
