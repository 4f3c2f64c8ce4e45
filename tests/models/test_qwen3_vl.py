"""Qwen3-VL (dense) against transformers' Qwen3VLForConditionalGeneration on tiny random weights.

The tiny model keeps every Qwen3-VL feature: learned position embeddings resampled to the image
grid, DeepStack features from two vision blocks added after the first two decoder layers,
interleaved M-RoPE, q/k norms. pagoda must give transformers' logits and greedy tokens for text
only, one image and two images, through the model and through the engine (chunked prefill
splitting an image included).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.config import ModelConfig, MultiModalConfig
from pagoda.engine.input_processor import InputProcessor
from pagoda.models.loader import load_model
from pagoda.multimodal.processor import MultiModalProcessor
from tests.models.test_qwen2_5_vl import IMAGE_TOKEN, IMAGES, _conversation, _tokenizer

MIN_PIXELS, MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 64
MAX_NEW = 8
CASES = {"text": [], "one_image": ["a"], "two_images": ["a", "b"]}
TEXT_CONFIG = dict(
    vocab_size=151936,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_parameters={
        "rope_type": "default",
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
        "rope_theta": 5e6,
    },
)
VISION_CONFIG = dict(
    depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
    patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
    deepstack_visual_indexes=[0, 1],
)  # fmt: skip


def save_tiny_qwen3_vl(path: Path, seed: int = 0):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(
        text_config=TEXT_CONFIG,
        vision_config=VISION_CONFIG,
        tie_word_embeddings=True,
        architectures=["Qwen3VLForConditionalGeneration"],
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    (path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "min_pixels": MIN_PIXELS,
                "max_pixels": MAX_PIXELS,
                "merge_size": 2,
                "patch_size": 16,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
            }
        )
    )
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_vl")
    return path, save_tiny_qwen3_vl(path)


def _hf_inputs(ids: list[int], keys: list[str]) -> dict:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    input_ids = torch.tensor([ids])
    kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    if keys:
        proc = Qwen2VLImageProcessorPil(
            min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=16,
            image_mean=[0.5] * 3, image_std=[0.5] * 3,
        )  # fmt: skip
        out = proc(images=[IMAGES[k] for k in keys])
        kwargs["pixel_values"] = torch.from_numpy(out["pixel_values"])
        kwargs["image_grid_thw"] = torch.from_numpy(out["image_grid_thw"])
    kwargs["mm_token_type_ids"] = (input_ids == IMAGE_TOKEN).int()
    return kwargs


def _input_processor(path: Path, hf_config) -> InputProcessor:
    tokenizer = _tokenizer()
    mm = MultiModalProcessor.from_model(
        str(path), hf_config, tokenizer, MultiModalConfig(limit_per_prompt=2), 1024
    )
    return InputProcessor(tokenizer, hf_config.text_config.vocab_size, 1024, mm)


def test_logits_match_transformers(tiny):
    from pagoda.worker.encoder_runner import patchify

    path, hf = tiny
    model = load_model(
        ModelConfig(model=str(path), hf_config=hf.config, dtype="float32", max_model_len=1024),
        "cpu",
    )
    processor = _input_processor(path, hf.config)
    image_config = processor.mm_processor.image_config
    assert (image_config.patch_size, image_config.image_mean) == (16, (0.5, 0.5, 0.5))
    for name, keys in CASES.items():
        processed = processor.process_chat(_conversation(keys))
        ids = processed.prompt_token_ids
        with torch.no_grad():
            ref = hf(**_hf_inputs(ids, keys)).logits[0]
            ids_t = torch.tensor(ids)
            embeds = model.embed_input_ids(ids_t)
            positions = torch.arange(len(ids))
            mm = processed.mm_inputs
            if mm is not None:
                pixels = [torch.from_numpy(item.pixels) for item in mm.items]
                pv = torch.cat([patchify(p, image_config, torch.float32) for p in pixels])
                embeds[ids_t == IMAGE_TOKEN] = model.embed_images(
                    pv, [item.grid_thw for item in mm.items]
                )
                positions = torch.from_numpy(mm.mrope_positions)
                hf_pv = _hf_inputs(ids, keys)["pixel_values"]
                assert torch.equal(pv, hf_pv), name  # the image patches themselves
            ours = model.compute_logits(model(None, positions, None, inputs_embeds=embeds))
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("variant", ["default", "chunked-prefill"])
def test_engine_greedy_matches_transformers(tiny, variant):
    path, hf = tiny
    extra = {"max_num_batched_tokens": 8} if variant == "chunked-prefill" else {}
    llm = LLM(
        str(path), dtype="float32", device="cpu", max_model_len=512, block_size=8,
        limit_mm_per_prompt={"image": 2}, print_memory_report=False, **extra,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.chat([_conversation(keys) for keys in CASES.values()], params, use_tqdm=False)
    for out, (name, keys) in zip(outs, CASES.items(), strict=True):
        ids = out.prompt_token_ids
        with torch.no_grad():
            ref = hf.generate(
                **_hf_inputs(ids, keys), max_new_tokens=MAX_NEW, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        assert out.outputs[0].token_ids == ref[0, len(ids) :].tolist(), f"{variant}/{name}"
    llm.shutdown()


def test_processor_defaults_without_a_preprocessor_file(tiny):
    from pagoda.multimodal.image_processor import ImageProcessorConfig

    _, hf = tiny
    cfg = ImageProcessorConfig.from_model(None, hf.config.vision_config, {})
    assert (cfg.patch_size, cfg.factor, cfg.image_mean) == (16, 32, (0.5, 0.5, 0.5))
    assert (cfg.min_pixels, cfg.max_pixels) == (65536, 16777216)


def test_vision_tower_stays_unquantized_under_an_ignore_rule(tiny):
    """Every vision linear (DeepStack mergers included) goes through the factory by its
    transformers-5 name, so `re:.*visual.*` keeps the tower dense."""
    from pagoda.layers.linear import UnquantizedLinearMethod
    from pagoda.models.qwen3_vl import Qwen3VLForConditionalGeneration

    _, hf = tiny
    prefixes: list[str] = []

    def factory(prefix: str):
        prefixes.append(prefix)
        return UnquantizedLinearMethod()

    Qwen3VLForConditionalGeneration(hf.config, factory)
    assert "model.visual.blocks.0.attn.qkv" in prefixes
    assert "model.visual.deepstack_merger_list.1.linear_fc2" in prefixes
    assert "model.visual.merger.linear_fc1" in prefixes
    assert "model.language_model.layers.2.self_attn.qkv_proj" in prefixes
