"""AWQ: the pure search functions, the smoothing in the pipeline, and both output formats.

Oracles: the output error the search minimises (measured here independently), the decoder
layer's float function (smoothing must not change it), transformers + compressed-tensors on
pagoda's checkpoint, and the AutoAWQ layout read back by the independent reader of
test_awq_fixtures.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagoda.cli import main
from pagoda.quant.weights import WeightQuantArgs
from pagoda.quantizer.api import quantize
from pagoda.quantizer.awq import (
    AWQOptions,
    apply_clip,
    fake_quantize_groups,
    scale_candidates,
    search_clip,
    search_scales,
)
from pagoda.quantizer.rtn import rtn_quantize
from tests.helpers import save_tiny_model
from tests.quant.conftest import FIXTURES
from tests.quant.test_awq_fixtures import AWQ_FIXTURES, _dequantized

ASYM = WeightQuantArgs(num_bits=4, symmetric=False, group_size=32)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _outlier_problem(seed: int = 0):
    """A linear whose input has a few large channels, as LLM activations do."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 128, generator=g) * 0.05
    x = torch.randn(2048, 128, generator=g)
    salient = torch.tensor([3, 40, 77, 101])
    x[:, salient] *= 30.0
    return w, x, salient


def test_fake_quantize_groups_is_rtn() -> None:
    w, _, _ = _outlier_problem()
    expected = rtn_quantize(w, ASYM, torch.bfloat16).dequantize(torch.float32)
    torch.testing.assert_close(fake_quantize_groups(w, ASYM, torch.bfloat16), expected)


def test_scale_candidates_start_at_one_and_are_normalised() -> None:
    g = torch.Generator().manual_seed(0)
    x_mean, w_mean = torch.rand(96, generator=g) + 0.1, torch.rand(96, generator=g) + 0.1
    candidates = list(scale_candidates(x_mean, w_mean, AWQOptions(n_grid=10)))
    assert len(candidates) == 11
    assert candidates[0][0] is None and torch.equal(candidates[0][1], torch.ones(96))
    assert [r for r, _ in candidates[1:]] == [i / 10 for i in range(10)]
    for _, s in candidates:
        assert float(s.max() * s.min()) == pytest.approx(1.0, rel=1e-5)


def test_scale_search_protects_salient_channels() -> None:
    w, x, salient = _outlier_problem()
    reference = x @ w.t()
    calls = []

    def loss_of(candidate: torch.Tensor) -> float:
        calls.append(candidate)
        return float((x @ candidate.t() - reference).pow(2).mean())

    result = search_scales(
        w, x.abs().mean(0), ASYM, loss_of, AWQOptions(), scale_dtype=torch.float32
    )
    assert len(calls) == 21  # s = 1, then 20 exponents
    # The winner is the candidate it reports, and it beats plain rounding clearly.
    rtn_loss = float(
        (x @ fake_quantize_groups(w, ASYM, torch.float32).t() - reference).pow(2).mean()
    )
    assert result.initial_loss == pytest.approx(rtn_loss)
    assert result.ratio is not None and result.loss < 0.5 * result.initial_loss
    s = result.scales
    candidate = fake_quantize_groups(w * s, ASYM, torch.float32) / s
    assert float((x @ candidate.t() - reference).pow(2).mean()) == pytest.approx(result.loss)
    assert bool((s[salient] > s.median()).all())  # the large channels are scaled up


def test_clip_search_lowers_each_groups_error() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(128, 256, generator=g) * 0.02
    x = torch.randn(1024, 256, generator=g)
    # One large weight per group, on an input channel that is nearly silent: it stretches the
    # group's range for almost no output, which is what clipping trades away.
    quiet = torch.arange(8) * 32 + 5
    w[:, quiet] = 0.3
    x[:, quiet] *= 0.01
    max_val = search_clip(w, x, ASYM, AWQOptions(), torch.float32)
    assert max_val.shape == (128, 8)
    full = w.reshape(128, 8, 32).abs().amax(-1)
    assert bool((max_val <= full).all()) and bool((max_val >= 0.55 * full - 1e-7).all())
    assert bool((max_val < full).any())

    def group_errors(weights: torch.Tensor) -> torch.Tensor:  # [out, groups]
        q = fake_quantize_groups(weights, ASYM, torch.float32).reshape(128, 8, 32)
        ref = w.reshape(128, 8, 32)
        xs = x[::2].reshape(-1, 8, 32)  # the 512 tokens the search looked at
        return (torch.einsum("ogk,ngk->ong", q - ref, xs)).pow(2).mean(1)

    clipped, plain = group_errors(apply_clip(w, max_val)), group_errors(w)
    assert bool((clipped <= plain * (1 + 1e-5)).all())
    assert float(clipped.sum()) < 0.5 * float(plain.sum())


# ---------------------------------------------------------------- the pipeline


def _dense_pagoda(model_dir: Path):
    from pagoda.engine.args import EngineArgs
    from pagoda.models.loader import load_model

    args = EngineArgs(model=str(model_dir), dtype="float32", device="cpu")
    _, config, *_ = args.create_configs()
    return load_model(config, "cpu")


def test_smoothing_keeps_the_layer_function(tmp_path) -> None:
    """Folding the scales into norms, v_proj (with its bias) and up_proj changes no output."""
    from pagoda.quantizer.pipeline import (
        DECODER_AWQ_MAPPINGS,
        PipelineOptions,
        _capture_inputs,
        _run_layer,
        layer_targets,
        smooth_layer,
    )

    # As many KV heads as heads: v_proj -> o_proj is smoothed too; Qwen2 has q/k/v biases.
    src = save_tiny_model("qwen2", tmp_path / "qwen2", seed=2, num_key_value_heads=4)
    model = _dense_pagoda(src)
    layer = model.model.layers[0]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.self_attn.qkv_proj.bias.normal_(0.0, 0.5, generator=g)
        hidden = [
            model.model.embed_tokens(torch.randint(0, 384, (n,), generator=g)) for n in (9, 30)
        ]
        before = _run_layer(layer, hidden)
    targets = layer_targets(model, 0, [])
    captured = _capture_inputs(layer, [t.attr for t in targets], hidden)
    changed, reports = smooth_layer(
        model, layer, 0, DECODER_AWQ_MAPPINGS, captured, ASYM, PipelineOptions()
    )
    assert [r.linear.rsplit(".", 2)[-2:] for r in reports] == [
        ["self_attn", "qkv_proj"],
        ["self_attn", "o_proj"],
        ["mlp", "gate_up_proj"],
        ["mlp", "down_proj"],
    ]
    assert any(r.ratio is not None for r in reports)
    assert all(r.loss <= r.initial_loss for r in reports)
    assert set(changed) == {
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.self_attn.v_proj.bias",
    }
    with torch.no_grad():
        after = _run_layer(layer, hidden)
    for b, a in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # The captured inputs now are the smoothed layer's: o_proj's, recaptured, equal them.
    again = _capture_inputs(layer, ["self_attn.o_proj"], hidden)["self_attn.o_proj"]
    for c, x in zip(captured["self_attn.o_proj"], again):
        torch.testing.assert_close(c, x, rtol=1e-4, atol=1e-4)


def _heldout_kl(model, dense, ids: torch.Tensor) -> float:
    """KL(float model || quantized model) per token, on `ids`."""
    with torch.no_grad():
        q = model.compute_logits(model(ids, torch.arange(len(ids)))).log_softmax(-1)
        d = dense.compute_logits(dense(ids, torch.arange(len(ids)))).log_softmax(-1)
    return float(torch.nn.functional.kl_div(q, d, log_target=True, reduction="batchmean"))


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory) -> Path:
    """Qwen2 (q/k/v biases, 4 KV heads so v_proj -> o_proj is smoothed) + a tokenizer."""
    path = save_tiny_model("qwen2", tmp_path_factory.mktemp("awq") / "qwen2", seed=4,
                           num_key_value_heads=4)  # fmt: skip
    state = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    for name, t in state.items():
        if name.endswith("_proj.bias"):
            t.normal_(0.0, 0.5, generator=g)
    from safetensors.torch import save_file

    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "sym" / name, path / name)
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_awq_checkpoint_loads_in_transformers_and_beats_rtn(
    arch, tiny_llama, tiny_qwen2, calib_text, tmp_path
) -> None:
    from tests.quant.test_formats import _hf_logits, _logits, _pagoda

    src = tiny_llama if arch == "llama" else tiny_qwen2
    common = dict(scheme="W4A16_ASYM", group_size=32, num_samples=16, max_seq_len=64,
                  progress=False, device="cpu")  # fmt: skip
    # transformers 5 reads a qwen2 directory's word-level tokenizer as Qwen2Tokenizer (see
    # test_lm_head): the tiny Qwen2 calibrates on random token ids.
    dataset = calib_text if arch == "llama" else "random"
    report = quantize(str(src), tmp_path / "awq", method="awq", dataset=dataset, **common)
    quantize(str(src), tmp_path / "rtn", method="rtn", **common)
    searches = 4 if arch == "qwen2" else 3  # tiny_llama has 2 KV heads: no v_proj -> o_proj
    assert report.method == "awq"
    assert all(len(layer.smoothing) == searches for layer in report.layers)
    qc = json.loads((tmp_path / "awq" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["config_groups"]["group_0"]["weights"]["symmetric"] is False
    tensors = load_file(tmp_path / "awq" / "model.safetensors")
    source = load_file(src / "model.safetensors")
    # The smoothing rescaled the norms (written) and, for Qwen2, v_proj's bias.
    name = "model.layers.0.input_layernorm.weight"
    assert not torch.allclose(tensors[name].float(), source[name].float())
    if arch == "qwen2":
        name = "model.layers.1.self_attn.v_proj.bias"
        assert not torch.allclose(tensors[name].float(), source[name].float())
    model, _ = _pagoda(tmp_path / "awq")
    torch.testing.assert_close(_logits(model), _hf_logits(tmp_path / "awq"), rtol=2e-4, atol=2e-4)
    # Held-out tokens (not the calibration text): AWQ's output is nearer the float model's.
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(4, 384, (96,), generator=g)
    dense = _dense_pagoda(src)
    assert _heldout_kl(model, dense, ids) < _heldout_kl(_pagoda(tmp_path / "rtn")[0], dense, ids)


def test_awq_mistral_sliding_window(tmp_path) -> None:
    """Mistral (window 8, prompts of 16): calibrated and served with the window; transformers +
    compressed-tensors give the same logits."""
    from transformers import AutoModelForCausalLM, MistralConfig

    from tests.quant.test_formats import _hf_logits, _logits, _pagoda

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
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "sym" / name, tmp_path / "dense" / name)
    report = quantize(str(tmp_path / "dense"), tmp_path / "awq", method="awq", group_size=32,
                      dataset="random", num_samples=8, max_seq_len=48, progress=False,
                      device="cpu")  # fmt: skip
    assert all(len(layer.smoothing) == 3 for layer in report.layers)
    model, _ = _pagoda(tmp_path / "awq")
    torch.testing.assert_close(_logits(model), _hf_logits(tmp_path / "awq"), rtol=2e-4, atol=2e-4)


def test_autoawq_format_matches_compressed_tensors(tiny_qwen2, tmp_path) -> None:
    from tests.quant.test_formats import _logits, _pagoda

    common = dict(method="awq", group_size=32, dataset="random", num_samples=16,
                  max_seq_len=64, progress=False, device="cpu", dtype="float16")  # fmt: skip
    quantize(str(tiny_qwen2), tmp_path / "ct", **common)
    quantize(str(tiny_qwen2), tmp_path / "awq", format="autoawq", **common)
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    autoawq_written = json.loads((AWQ_FIXTURES / "qwen2" / "config.json").read_text())
    assert config["quantization_config"] == {
        **autoawq_written["quantization_config"],
        "group_size": 32,
    }
    tensors = load_file(tmp_path / "awq" / "model.safetensors")
    prefix = "model.layers.0.self_attn.q_proj"
    assert tensors[f"{prefix}.qweight"].shape == (64, 8)  # [in, out / 8] int32
    assert tensors[f"{prefix}.qzeros"].shape == (2, 8)  # [in / G, out / 8]
    assert tensors[f"{prefix}.scales"].dtype == torch.float16
    assert not any(k.endswith(("weight_packed", "q_proj.weight")) for k in tensors)
    # The same codes and scales in both layouts: read back independently, the weights agree.
    from pagoda.quantizer.checkpoint import dequantized_state_dict

    ct = dequantized_state_dict(tmp_path / "ct")
    independent = _dequantized(tmp_path / "awq", AWQ_ORDER)
    assert set(independent) == set(ct)
    for name, t in ct.items():
        torch.testing.assert_close(independent[name], t.float(), rtol=0, atol=0, msg=name)
    awq_model, config = _pagoda(tmp_path / "awq")
    assert config.quantization["quant_method"] == "awq"
    torch.testing.assert_close(_logits(awq_model), _logits(_pagoda(tmp_path / "ct")[0]))


def test_awq_errors(tiny_llama, calib_text, tmp_path, capsys) -> None:
    with pytest.raises(ValueError, match="AWQ needs calibration data"):
        quantize(str(tiny_llama), tmp_path / "o", method="awq", group_size=32)
    with pytest.raises(ValueError, match="format='autoawq' stores 4-bit weights only"):
        quantize(str(tiny_llama), tmp_path / "o", method="awq", scheme="W8A16", group_size=32,
                 dataset=calib_text, format="autoawq")  # fmt: skip
    with pytest.raises(ValueError, match="format='autoawq' keeps lm_head unquantized"):
        quantize(str(tiny_llama), tmp_path / "o", method="awq", group_size=32, ignore=[],
                 dataset=calib_text, format="autoawq")  # fmt: skip
    with pytest.raises(ValueError, match="format='gguf' is not supported"):
        quantize(str(tiny_llama), tmp_path / "o", method="awq", format="gguf")
    code = main(["quantize", str(tiny_llama), "--out", str(tmp_path / "o"), "--method", "awq",
                 "--group-size", "32", "--format", "autoawq", "--scheme", "W8A16",
                 "--dataset", str(calib_text)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "format='autoawq' stores 4-bit weights only" in err
    assert "Traceback" not in err and not (tmp_path / "o").exists()


def test_awq_qwen2_5_vl_text_decoder(tmp_path) -> None:
    """Qwen2.5-VL: the text decoder smoothed and quantized, the vision tower byte for byte;
    transformers + compressed-tensors agree with pagoda, and the AutoAWQ layout (vision tower
    as `modules_to_not_convert: ["visual"]`) serves the same logits."""
    pytest.importorskip("compressed_tensors")
    from transformers import Qwen2_5_VLForConditionalGeneration

    from tests.models.test_qwen2_5_vl import (
        _conversation,
        _hf_forward_kwargs,
        _input_processor,
        _pagoda_logits,
        save_tiny_vl,
    )
    from tests.quant.test_formats import _pagoda
    from tests.quant.test_quantize_vl import CALIBRATION, QUANT_ARGS, _raw_equal

    src = tmp_path / "src"
    save_tiny_vl(src)
    dataset = tmp_path / "calib.json"
    dataset.write_text(json.dumps(CALIBRATION))
    outs = {}
    # transformers runs a compressed-tensors model in its stored dtype: float32 for the
    # comparison with it; float16 (AutoAWQ's scale dtype) for the two layouts to agree exactly.
    for name, fmt, dtype in (("ct", "compressed-tensors", "float32"),
                             ("ct16", "compressed-tensors", "float16"),
                             ("autoawq", "autoawq", "float16")):  # fmt: skip
        outs[name] = tmp_path / name
        command = ["quantize", str(src), "--out", str(outs[name]), "--method", "awq",
                   *QUANT_ARGS, "--ignore", "re:.*visual.*", "--dataset", str(dataset),
                   "--dtype", dtype, "--format", fmt, "--no-progress"]  # fmt: skip
        assert main(command) == 0
    before = load_file(src / "model.safetensors")
    after = load_file(outs["ct"] / "model.safetensors")
    for name in before:
        if name.startswith("visual."):  # release layout names, tensors untouched
            assert _raw_equal(after[name], before[name].to(after[name].dtype)), name
    name = "model.layers.0.input_layernorm.weight"  # rescaled, under the release name
    assert not torch.allclose(after[name].float(), before[name].float())
    qc = json.loads((outs["autoawq"] / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "awq" and qc["modules_to_not_convert"] == ["visual"]

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(outs["ct"], dtype=torch.float32)
    hf.eval()
    ours, ct16, autoawq = (_pagoda(outs[n])[0] for n in ("ct", "ct16", "autoawq"))
    processor = _input_processor(outs["ct"], hf.config)
    for keys in ([], ["a"]):
        processed = processor.process_chat(_conversation(keys))
        with torch.no_grad():
            ref = hf(**_hf_forward_kwargs(processed.prompt_token_ids, keys)).logits[0]
        got = _pagoda_logits(ours, processed)
        torch.testing.assert_close(got, ref, rtol=2e-4, atol=2e-4)
        torch.testing.assert_close(
            _pagoda_logits(autoawq, processed), _pagoda_logits(ct16, processed)
        )


def test_capture_keeps_the_scored_samples_and_means_over_all(tmp_path) -> None:
    """AWQ keeps only the searches' samples (a 7B layer's inputs of every sample ran an 80 GB GPU
    out of memory) while each channel mean still covers every sample."""
    from pagoda.quantizer.awq import activation_mean
    from pagoda.quantizer.pipeline import _capture_inputs, layer_targets

    model = _dense_pagoda(save_tiny_model("qwen2", tmp_path / "qwen2", seed=3))
    layer = model.model.layers[0]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hidden = [
            model.model.embed_tokens(torch.randint(0, 384, (n,), generator=g)) for n in (5, 9, 30)
        ]
    attrs = [t.attr for t in layer_targets(model, 0, [])]
    every = _capture_inputs(layer, attrs, hidden)
    means: dict[str, torch.Tensor] = {}
    kept = _capture_inputs(layer, attrs, hidden, keep=[0, 2], means=means)
    for a in attrs:
        assert len(every[a]) == 3 and len(kept[a]) == 2
        for x, y in zip(kept[a], [every[a][0], every[a][2]]):
            assert torch.equal(x, y)
        assert torch.equal(means[a], activation_mean(every[a]))
