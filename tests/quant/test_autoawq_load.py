"""AutoAWQ GEMM checkpoints served by pagoda: logits against transformers on the same weights
dequantized independently (from the codes the test drew, not through pagoda's unpacking), and
one clear error for each bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda.engine.args import EngineArgs
from pagoda.models.loader import load_model
from pagoda.models.registry import SUPPORTED_ARCHITECTURES
from pagoda.quant.formats.autoawq import pack_awq_gemm
from tests.helpers import save_tiny_model

IDS = torch.tensor([5, 17, 99, 3, 250, 42, 7, 301, 11, 64, 128, 2, 77, 190, 33, 8])
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ARCHS = ["llama", "qwen2", "qwen3"]


def _awq_checkpoint(
    src: Path, dst: Path, group: int = 32, bf16_scales: bool = False, **qc_overrides
) -> dict:
    """Quantize every decoder projection of `src` (asymmetric 4-bit min-max, `group`) into the
    AutoAWQ GEMM layout at `dst`, as AutoAWQ does (decoder layers only, never a vision tower);
    returns the dense state dict of the dequantized weights. `bf16_scales`: scales rounded to
    bf16 first (stored exactly as fp16), so that a bf16 model dequantizes them exactly."""
    state = load_file(src / "model.safetensors")
    dense = dict(state)
    for name in list(state):
        if not name.endswith(tuple(f"{p}.weight" for p in PROJ)) or ".layers." not in name:
            continue
        w = state[name].float()  # [out, in]
        out, inp = w.shape
        wg = w.view(out, inp // group, group)
        lo = wg.amin(-1).clamp(max=0)
        hi = wg.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-4)  # [out, groups], stored fp16
        scale = (scale.bfloat16() if bf16_scales else scale).half()
        s = scale.float()
        zero = torch.round(-lo / s).clamp(0, 15)  # unsigned zero point
        u = torch.round(wg / s.unsqueeze(-1) + zero.unsqueeze(-1)).clamp(0, 15)  # [out, g, G]
        dense[name] = ((u - zero.unsqueeze(-1)) * s.unsqueeze(-1)).view(out, inp)
        codes = (u.view(out, inp) - 8).to(torch.int8)
        qweight, qzeros, scales = pack_awq_gemm(codes, scale, (zero - 8).to(torch.int16))
        module = name.removesuffix(".weight")
        del state[name]
        state.update(
            {f"{module}.qweight": qweight, f"{module}.qzeros": qzeros, f"{module}.scales": scales}
        )
    dst.mkdir()
    for extra in src.iterdir():  # tokenizer / processor files
        if extra.suffix in (".json", ".jinja") and extra.name != "config.json":
            shutil.copy(extra, dst / extra.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": group,
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": None,
        **qc_overrides,
    }
    (dst / "config.json").write_text(json.dumps(config))
    save_file(state, str(dst / "model.safetensors"))
    return dense


def _hf_logits(src: Path, dense: dict) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(dense, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    with torch.no_grad():
        return hf(IDS[None]).logits[0].float()


def _pagoda_logits(model_dir: Path, quantization: str | None = None) -> torch.Tensor:
    args = EngineArgs(
        model=str(model_dir), dtype="float32", device="cpu", quantization=quantization
    )
    _, config, *_ = args.create_configs()
    model = load_model(config, "cpu")
    with torch.no_grad():
        return model.compute_logits(model(IDS, torch.arange(len(IDS))))


@pytest.fixture(scope="module", params=ARCHS)
def awq_model(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"awq-{arch}")
    overrides = {"attention_bias": True} if arch == "llama" else {}
    src = save_tiny_model(arch, root / "dense", seed=3, **overrides)
    dense = _awq_checkpoint(src, root / "awq")
    return src, root / "awq", dense


def test_awq_logits_match_transformers_on_dequantized_weights(awq_model) -> None:
    src, awq, dense = awq_model
    if json.loads((src / "config.json").read_text())["model_type"] == "qwen2":
        assert any(k.endswith("q_proj.bias") for k in dense)  # Qwen2 biases ride along
    ref = _hf_logits(src, dense)
    torch.testing.assert_close(_pagoda_logits(awq, "AWQ"), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_pagoda_logits(awq, None), ref, rtol=1e-4, atol=1e-4)  # auto


@pytest.mark.skipif(
    "MistralForCausalLM" not in SUPPORTED_ARCHITECTURES, reason="no Mistral model class yet"
)
def test_awq_mistral(tmp_path) -> None:
    from transformers import AutoModelForCausalLM, MistralConfig

    cfg = MistralConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        sliding_window=8, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
    hf.save_pretrained(tmp_path / "dense")
    dense = _awq_checkpoint(tmp_path / "dense", tmp_path / "awq")
    ref = _hf_logits(tmp_path / "dense", dense)
    torch.testing.assert_close(_pagoda_logits(tmp_path / "awq", "awq"), ref, rtol=1e-4, atol=1e-4)


def test_awq_layers_use_the_registry_with_zero_points(awq_model) -> None:
    _, awq, _ = awq_model
    _, config, *_ = EngineArgs(model=str(awq), dtype="float32", device="cpu").create_configs()
    model = load_model(config, "cpu")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.wna16_kernels.describe() == "torch_dequant M=1.."
    assert qkv.zeros is not None  # asymmetric: zero points kept


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("awq-bad") / "dense", seed=0)


def test_requested_method_must_match_checkpoint(tiny_src, tmp_path) -> None:
    _awq_checkpoint(tiny_src, tmp_path / "awq")
    with pytest.raises(ValueError, match="quantization='gptq' was requested but the checkpoint"):
        EngineArgs(model=str(tmp_path / "awq"), device="cpu", quantization="gptq").create_configs()
    with pytest.raises(ValueError, match="quantization='marlin' is not supported"):
        EngineArgs(
            model=str(tmp_path / "awq"), device="cpu", quantization="marlin"
        ).create_configs()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"version": "gemv"}, "AutoAWQ version='gemv' is not supported"),
        ({"bits": 8}, "w_bit=8; pagoda loads 4-bit AWQ only"),
    ],
)
def test_bad_awq_configs(tiny_src, tmp_path, overrides, message) -> None:
    _awq_checkpoint(tiny_src, tmp_path / "awq", **overrides)
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(tmp_path / "awq"), device="cpu").create_configs()


def test_group_size_that_does_not_divide(tiny_src, tmp_path) -> None:
    _awq_checkpoint(tiny_src, tmp_path / "awq", group=32)
    cfg = json.loads((tmp_path / "awq" / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 48  # 64 and 128 input features
    (tmp_path / "awq" / "config.json").write_text(json.dumps(cfg))
    _, config, *_ = EngineArgs(model=str(tmp_path / "awq"), device="cpu").create_configs()
    with pytest.raises(ValueError, match="group_size=48 does not divide in_features=64"):
        load_model(config, "cpu")


def test_missing_qzeros(tiny_src, tmp_path) -> None:
    _awq_checkpoint(tiny_src, tmp_path / "awq")
    path = tmp_path / "awq" / "model.safetensors"
    state = {k: v for k, v in load_file(path).items() if not k.endswith("o_proj.qzeros")}
    save_file(state, str(path))
    _, config, *_ = EngineArgs(model=str(tmp_path / "awq"), device="cpu").create_configs()
    with pytest.raises(ValueError, match=r"missing weights .*o_proj\.qzeros"):
        load_model(config, "cpu")


def test_llm_generates_from_awq_checkpoint(tiny_src, tmp_path) -> None:
    from pagoda import LLM, SamplingParams

    for name in ("tokenizer.json", "tokenizer_config.json"):
        src = Path(__file__).resolve().parents[1] / "fixtures" / "llmcompressor-tiny-w4a16" / "sym"
        shutil.copy(src / name, tiny_src / name)
    dense = _awq_checkpoint(tiny_src, tmp_path / "awq")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_src / name, tmp_path / "awq" / name)
    llm = LLM(str(tmp_path / "awq"), quantization="AWQ", device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": IDS[:8].tolist()}, params)[0].outputs[0].token_ids
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_src, dtype=torch.float32).eval()
    hf.load_state_dict(dense, strict=False)
    ref = hf.generate(IDS[None, :8], max_new_tokens=6, do_sample=False)[0, 8:].tolist()
    assert list(out) == ref


def test_awq_qwen2_5_vl_text_decoder(tmp_path) -> None:
    """Qwen2.5-VL with an AutoAWQ-quantized text decoder (vision tower dense): text-only
    logits equal transformers' on the dequantized decoder weights."""
    from transformers import AutoModelForImageTextToText

    from tests.models.test_qwen2_5_vl import save_tiny_vl

    save_tiny_vl(tmp_path / "dense")
    dense = _awq_checkpoint(tmp_path / "dense", tmp_path / "awq")
    quantized = [n for n in dense if n.endswith("q_proj.weight")]
    assert quantized and all(".layers." in n for n in quantized)
    # transformers on the dequantized weights, saved in the checkpoint's own layout
    shutil.copytree(tmp_path / "dense", tmp_path / "deq")
    save_file(dense, str(tmp_path / "deq" / "model.safetensors"))
    hf = AutoModelForImageTextToText.from_pretrained(tmp_path / "deq", dtype=torch.float32).eval()
    args = EngineArgs(model=str(tmp_path / "awq"), dtype="float32", device="cpu")
    _, config, *_ = args.create_configs()
    model = load_model(config, "cpu")
    decoder = model.model.language_model.layers[0]
    assert decoder.self_attn.qkv_proj.wna16_kernels is not None
    assert not hasattr(model.model.visual.blocks[0].attn.qkv, "wna16_kernels")  # dense tower
    ids = IDS[:12]
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        ours = model.compute_logits(model(ids, torch.arange(len(ids)), None))
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=2e-4)


def test_cli_quantization_flag(capsys) -> None:
    """`--quantization` on the command line: AutoAWQ's own Llama fixture loads with "AWQ";
    a mismatch exits 2 with a one-line error."""
    from pagoda.cli import main

    model = str(Path(__file__).resolve().parents[1] / "fixtures" / "autoawq-tiny" / "llama")
    argv = ["generate", "--model", model, "--device", "cpu", "--max-tokens", "3", "Hello"]
    assert main([*argv, "--quantization", "AWQ"]) == 0
    assert main([*argv, "--quantization", "gptq"]) == 2
    err = capsys.readouterr().err
    assert "error: quantization='gptq' was requested but the checkpoint is 'awq'" in err
    assert "Traceback" not in err


def test_dummy_config_awq_suffix_builds_zero_point_layers(tmp_path) -> None:
    """`config:PATH.json:awq` (benchmarks of the AWQ path on real shapes): random AutoAWQ GEMM
    weights with zero points, lm_head dense, generating tokens."""
    import json

    from pagoda import LLM, SamplingParams

    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    from pagoda.engine.args import EngineArgs

    _, model_config, *_ = EngineArgs(model=f"config:{path}:awq", device="cpu").create_configs()
    qc = model_config.quantization
    assert qc["quant_method"] == "awq" and qc["zero_point"] and qc["group_size"] == 128
    llm = LLM(f"config:{path}:awq", max_model_len=64, dtype="float32", print_memory_report=False)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3
