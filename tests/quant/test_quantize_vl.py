"""`pagoda quantize` on Qwen2.5-VL: text-only calibration of the decoder, vision tower kept.

A tiny random Qwen2.5-VL (tests/models/test_qwen2_5_vl.py's, saved by transformers in the
release layout `visual.*` / `model.layers.*`) is quantized with RTN through the Python API
(no vision ignore rule: the pipeline adds it with a note) and with GPTQ through the CLI
(the issue's command, conversation JSON with `<image>` tags). Oracles: the input's vision
tensors byte for byte; the same model served dense with independently dequantized weights
(model logits and engine greedy tokens, text only and with an image); transformers +
compressed-tensors on the written directory; the model's own forward for the calibration
forward (M-RoPE positions of a text prompt).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda import SamplingParams
from pagoda.cli import main
from pagoda.engine.args import EngineArgs
from pagoda.models.loader import load_model
from pagoda.quantizer.api import quantize
from pagoda.quantizer.checkpoint import dequantized_state_dict
from tests.models.test_qwen2_5_vl import (
    IMAGE_TOKEN,
    _conversation,
    _hf_forward_kwargs,
    _input_processor,
    _llm,
    _pagoda_logits,
    save_tiny_vl,
)

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
# What llmcompressor (compressed-tensors) writes for this model with `re:.*visual.*` and
# lm_head ignored: every dense Linear by its transformers module name, in module order.
VISION_LINEARS = [
    f"model.visual.blocks.{b}.{m}"
    for b in range(2)
    for m in ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
] + ["model.visual.merger.mlp.0", "model.visual.merger.mlp.2"]
CALIBRATION = [
    {
        "conversations": [
            {"from": "human", "value": f"<image>\nWhat is on shelf {i}? List the colours."},
            {"from": "gpt", "value": f"Shelf {i} holds {i + 2} red cups and a blue jar."},
        ]
    }
    for i in range(6)
]
QUANT_ARGS = ["--group-size", "32", "--num-samples", "4", "--max-seq-len", "48"]
CASES = {"text": [], "one_image": ["a"]}


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """Source model, calibration file, and the RTN (API) and GPTQ (CLI) outputs."""
    root = tmp_path_factory.mktemp("vl")
    src = root / "src"
    save_tiny_vl(src)
    dataset = root / "calib.json"
    dataset.write_text(json.dumps(CALIBRATION))
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):  # no vision rule: the note says it was added
        quantize(str(src), root / "rtn", method="rtn", group_size=32, progress=False)
    gptq = root / "gptq"
    command = ["quantize", str(src), "--out", str(gptq), "--scheme", "W4A16", *QUANT_ARGS,
               "--ignore", "lm_head", "--ignore", "re:.*visual.*", "--dataset", str(dataset),
               "--no-progress"]  # fmt: skip
    assert main(command) == 0
    return dict(
        root=root, src=src, dataset=dataset, rtn=root / "rtn", gptq=gptq,
        rtn_note=stderr.getvalue(),
    )  # fmt: skip


def _raw_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (torch.equal would call -0.0 and 0.0 equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_checkpoint_layout_ignore_and_files(vl, method):
    src, out = vl["src"], vl[method]
    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    # Same naming as the input (release layout); nothing in transformers-5 names.
    assert not any(k.startswith(("model.language_model.", "model.visual.")) for k in after)
    vision = [k for k in before if k.startswith("visual.")]
    assert any("merger" in k for k in vision) and "visual.patch_embed.proj.weight" in vision
    for name in before:
        module = name.rsplit(".", 1)[0]
        quantized = name.endswith(".weight") and any(
            module == f"model.layers.{i}.{p}" for i in range(2) for p in PROJ
        )
        if quantized:
            assert name not in after
            packed = after[f"{module}.weight_packed"]
            out_f, in_f = before[name].shape
            assert packed.dtype == torch.int32 and packed.shape == (out_f, in_f // 8)
            assert after[f"{module}.weight_shape"].tolist() == [out_f, in_f]
            assert after[f"{module}.weight_scale"].shape == (out_f, in_f // 32)
        else:  # vision tower (merger included), norms, biases, embeddings: byte-identical
            assert _raw_equal(after[name], before[name]), name

    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert qc["format"] == "pack-quantized" and qc["quant_method"] == "compressed-tensors"
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert qc["ignore"] == [*VISION_LINEARS, "lm_head"]
    for name in ("preprocessor_config.json", "chat_template.jinja", "tokenizer.json",
                 "tokenizer_config.json", "generation_config.json"):  # fmt: skip
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    report = json.loads((out / "quantization_report.json").read_text())
    assert [m["name"] for m in report["layers"][0]["modules"]][0].startswith(
        "model.language_model.layers.0."
    )
    assert all(m["relative_error"] < 0.05 for lr in report["layers"] for m in lr["modules"])
    if method == "rtn":
        assert "vision tower is kept unquantized" in vl["rtn_note"]
        assert "12 of its 12 linear modules" in vl["rtn_note"]
    else:
        assert report["num_samples"] == 4 and report["method"] == "gptq"


def _dense_copy(quantized: Path, dst: Path) -> Path:
    """The quantized checkpoint with its weights dequantized, as a plain model directory."""
    dst.mkdir()
    for f in quantized.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    config = json.loads((quantized / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    save_file(dequantized_state_dict(quantized), str(dst / "model.safetensors"))
    return dst


def _load(path: Path):
    """pagoda's model of `path` (float32, CPU) and its ModelConfig, as the engine makes them."""
    _, config, *_ = EngineArgs(model=str(path), dtype="float32", device="cpu").create_configs()
    return load_model(config, "cpu"), config


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_quantized_model_matches_dequantized_weights(vl, method, tmp_path):
    out = vl[method]
    dense_dir = _dense_copy(out, tmp_path / "dense")
    quantized, config = _load(out)
    dense, _ = _load(dense_dir)
    assert config.quantization is not None
    processor = _input_processor(out, config.hf_config)
    for name, keys in CASES.items():
        processed = processor.process_chat(_conversation(keys))
        assert (IMAGE_TOKEN in processed.prompt_token_ids) == bool(keys)
        ours, ref = _pagoda_logits(quantized, processed), _pagoda_logits(dense, processed)
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4, msg=f"{method}/{name}")
    if method == "rtn":
        return
    # The engine (paged KV cache, M-RoPE positions, encoder runner) on both directories.
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    conversations = [_conversation(keys) for keys in CASES.values()]
    results = []
    for path in (out, dense_dir):
        llm = _llm(path, limit_mm_per_prompt={"image": 1})
        results.append(llm.chat(conversations, params, use_tqdm=False))
        del llm
    for q, d in zip(*results, strict=True):
        assert q.outputs[0].token_ids == d.outputs[0].token_ids
        for lq, ld in zip(q.outputs[0].logprobs, d.outputs[0].logprobs, strict=True):
            for tid, lp in lq.items():
                assert abs(lp.logprob - ld[tid].logprob) < 1e-3


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_transformers_loads_the_checkpoint(vl, method):
    pytest.importorskip("compressed_tensors")
    from transformers import Qwen2_5_VLForConditionalGeneration

    out = vl[method]
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    # compressed-tensors wrapped (and decompressed) the text linears only.
    assert hasattr(hf.model.language_model.layers[0].self_attn.q_proj, "quantization_scheme")
    assert not hasattr(hf.model.visual.blocks[0].attn.qkv, "quantization_scheme")
    assert not hasattr(hf.model.visual.merger.mlp[0], "quantization_scheme")
    ours, config = _load(out)
    processor = _input_processor(out, config.hf_config)
    for name, keys in CASES.items():
        processed = processor.process_chat(_conversation(keys))
        with torch.no_grad():
            ref = hf(**_hf_forward_kwargs(processed.prompt_token_ids, keys)).logits[0]
        got = _pagoda_logits(ours, processed)
        torch.testing.assert_close(got, ref, rtol=2e-4, atol=2e-4, msg=f"{method}/{name}")


def test_transformers5_layout_keeps_its_names(vl, tmp_path):
    """Input named `model.language_model.*` / `model.visual.*`: output named so too, and the
    same GPTQ result as from the release layout (here with llmcompressor's `re:visual.*`)."""
    src = tmp_path / "t5"
    src.mkdir()
    for f in vl["src"].iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, src / f.name)
    release = load_file(vl["src"] / "model.safetensors")
    renamed = {("model." + k if k.startswith("visual.") else
                k.replace("model.", "model.language_model.", 1)): v
               for k, v in release.items()}  # fmt: skip
    save_file(renamed, str(src / "model.safetensors"))
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        quantize(
            str(src), tmp_path / "q", ignore=["lm_head", "re:visual.*"], dataset=vl["dataset"],
            group_size=32, num_samples=4, max_seq_len=48, progress=False,
        )  # fmt: skip
    # `re:visual.*` covered the tower: no note that its linears were added to the ignore list
    assert "were not matched by the ignore list" not in stderr.getvalue()
    assert "<image>" not in stderr.getvalue() and "image/video part(s)" in stderr.getvalue()
    ours = load_file(tmp_path / "q" / "model.safetensors")
    reference = load_file(vl["gptq"] / "model.safetensors")
    assert "model.language_model.layers.0.self_attn.q_proj.weight_packed" in ours
    assert "model.visual.merger.mlp.0.weight" in ours
    assert len(ours) == len(reference)
    for name, tensor in reference.items():
        new = ("model." + name if name.startswith("visual.") else
               name.replace("model.", "model.language_model.", 1))  # fmt: skip
        assert _raw_equal(ours[new], tensor), name
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == [*VISION_LINEARS, "lm_head"]


def test_calibration_forward_is_the_models_text_forward(vl):
    """Layer-by-layer calibration (embeddings, rotary, layers) equals the loaded model's
    forward with the M-RoPE positions the VL processor gives a text prompt ([3, T])."""
    import numpy as np

    from pagoda.layers.rotary import MRotaryEmbedding
    from pagoda.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
    from pagoda.multimodal.inputs import mrope_positions
    from pagoda.quantizer.pipeline import (
        WeightSource,
        _load_layer,
        _run_layer,
        calibration_rope,
        decoder_of,
        layer_inputs,
    )

    dense, config = _load(vl["src"])
    ids = torch.tensor([151644, 872, 198, 3838, 374, 389, 27645, 220, 18, 30, 151645, 198])
    positions, delta = mrope_positions(len(ids), [], [], 2)
    assert delta == 0 and np.array_equal(positions, np.tile(np.arange(len(ids)), (3, 1)))
    captured = {}
    last = dense.language_model.layers[-1]
    handle = last.register_forward_hook(lambda _m, _i, out: captured.update(h=out[0] + out[1]))
    with torch.no_grad():
        dense(ids, torch.from_numpy(positions))
    handle.remove()

    with torch.device("meta"):
        skeleton = Qwen2_5_VLForConditionalGeneration(config.hf_config)
    decoder, name = decoder_of(skeleton)
    assert name == "model.language_model"
    source = WeightSource.from_model_config(config, skeleton.checkpoint_to_module_name)
    assert (
        source.checkpoint_name("model.visual.merger.mlp.0.weight") == "visual.merger.mlp.0.weight"
    )
    cpu = torch.device("cpu")
    hidden = layer_inputs(skeleton, source, [ids], cpu, torch.float32)
    rope = calibration_rope(skeleton, cpu)
    assert isinstance(rope, MRotaryEmbedding) and rope.mrope_section == [2, 3, 3]
    with torch.no_grad():
        for index, layer in enumerate(decoder.layers):
            _load_layer(skeleton, layer, index, source, cpu, torch.float32)
            layer.self_attn.rotary_emb = rope
            hidden = _run_layer(layer, hidden)
    torch.testing.assert_close(hidden[0], captured["h"], rtol=1e-5, atol=1e-5)


def test_qwen2_vl_rtn(tmp_path):
    """Qwen2-VL (same decoder, LayerNorm / quick-GELU vision tower): RTN, tower kept."""
    src = tmp_path / "src"
    save_tiny_vl(src, "qwen2_vl")
    with contextlib.redirect_stderr(io.StringIO()):
        quantize(str(src), tmp_path / "q", method="rtn", group_size=32, progress=False)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == [
        *(f"model.visual.blocks.{b}.{m}" for b in range(2)
          for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")),
        "model.visual.merger.mlp.0", "model.visual.merger.mlp.2", "lm_head",
    ]  # fmt: skip
    quantized, config = _load(tmp_path / "q")
    dense, _ = _load(_dense_copy(tmp_path / "q", tmp_path / "dense"))
    processor = _input_processor(tmp_path / "q", config.hf_config)
    processed = processor.process_chat(_conversation(["a"]))
    torch.testing.assert_close(
        _pagoda_logits(quantized, processed), _pagoda_logits(dense, processed), rtol=1e-4, atol=1e-4
    )
