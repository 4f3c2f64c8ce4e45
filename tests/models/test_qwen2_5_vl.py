"""Qwen2.5-VL (and Qwen2-VL) against transformers on tiny random models, model and engine.

A tiny config (vision depth 2 with one windowed and one full-attention block, text hidden 64)
is saved with `save_pretrained`, with the Qwen2.5 tokenizer, Qwen2.5-VL's chat template and a
preprocessor config. pagoda must give transformers' logits and greedy tokens for text only, one
image and two images of different sizes, with prefix caching on or off and with chunked prefill
splitting images; different images must never share KV blocks, identical requests must.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pagoda import LLM, SamplingParams
from pagoda.config import ModelConfig, MultiModalConfig
from pagoda.engine.input_processor import InputProcessor
from pagoda.models.loader import load_model
from pagoda.multimodal.processor import MultiModalProcessor

FIXTURES = Path(__file__).parent.parent / "fixtures" / "qwen2.5-tokenizer"
IMAGE_TOKEN = 151655
MAX_NEW = 8
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 64

# Qwen2.5-VL-Instruct's chat template (chat_template.json of the release).
VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT_CONFIG = dict(
    vocab_size=151936,  # the Qwen2.5 tokenizer's ids
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6},
)
VISION_CONFIGS = {
    # window 56 px = 2x2 merged units per window: windows of 16 patches, partial ones at edges
    "qwen2_5_vl": dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
        patch_size=14, window_size=56, fullatt_block_indexes=[1], spatial_merge_size=2,
        temporal_patch_size=2,
    ),
    "qwen2_vl": dict(
        depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2,
    ),
}  # fmt: skip


def _hf_classes(model_type: str):
    if model_type == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    return Qwen2VLConfig, Qwen2VLForConditionalGeneration


@functools.cache
def _tokenizer():
    """The Qwen2.5 tokenizer with Qwen2.5-VL's chat template (loaded once: ~3 s each time)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(FIXTURES)
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def save_tiny_vl(path: Path, model_type: str = "qwen2_5_vl", seed: int = 0) -> torch.nn.Module:
    """A random tiny VL model saved as a full model directory; returns the HF model."""
    config_cls, model_cls = _hf_classes(model_type)
    config = config_cls(
        text_config=TEXT_CONFIG,
        vision_config=VISION_CONFIGS[model_type],
        tie_word_embeddings=True,
        architectures=[model_cls.__name__],
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # decisive (not near-flat) logits, norms away from exactly 1
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    (path / "preprocessor_config.json").write_text(
        json.dumps({"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, "merge_size": 2})
    )
    return model


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


IMAGES = {"a": _image(56, 84, 1), "b": _image(112, 56, 2), "c": _image(56, 84, 3)}
CASES = {"text": [], "one_image": ["a"], "two_images": ["a", "b"]}
QUESTION = "What is in the picture?"


def _conversation(image_keys: list[str], question: str = QUESTION) -> list[dict]:
    # Both message shapes the user sends: vLLM's image_url data URL and HF's {"image": PIL}.
    parts: list[dict] = []
    for n, key in enumerate(image_keys):
        if n % 2 == 0:
            parts.append({"type": "image_url", "image_url": {"url": _data_url(IMAGES[key])}})
        else:
            parts.append({"type": "image", "image": IMAGES[key]})
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def _hf_pixel_inputs(image_keys: list[str]) -> dict[str, torch.Tensor]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    if not image_keys:
        return {}
    proc = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    out = proc(images=[IMAGES[k] for k in image_keys])
    return {
        "pixel_values": torch.from_numpy(out["pixel_values"]),
        "image_grid_thw": torch.from_numpy(out["image_grid_thw"]),
    }


def _hf_forward_kwargs(ids: list[int], image_keys: list[str]) -> dict:
    input_ids = torch.tensor([ids])
    kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    if image_keys:
        kwargs.update(_hf_pixel_inputs(image_keys))
        kwargs["mm_token_type_ids"] = (input_ids == IMAGE_TOKEN).int()
    return kwargs


def _input_processor(path: Path, hf_config, limit: int = 2) -> InputProcessor:
    tokenizer = _tokenizer()
    mm = MultiModalProcessor.from_model(
        str(path), hf_config, tokenizer, MultiModalConfig(limit_per_prompt=limit), 1024
    )
    return InputProcessor(tokenizer, hf_config.text_config.vocab_size, 1024, mm)


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    return path, save_tiny_vl(path)


# ---------------------------------------------------------------------- model level


def _pagoda_logits(model, processed) -> torch.Tensor:
    """Full-prompt logits without a KV cache: image rows scattered into the embeddings."""
    from pagoda.worker.encoder_runner import patchify

    ids = torch.tensor(processed.prompt_token_ids)
    mm = processed.mm_inputs
    with torch.inference_mode():
        embeds = model.embed_input_ids(ids)
        positions = torch.arange(len(ids))
        if mm is not None:
            cfg_pixels = [torch.from_numpy(img.pixels) for img in mm.items]
            runner_cfg = _image_config(model)
            pixel_values = torch.cat([patchify(p, runner_cfg, torch.float32) for p in cfg_pixels])
            image_embeds = model.embed_images(pixel_values, [img.grid_thw for img in mm.items])
            embeds[ids == IMAGE_TOKEN] = image_embeds
            positions = torch.from_numpy(mm.mrope_positions)
        return model.compute_logits(model(None, positions, None, inputs_embeds=embeds))


def _image_config(model):
    from pagoda.multimodal.image_processor import ImageProcessorConfig

    return ImageProcessorConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen2_vl"])
def test_logits_match_transformers(model_type, tiny_vl, tmp_path):
    if model_type == "qwen2_5_vl":
        path, hf_model = tiny_vl
    else:
        path, hf_model = tmp_path, save_tiny_vl(tmp_path, model_type)
    config = ModelConfig(
        model=str(path), hf_config=hf_model.config, dtype="float32", max_model_len=1024
    )
    model = load_model(config, "cpu")
    processor = _input_processor(path, hf_model.config)
    for name, keys in CASES.items():
        processed = processor.process_chat(_conversation(keys))
        ids = processed.prompt_token_ids
        assert (
            ids.count(IMAGE_TOKEN)
            == sum(processed.mm_inputs.placeholders[i][1] for i in range(len(keys)))
            if keys
            else IMAGE_TOKEN not in ids
        )
        with torch.no_grad():
            ref = hf_model(**_hf_forward_kwargs(ids, keys)).logits[0]
        ours = _pagoda_logits(model, processed)
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4, msg=f"{model_type}/{name}")


def test_chat_prompt_is_what_transformers_processor_builds(tiny_vl):
    """Template rendering + placeholder expansion as Qwen2_5_VLProcessor does it."""
    path, hf_model = tiny_vl
    processed = _input_processor(path, hf_model.config).process_chat(_conversation(["a", "b"]))
    tokenizer = _tokenizer()
    hf_messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                     {"type": "text", "text": QUESTION}]}
    ]  # fmt: skip
    text = tokenizer.apply_chat_template(hf_messages, tokenize=False, add_generation_prompt=True)
    grids = _hf_pixel_inputs(["a", "b"])["image_grid_thw"]
    for n in (grids.prod(-1) // 4).tolist():  # the processor's expansion, image by image
        text = text.replace("<|image_pad|>", "<|placeholder|>" * n, 1)
    text = text.replace("<|placeholder|>", "<|image_pad|>")
    assert processed.prompt_token_ids == tokenizer(text).input_ids
    assert processed.prompt == tokenizer.apply_chat_template(
        hf_messages, tokenize=False, add_generation_prompt=True
    )


def test_both_checkpoint_layouts_load(tiny_vl, tmp_path):
    """transformers 5 names (model.language_model.*, model.visual.*) load like the original."""
    from safetensors.torch import save_file

    path, hf_model = tiny_vl
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    assert any(k.startswith("model.language_model.") for k in state)
    for name in ("config.json",):
        shutil.copy(path / name, tmp_path / name)
    save_file(state, str(tmp_path / "model.safetensors"))
    config = dict(hf_config=hf_model.config, dtype="float32", max_model_len=1024)
    a = load_model(ModelConfig(model=str(path), **config), "cpu")
    b = load_model(ModelConfig(model=str(tmp_path), **config), "cpu")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    # Names map back to the released layout (what quantization ignore lists use).
    cls = type(a)
    assert (
        cls.module_to_original_name("model.visual.blocks.0.attn.qkv") == "visual.blocks.0.attn.qkv"
    )
    assert cls.checkpoint_to_module_name("model.layers.0.mlp.up_proj.weight") == (
        "model.language_model.layers.0.mlp.up_proj.weight"
    )
    with pytest.raises(ValueError, match="match no parameter"):
        a.load_weights([("visual.blocks.9.attn.qkv.weight", torch.zeros(1))])


def test_vision_linears_go_through_the_linear_method_factory(tiny_vl):
    from pagoda.layers.linear import UnquantizedLinearMethod
    from pagoda.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

    _, hf_model = tiny_vl
    prefixes: list[str] = []

    def factory(prefix: str):
        prefixes.append(prefix)
        return UnquantizedLinearMethod()

    model = Qwen2_5_VLForConditionalGeneration(hf_model.config, factory)
    assert "model.visual.blocks.0.attn.qkv" in prefixes
    assert "model.visual.merger.mlp.2" in prefixes
    assert "model.language_model.layers.1.mlp.gate_up_proj" in prefixes
    assert len(model.language_model.layers) == 2  # what a layer-by-layer pipeline walks


def test_mrope_triton_kernel_route_matches_torch():
    """The CUDA path feeds per-token angles to the fused RoPE kernel (interpreter on CPU)."""
    triton_ops = pytest.importorskip("pagoda.kernels.norm_act.triton_fused_ops")
    from pagoda.layers.rotary import MRotaryEmbedding

    rope = MRotaryEmbedding(16, 64, 1e6, [2, 3, 3])
    positions = torch.tensor([[0, 1, 1, 1, 3], [0, 1, 1, 2, 3], [0, 1, 2, 1, 3]])
    q, k = torch.randn(5, 4 * 16), torch.randn(5, 2 * 16)
    ref_q, ref_k = rope(positions, q.clone(), k.clone())
    cos, sin = rope.token_cos_sin(positions)
    rows = torch.arange(5)
    out_q, out_k = triton_ops.apply_rotary_triton(rows, q.clone(), k.clone(), cos, sin, 16)
    torch.testing.assert_close(out_q, ref_q)
    torch.testing.assert_close(out_k, ref_k)
    # equal positions on all axes: plain RoPE (decode steps and CUDA graphs use [T])
    flat = torch.tensor([4, 5])
    torch.testing.assert_close(
        rope(flat.expand(3, 2), q[:2].clone(), k[:2].clone())[0],
        rope(flat, q[:2].clone(), k[:2].clone())[0],
    )


# ---------------------------------------------------------------------- engine level


@pytest.fixture(scope="module")
def hf_reference(tiny_vl):
    """Prompt ids (pagoda's) and transformers' greedy tokens + log-softmax for every case."""
    path, hf_model = tiny_vl
    processor = _input_processor(path, hf_model.config)
    out = {}
    for name, keys in CASES.items():
        ids = processor.process_chat(_conversation(keys)).prompt_token_ids
        with torch.no_grad():
            gen = hf_model.generate(
                **_hf_forward_kwargs(ids, keys),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                eos_token_id=None,
                pad_token_id=0,
            )
        tokens = gen.sequences[0, len(ids) :].tolist()
        logprobs = [torch.log_softmax(s[0].float(), -1) for s in gen.logits]
        out[name] = (ids, tokens, logprobs)
    return out


ENGINE_VARIANTS = {
    "default": dict(),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    # 8 tokens a step: image runs are split across steps (and mixed with other requests)
    "chunked-prefill": dict(max_num_batched_tokens=8),
    # image chunks in the same steps as decodes whose input token is still on the device
    "async-chunked-prefill": dict(async_scheduling=True, max_num_batched_tokens=8),
}


def _llm(path: Path, **kwargs) -> LLM:
    options = dict(dtype="float32", device="cpu", max_model_len=512, block_size=8)
    options.update(kwargs)
    return LLM(str(path), print_memory_report=False, **options)


@pytest.fixture(scope="module")
def default_llm(tiny_vl) -> LLM:
    """One engine for the tests that do not need special options (tokenizer loads are slow)."""
    return _llm(tiny_vl[0], limit_mm_per_prompt={"image": 2})


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_engine_greedy_matches_transformers(tiny_vl, hf_reference, default_llm, variant):
    path, _ = tiny_vl
    if variant == "default":
        llm = default_llm
    else:
        llm = _llm(path, limit_mm_per_prompt={"image": 2}, **ENGINE_VARIANTS[variant])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    outs = llm.chat([_conversation(keys) for keys in CASES.values()], params, use_tqdm=False)
    for out, (name, (ids, tokens, logprobs)) in zip(outs, hf_reference.items(), strict=True):
        assert out.prompt_token_ids == ids, name
        comp = out.outputs[0]
        assert comp.token_ids == tokens, f"{variant}/{name}"
        for step, entry in enumerate(comp.logprobs):
            for tid, lp in entry.items():
                assert abs(lp.logprob - logprobs[step][tid].item()) < 1e-3, (name, step)
    runner = llm.llm_engine.core.runner.encoder_runner
    assert runner.num_encoded >= 2  # a and b (a again if its cache entry was released)
    assert not runner.cache and not runner.users and not runner.held  # nothing leaks


def test_generate_with_multi_modal_data_matches_chat(default_llm, hf_reference):
    llm = default_llm
    ids, tokens, _ = hf_reference["one_image"]
    prompt = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        f"<|vision_start|><|image_pad|><|vision_end|>{QUESTION}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    (out,) = llm.generate(
        {"prompt": prompt, "multi_modal_data": {"image": IMAGES["a"]}}, params, use_tqdm=False
    )
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == tokens


def test_prefix_cache_never_shares_image_blocks(default_llm):
    llm = default_llm
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    core = llm.llm_engine.core
    runner = core.runner.encoder_runner

    (first,) = llm.chat(_conversation(["a"]), params, use_tqdm=False)
    image_offset = first.prompt_token_ids.index(IMAGE_TOKEN)
    image_end = len(first.prompt_token_ids) - first.prompt_token_ids[::-1].index(IMAGE_TOKEN)
    block = 8

    # Same text, another image of the same size: only the blocks before the image are reused.
    (other,) = llm.chat(_conversation(["c"]), params, use_tqdm=False)
    assert other.prompt_token_ids == first.prompt_token_ids  # identical placeholder tokens
    assert 0 < other.num_cached_tokens <= image_offset // block * block
    assert other.outputs[0].token_ids != first.outputs[0].token_ids

    # The identical request again: its image blocks are hits, the encoder does not run.
    encoded = runner.num_encoded
    queries, hits = core.kv_cache_manager.prefix_cache_stats
    (again,) = llm.chat(_conversation(["a"]), params, use_tqdm=False)
    assert again.num_cached_tokens >= image_end // block * block > image_offset
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert runner.num_encoded == encoded
    queries2, hits2 = core.kv_cache_manager.prefix_cache_stats
    assert hits2 - hits == again.num_cached_tokens and queries2 > queries


def test_prefix_hit_ending_inside_an_image_matches_transformers(tiny_vl, default_llm):
    """A cached prefix that stops mid-image: the encoder runs, only the image's tail is used."""
    path, hf_model = tiny_vl
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    # a's 6 tokens sit at 15..20: with 8-token blocks the shared prefix ends at 16
    default_llm.chat(_conversation(["a"]), params, use_tqdm=False)  # caches a's blocks
    (out,) = default_llm.chat(_conversation(["a"], "Name the colours."), params, use_tqdm=False)
    ids = out.prompt_token_ids
    offset = ids.index(IMAGE_TOKEN)
    end = len(ids) - ids[::-1].index(IMAGE_TOKEN)
    assert offset < out.num_cached_tokens < end  # the hit covers part of the image only
    with torch.no_grad():
        ref = hf_model.generate(
            **_hf_forward_kwargs(ids, ["a"]), max_new_tokens=MAX_NEW, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    assert out.outputs[0].token_ids == ref[0, len(ids) :].tolist()


def test_engine_rejects_bad_image_requests(default_llm):
    llm = default_llm  # limit_mm_per_prompt={"image": 2}
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        llm.chat(_conversation(["a", "b", "c"]), params, use_tqdm=False)
    broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    bad = [{"role": "user", "content": [broken]}]
    with pytest.raises(ValueError, match="image 0: .*not an image"):
        llm.chat(bad, params, use_tqdm=False)
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": IMAGES["a"]}})
    # The server path (no local paths) refuses files; the offline API reads them.
    processor = llm.llm_engine.input_processor
    local = [{"role": "user", "content": [{"type": "image", "path": "/etc/hostname"}]}]
    with pytest.raises(ValueError, match="offline API"):
        processor.process_chat(local)
    assert not llm.llm_engine.has_unfinished_requests()
    (ok,) = llm.chat(_conversation(["a"]), params, use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == 2


def test_encoder_memory_profile_is_bounded_by_context(tiny_vl, default_llm):
    from pagoda.multimodal.image_processor import ImageProcessorConfig
    from pagoda.worker.encoder_runner import EncoderRunner

    vision_config = tiny_vl[1].config.vision_config
    image_config = ImageProcessorConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)

    def grids(limit: int, max_model_len: int) -> list[tuple[int, int, int]]:
        mm = MultiModalConfig(limit_per_prompt=limit, video_limit_per_prompt=0)
        runner = EncoderRunner(None, image_config, mm, max_model_len, "cpu", torch.float32)
        return runner.profile_grids()

    # the largest image under max_pixels (64 tokens: 16x16 patches), as many as allowed
    assert grids(3, 1024) == [(1, 16, 16)] * 3
    assert grids(3, 150) == [(1, 16, 16)] * 2  # three would not fit in the context
    # 64 tokens > 39 usable: one square image of 36 tokens (12x12 patches)
    assert grids(3, 40) == [(1, 12, 12)]
    # the engine profiled with its own bounds (limit 2, max_model_len 512)
    runner = default_llm.llm_engine.core.runner.encoder_runner
    inputs = runner.profile_inputs()
    assert inputs[:2] == [("image", (1, 16, 16))] * 2
    # then one video (the default video limit) filling the rest of the 511 usable tokens
    assert [kind for kind, _ in inputs[2:]] == ["video"]
    assert sum(t * h * w // 4 for _, (t, h, w) in inputs) <= 511
    assert runner.estimate_bytes(vision_config) > 0


def test_server_chat_accepts_image_url_parts(tiny_vl, hf_reference):
    """The OpenAI endpoint: data URLs work; remote URLs (off by default) and paths are 400s."""
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from pagoda.engine.args import EngineArgs
    from pagoda.engine.engine_process import start_engine
    from pagoda.entrypoints.openai.server import build_app

    path, _ = tiny_vl
    args = EngineArgs(model=str(path), dtype="float32", device="cpu", max_model_len=512)
    engine = start_engine(args)
    try:
        with TestClient(build_app(engine, "vl")) as client:
            messages = _conversation(["a"])
            body = {"model": "vl", "messages": messages, "max_tokens": MAX_NEW, "temperature": 0}
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            tokenizer = _tokenizer()
            expected = tokenizer.decode(hf_reference["one_image"][1], skip_special_tokens=True)
            assert response.json()["choices"][0]["message"]["content"] == expected
            for url, message in [
                ("https://example.com/cat.png", "remote images is disabled"),
                ("/etc/hostname", "offline API"),
            ]:
                messages[0]["content"][0]["image_url"]["url"] = url
                response = client.post("/v1/chat/completions", json=body)
                assert response.status_code == 400 and message in response.text
    finally:
        engine.shutdown()


@pytest.mark.gpu
def test_gpu_cuda_graphs_match_eager_and_transformers(tiny_vl, hf_reference):
    """Decode steps of VL requests replay CUDA graphs with text positions + delta."""
    path, _ = tiny_vl
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    conversations = [_conversation(keys) for keys in CASES.values()]
    results = {}
    for eager in (False, True):
        llm = _llm(path, device="cuda", enforce_eager=eager, gpu_memory_utilization=0.3)
        assert (llm.llm_engine.core.runner.graph_runner is None) == eager
        results[eager] = [o.outputs[0].token_ids for o in llm.chat(conversations, params)]
        del llm
        torch.cuda.empty_cache()
    assert results[False] == results[True]
    assert results[False] == [tokens for _, tokens, _ in hf_reference.values()]


@pytest.mark.gpu
def test_gpu_bf16_matches_transformers_within_ties(tiny_vl):
    """bf16 on the GPU (Triton kernels, M-RoPE through the fused RoPE kernel, CUDA graphs):
    greedy tokens equal transformers' unless its own top two logits tie within bf16 rounding."""
    path, _ = tiny_vl
    _, model_cls = _hf_classes("qwen2_5_vl")
    hf = model_cls.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    processor = _input_processor(path, hf.config)
    conversations = [_conversation(keys) for keys in CASES.values()]
    refs = []
    for conv, keys in zip(conversations, CASES.values(), strict=True):
        ids = processor.process_chat(conv).prompt_token_ids
        kwargs = {k: v.cuda() for k, v in _hf_forward_kwargs(ids, keys).items()}
        if "pixel_values" in kwargs:
            kwargs["pixel_values"] = kwargs["pixel_values"].to(torch.bfloat16)
        with torch.no_grad():
            out = hf.generate(
                **kwargs, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                pad_token_id=0, output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        refs.append((out.sequences[0, len(ids) :].tolist(), [s[0].float() for s in out.logits]))
    del hf
    torch.cuda.empty_cache()
    llm = _llm(path, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3,
               max_num_batched_tokens=16)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.chat(conversations, params, use_tqdm=False)]
    for i, (g, (r, logits)) in enumerate(zip(got, refs, strict=True)):
        if g == r:
            continue
        k = next(j for j in range(len(r)) if g[j] != r[j])
        gap = (logits[k][r[k]] - logits[k][g[k]]).item()
        assert gap <= 2**-7 * abs(logits[k][r[k]].item()) + 1e-3, (i, k, gap, g, r)
