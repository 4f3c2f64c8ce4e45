"""Calibration that sees the images: `pagoda quantize` runs a conversation file's images and
videos through the (unquantized) vision tower, so the decoder's statistics include them.

Oracles: pagoda's served forward on the same prompts (the serving input processor, the
model's `embed_images`, M-RoPE positions; itself checked against transformers in
tests/models), for the calibration forward of every layer (Qwen3-VL: DeepStack, interleaved
M-RoPE, a video) and for layer 0's Hessian (Qwen2.5-VL), which counts the image-token rows.
`--text-only-calibration` keeps the text-only statistics.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda.cli import main
from pagoda.config import ModelConfig
from pagoda.models.loader import load_model
from pagoda.quantizer import pipeline
from pagoda.quantizer.api import _calibration_processor, _image_config, quantize
from pagoda.quantizer.calibration import load_calibration_data
from pagoda.worker.encoder_runner import patchify
from tests.models.test_qwen2_5_vl import IMAGE_TOKEN, IMAGES, save_tiny_vl
from tests.models.test_qwen3_vl import save_tiny_qwen3_vl
from tests.multimodal.test_video_inputs import _encode_lossless

VIDEO_TOKEN = 151656


def _records(root: Path, video: bool) -> Path:
    """Every record shape with media (paths relative to the file), and one text record."""
    IMAGES["a"].save(root / "a.png")
    IMAGES["b"].save(root / "b.png")
    records = [
        {"messages": [
            {"role": "user", "content": [{"type": "image", "image": "a.png"},
                                         {"type": "text", "text": "Describe the picture."}]},
            {"role": "assistant", "content": "A grid of coloured noise."},
        ]},
        {"image": "b.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat colour dominates?"},
            {"from": "gpt", "value": "None: it is random."},
        ]},
        {"text": "Plain calibration text without any picture."},
    ]  # fmt: skip
    if video:
        frames = np.random.default_rng(5).integers(0, 256, (4, 64, 96, 3), dtype=np.uint8)
        (root / "clip.mov").write_bytes(_encode_lossless(frames, fps=2))
        records.append(
            {"messages": [{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": "clip.mov"}},
                {"type": "text", "text": "What happens?"}]}]}
        )  # fmt: skip
    path = root / "calib.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _served(model, image_config, ids: torch.Tensor, mm):
    """Inputs embeddings and positions as the model runner builds them for a prompt."""
    embeds = model.embed_input_ids(ids)
    if mm is None:
        return embeds, torch.arange(ids.numel())
    pixels = [torch.from_numpy(item.pixels) for item in mm.items]
    pv = torch.cat([patchify(p, image_config, torch.float32) for p in pixels])
    vision = (ids == IMAGE_TOKEN) | (ids == VIDEO_TOKEN)
    embeds[vision] = model.embed_images(pv, [item.grid_thw for item in mm.items])
    return embeds, torch.from_numpy(mm.mrope_positions)


def _setup(src: Path, hf, dataset: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src)
    processor = _calibration_processor(str(src), hf.config, tokenizer)
    data = load_calibration_data(dataset, tokenizer, 8, 512, 0, processor)
    config = ModelConfig(model=str(src), hf_config=hf.config, dtype="float32", max_model_len=512)
    return data, config, load_model(config, "cpu"), _image_config(str(src), hf.config)


def test_calibration_forward_is_the_served_forward(tmp_path):
    """Qwen3-VL: every layer of the calibration forward (images, a video, DeepStack after the
    first layers, interleaved M-RoPE) equals the served model's on the same prompts."""
    src = tmp_path / "src"
    hf = save_tiny_qwen3_vl(src)
    data, config, dense, image_config = _setup(src, hf, _records(tmp_path, video=True))
    assert len(data.samples) == 4 and sum(mm is not None for mm in data.mm_inputs) == 3
    vision_tokens = sum(int(((s == IMAGE_TOKEN) | (s == VIDEO_TOKEN)).sum()) for s in data.samples)
    assert data.num_vision_tokens == vision_tokens > 0
    assert any(int((s == VIDEO_TOKEN).sum()) for s in data.samples)

    with torch.device("meta"):
        skeleton = type(dense)(hf.config)
    source = pipeline.WeightSource.from_model_config(config, skeleton.checkpoint_to_module_name)
    cpu = torch.device("cpu")
    state = pipeline.CalibrationState.start(
        skeleton, source, data.samples, data.mm_inputs, image_config, cpu, torch.float32
    )
    rope = pipeline.calibration_rope(skeleton, cpu)
    # the served forward: every layer's output (+ DeepStack features where it adds them)
    served = []
    size = dense.config.hidden_size
    for ids, mm in zip(data.samples, data.mm_inputs, strict=True):
        outputs = []
        hooks = [
            layer.register_forward_hook(lambda _m, _i, out, o=outputs: o.append(out[0] + out[1]))
            for layer in dense.language_model.layers
        ]
        with torch.no_grad():
            embeds, positions = _served(dense, image_config, ids, mm)
            dense(None, positions, None, inputs_embeds=embeds)
        for h in hooks:
            h.remove()
        deepstack = embeds[:, size:].view(embeds.shape[0], -1, size)  # zeros on text rows
        for i in range(deepstack.shape[1]):
            outputs[i] = outputs[i] + deepstack[:, i]
        served.append(outputs)
    for index, layer in enumerate(skeleton.language_model.layers):
        pipeline._load_layer(skeleton, layer, index, source, cpu, torch.float32)
        layer.self_attn.rotary_emb = rope
        state.advance(layer, index)
        for got, outputs in zip(state.hidden_states, served, strict=True):
            torch.testing.assert_close(got, outputs[index], rtol=1e-5, atol=1e-5)


def _served_qkv_inputs(dense, image_config, data) -> torch.Tensor:
    """[N, hidden]: layer 0's q/k/v input on every served prompt row, image rows included."""
    rows = []
    layer0 = dense.language_model.layers[0].self_attn.qkv_proj
    hook = layer0.register_forward_pre_hook(lambda _m, inp: rows.append(inp[0]))
    with torch.no_grad():
        for ids, mm in zip(data.samples, data.mm_inputs, strict=True):
            embeds, positions = _served(dense, image_config, ids, mm)
            dense(None, positions, None, inputs_embeds=embeds)
    hook.remove()
    return torch.cat(rows)


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    """A tiny Qwen2.5-VL, its image calibration file, the samples, and layer 0's q/k/v input
    on every served prompt row."""
    root = tmp_path_factory.mktemp("calibrate_images")
    src = root / "src"
    hf = save_tiny_vl(src)
    dataset = _records(root, video=False)
    data, _, dense, image_config = _setup(src, hf, dataset)
    return src, dataset, data, _served_qkv_inputs(dense, image_config, data)


def test_fp8_and_awq_calibrate_with_images(tmp_path, qwen2_5_vl):
    """FP8's static input scale of layer 0's q_proj is max |x| / 448 over the served rows,
    image rows included; AWQ's searches run on the same samples."""
    from safetensors.torch import load_file

    from pagoda.quant.fp8 import static_input_scale

    src, dataset, data, x = qwen2_5_vl
    with contextlib.redirect_stderr(io.StringIO()):
        fp8 = quantize(
            str(src), tmp_path / "f", scheme="FP8", dataset=str(dataset), num_samples=8,
            max_seq_len=512, progress=False,
        )  # fmt: skip
        awq = quantize(
            str(src), tmp_path / "a", method="awq", group_size=32, dataset=str(dataset),
            num_samples=1, max_seq_len=512, progress=False,
        )  # fmt: skip
    assert fp8.num_vision_tokens == data.num_vision_tokens
    assert awq.num_samples == 1 and awq.num_vision_tokens > 0  # one sample, with an image
    scale = load_file(tmp_path / "f" / "model.safetensors")[
        "model.layers.0.self_attn.q_proj.input_scale"
    ]
    assert torch.equal(scale, static_input_scale(x.abs().amax().float()).to(scale.dtype))
    assert all(s.ratio is None or 0 <= s.ratio <= 1 for lr in awq.layers for s in lr.smoothing)


class _Recording(pipeline.HessianAccumulator):
    made: list[pipeline.HessianAccumulator] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _Recording.made.append(self)


@pytest.fixture()
def recording(monkeypatch):
    _Recording.made = []
    monkeypatch.setattr(pipeline, "HessianAccumulator", _Recording)
    return _Recording.made


def test_hessian_counts_the_image_rows(tmp_path, recording, qwen2_5_vl):
    """Qwen2.5-VL, GPTQ: layer 0's q/k/v Hessian is 2 XᵀX / N over every served prompt row,
    image rows included; text-only calibration (the CLI flag) counts only the text."""
    src, dataset, data, x = qwen2_5_vl
    assert data.num_vision_tokens > 0
    x = x.double()
    want = (2 * x.T @ x / x.shape[0]).float()

    with contextlib.redirect_stderr(io.StringIO()):
        report = quantize(
            str(src), tmp_path / "q", method="gptq", group_size=32, dataset=str(dataset),
            num_samples=8, max_seq_len=512, progress=False,
        )  # fmt: skip
    first = recording[0]  # layer 0's q/k/v input, the first accumulator made
    assert report.num_vision_tokens == data.num_vision_tokens
    assert first.num_tokens == report.num_tokens == x.shape[0]
    torch.testing.assert_close(first.hessian, want, rtol=1e-4, atol=1e-6)
    saved = json.loads((tmp_path / "q" / "quantization_report.json").read_text())
    assert saved["num_vision_tokens"] == data.num_vision_tokens

    recording.clear()
    command = ["quantize", str(src), "--out", str(tmp_path / "t"), "--group-size", "32",
               "--dataset", str(dataset), "--text-only-calibration", "--no-progress"]  # fmt: skip
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(command) == 0
    assert "2 image/video part(s) in 2 record(s) dropped" in err.getvalue()
    text_only = json.loads((tmp_path / "t" / "quantization_report.json").read_text())
    assert text_only["num_vision_tokens"] == 0
    # the image rows (and their start / end tokens) are gone from the statistics
    assert recording[0].num_tokens == text_only["num_tokens"] < first.num_tokens
    assert first.num_tokens - recording[0].num_tokens == data.num_vision_tokens + 2 * 2
    remote = tmp_path / "remote.jsonl"
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    remote.write_text(json.dumps({"messages": [{"role": "user", "content": [image, "Hi"]}]}))
    with pytest.raises(ValueError, match=r"1 image\(s\) are http\(s\) URLs.*text-only"):
        quantize(str(src), tmp_path / "r", method="rtn", dataset=str(remote), progress=False)
