"""Qwen2.5-VL (and Qwen2-VL) with videos against transformers on tiny random models.

Reference inputs are built without torchvision (which transformers' video processor needs):
frame patches are cut in NumPy the way its Qwen2-VL video processor does, and fed to
transformers' model with `mm_token_type_ids`. Where transformers 5's own M-RoPE positions
agree with the model release's (a video with no more time steps than rows or columns), its
`generate` is the oracle; where they differ, transformers' model runs greedily with the
release's positions (`original_rope_index`), which pagoda must follow.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pagoda import LLM, SamplingParams
from tests.models.test_qwen2_5_vl import (
    IMAGE_TOKEN,
    IMAGES,
    TEXT_CONFIG,
    VISION_CONFIGS,
    _data_url,
    _hf_classes,
    _hf_pixel_inputs,
    _tokenizer,
)
from tests.multimodal.test_video_inputs import _encode_lossless, original_rope_index

VIDEO_TOKEN = 151656
MAX_NEW = 8
VIDEO_MIN, VIDEO_MAX = 28 * 28 * 4, 28 * 28 * 16
MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)


def _frames(t: int, h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


# V1: 2 time steps (positions 0, 2) over 2x3 merged tokens: transformers 5 agrees.
# V2: 4 time steps (0, 2, 4, 6) over 2x2: the text after it differs.
VIDEOS = {
    "v1": _frames(4, 56, 84, 10),
    "v2": _frames(8, 56, 56, 11),
    "v3": _frames(6, 120, 200, 12),
}


def save_tiny_vl_video(path: Path, model_type: str = "qwen2_5_vl", seed: int = 0):
    config_cls, model_cls = _hf_classes(model_type)
    vision = dict(VISION_CONFIGS[model_type])
    if model_type == "qwen2_5_vl":
        vision["tokens_per_second"] = 2  # the released checkpoints' value
    config = config_cls(
        text_config=TEXT_CONFIG,
        vision_config=vision,
        tie_word_embeddings=True,
        architectures=[model_cls.__name__],
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    (path / "preprocessor_config.json").write_text(
        json.dumps({"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 64, "merge_size": 2})
    )
    (path / "video_preprocessor_config.json").write_text(
        json.dumps({"size": {"shortest_edge": VIDEO_MIN, "longest_edge": VIDEO_MAX}})
    )
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl_video")
    return path, save_tiny_vl_video(path)


def _video_patches(frames: np.ndarray) -> np.ndarray:
    """transformers' Qwen2-VL video processor layout, in NumPy (no torchvision)."""
    x = ((frames.astype(np.float64) / 255).astype(np.float32) - MEAN) / STD  # [T, h, w, 3]
    x = x.transpose(0, 3, 1, 2)[None]  # [1, T, C, h, w]
    _, t, c, h, w = x.shape
    gt, gh, gw = t // 2, h // 14, w // 14
    x = x.reshape(1, gt, 2, c, gh // 2, 2, 14, gw // 2, 2, 14)
    x = x.transpose(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return np.ascontiguousarray(x).reshape(gt * gh * gw, c * 2 * 14 * 14)


def _resized(frames: np.ndarray, h: int, w: int) -> np.ndarray:
    return np.stack(
        [np.asarray(Image.fromarray(f).resize((w, h), Image.Resampling.BICUBIC)) for f in frames]
    )


def _hf_kwargs(ids, image_keys, videos, fps=2.0):
    """transformers inputs for a prompt (`videos`: frames already at their model size)."""
    input_ids = torch.tensor([ids])
    kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    kwargs.update(_hf_pixel_inputs(image_keys))
    if videos:
        kwargs["pixel_values_videos"] = torch.from_numpy(
            np.concatenate([_video_patches(v) for v in videos])
        )
        kwargs["video_grid_thw"] = torch.tensor(
            [[v.shape[0] // 2, v.shape[1] // 14, v.shape[2] // 14] for v in videos]
        )
        kwargs["second_per_grid_ts"] = torch.tensor([2 / fps] * len(videos))
    kwargs["mm_token_type_ids"] = (input_ids == IMAGE_TOKEN).int() + 2 * (
        input_ids == VIDEO_TOKEN
    ).int()
    return kwargs


def _hf_generate(model, ids, image_keys, videos, fps=2.0) -> list[int]:
    kwargs = _hf_kwargs(ids, image_keys, videos, fps)
    if model.config.model_type == "qwen2_vl":  # no frame timing in Qwen2-VL
        kwargs.pop("second_per_grid_ts", None)
    with torch.no_grad():
        out = model.generate(
            **kwargs, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(ids) :].tolist()


def _hf_greedy_release_positions(model, ids, image_keys, videos, fps=2.0) -> list[int]:
    """transformers' model, greedy, with the release's M-RoPE positions given explicitly."""
    grids = lambda vs: [(v.shape[0] // 2, v.shape[1] // 14, v.shape[2] // 14) for v in vs]  # noqa: E731
    image_grids = [tuple(g) for g in _hf_pixel_inputs(image_keys).get("image_grid_thw", [])]
    image_grids = [tuple(int(x) for x in g) for g in image_grids]
    positions, _ = original_rope_index(ids, image_grids, grids(videos), [2 / fps] * len(videos), 2)
    tokens = list(ids)
    generated: list[int] = []
    for _ in range(MAX_NEW):
        kwargs = _hf_kwargs(tokens, image_keys, videos, fps)
        nxt = positions.max() + 1 + np.arange(len(tokens) - len(ids))
        pos = np.concatenate([positions, np.broadcast_to(nxt, (3, len(nxt)))], axis=1)
        kwargs["position_ids"] = torch.from_numpy(pos)[:, None, :]
        with torch.no_grad():
            logits = model(**kwargs).logits[0, -1]
        generated.append(int(logits.argmax()))
        tokens.append(generated[-1])
    return generated


QUESTION = "What happens in the video?"


def _conversation(image_keys: list[str], video_keys: list[str], question: str = QUESTION):
    parts: list[dict] = [
        {"type": "image_url", "image_url": {"url": _data_url(IMAGES[k])}} for k in image_keys
    ]
    parts += [{"type": "video", "video": VIDEOS[k]} for k in video_keys]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def _llm(path: Path, **kwargs) -> LLM:
    options = dict(
        dtype="float32", device="cpu", max_model_len=512, block_size=8,
        limit_mm_per_prompt={"image": 2, "video": 1}, print_memory_report=False,
    )  # fmt: skip
    options.update(kwargs)
    return LLM(str(path), **options)


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return _llm(tiny[0])


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def test_one_video_matches_transformers_generate(tiny, llm):
    """A short video: transformers 5's positions equal the release's; its generate is the
    oracle (chat path, a prefix-cache hit, and chunked prefill splitting the video)."""
    _, hf = tiny
    (out,) = llm.chat(_conversation([], ["v1"]), GREEDY, use_tqdm=False)
    ids = out.prompt_token_ids
    assert ids.count(VIDEO_TOKEN) == 12
    expected = _hf_generate(hf, ids, [], [VIDEOS["v1"]])
    assert out.outputs[0].token_ids == expected
    runner = llm.llm_engine.core.runner.encoder_runner
    encoded = runner.num_encoded
    (again,) = llm.chat(_conversation([], ["v1"]), GREEDY, use_tqdm=False)
    assert again.outputs[0].token_ids == expected
    end = len(ids) - ids[::-1].index(VIDEO_TOKEN)
    assert again.num_cached_tokens >= end // 8 * 8 > ids.index(VIDEO_TOKEN)
    assert runner.num_encoded == encoded  # the video's blocks were cache hits
    chunked = _llm(tiny[0], max_num_batched_tokens=8)
    (split,) = chunked.chat(_conversation([], ["v1"]), GREEDY, use_tqdm=False)
    assert split.outputs[0].token_ids == expected
    chunked.shutdown()


def test_long_video_follows_the_release_positions(tiny, llm):
    """More time steps than rows: pagoda follows the release's get_rope_index, so its tokens
    equal transformers' model run with those positions (not transformers 5's own)."""
    _, hf = tiny
    (out,) = llm.chat(_conversation([], ["v2"]), GREEDY, use_tqdm=False)
    ids = out.prompt_token_ids
    mm = llm.llm_engine.input_processor.process_chat(_conversation([], ["v2"])).mm_inputs
    release, delta = original_rope_index(ids, [], [(4, 4, 4)], [1.0], 2)
    assert np.array_equal(mm.mrope_positions, release) and mm.mrope_delta == delta
    assert out.outputs[0].token_ids == _hf_greedy_release_positions(hf, ids, [], [VIDEOS["v2"]])
    # transformers 5 places the text after the video elsewhere (both sides of the difference)
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    kwargs = _hf_kwargs(ids, [], [VIDEOS["v2"]])
    tf5, _ = Qwen2_5_VLModel.get_rope_index(
        hf.model, kwargs["input_ids"], kwargs["mm_token_type_ids"], None,
        kwargs["video_grid_thw"], kwargs["second_per_grid_ts"],
    )  # fmt: skip
    end = len(ids) - ids[::-1].index(VIDEO_TOKEN)
    assert tf5[0, 0, end] < release[0, end]


def test_two_images_and_a_video_in_one_prompt(tiny, llm):
    _, hf = tiny
    conv = _conversation(["a", "b"], ["v1"], "Compare the pictures with the video.")
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False)
    ids = out.prompt_token_ids
    assert ids.count(IMAGE_TOKEN) == 6 + 8 and ids.count(VIDEO_TOKEN) == 12
    assert out.outputs[0].token_ids == _hf_generate(hf, ids, ["a", "b"], [VIDEOS["v1"]])


def test_fps_and_max_pixels_options(tiny):
    """mm_processor_kwargs fps=1 (each temporal patch spans 2 s: time steps of 4) and a
    max_pixels that shrinks the frames."""
    path, hf = tiny
    max_pixels = 28 * 28 * 8
    llm = _llm(path, mm_processor_kwargs={"fps": 1.0, "max_pixels": max_pixels})
    (out,) = llm.chat(_conversation([], ["v3"]), GREEDY, use_tqdm=False)
    ids = out.prompt_token_ids
    from pagoda.multimodal.image_processor import smart_resize

    h, w = smart_resize(120, 200, 28, VIDEO_MIN, max_pixels)
    frames = _resized(VIDEOS["v3"], h, w)
    assert ids.count(VIDEO_TOKEN) == 3 * (h // 28) * (w // 28)
    expected = _hf_greedy_release_positions(hf, ids, [], [frames], fps=1.0)
    assert out.outputs[0].token_ids == expected
    llm.shutdown()


def test_generate_with_video_data_and_encoded_files(tiny, llm, tmp_path):
    """multi_modal_data={"video": frames | path}, and video_url data URLs (needs PyAV)."""
    _, hf = tiny
    (chat,) = llm.chat(_conversation([], ["v1"]), GREEDY, use_tqdm=False)
    prompt = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        f"<|vision_start|><|video_pad|><|vision_end|>{QUESTION}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    (out,) = llm.generate(
        {"prompt": prompt, "multi_modal_data": {"video": VIDEOS["v1"]}}, GREEDY, use_tqdm=False
    )
    assert out.prompt_token_ids == chat.prompt_token_ids
    assert out.outputs[0].token_ids == chat.outputs[0].token_ids
    # 40 frames at 20 fps: 2 s, sampled at 2 fps -> 4 frames (the min_frames bound)
    clip = _frames(40, 56, 84, 13)
    data = _encode_lossless(clip, fps=20)
    path = tmp_path / "clip.mov"
    path.write_bytes(data)
    sampled = clip[np.round(np.linspace(0, 39, 4)).astype(int)]
    (from_file,) = llm.generate(
        {"prompt": prompt, "multi_modal_data": {"video": str(path)}}, GREEDY, use_tqdm=False
    )
    url = "data:video/quicktime;base64," + base64.b64encode(data).decode()
    parts = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    conv = [{"role": "user", "content": parts}]
    (from_url,) = llm.chat(conv, GREEDY, use_tqdm=False)
    # 4 frames over 2 s: sampled at 2 fps, second_per_grid 1
    expected = _hf_generate(hf, from_file.prompt_token_ids, [], [sampled])
    assert from_file.outputs[0].token_ids == expected
    assert from_url.outputs[0].token_ids == expected


def test_video_errors_are_clear(tiny, llm):
    with pytest.raises(ValueError, match=r"2 videos.*limit_mm_per_prompt=\{'video': 2\}"):
        llm.chat(_conversation([], ["v1", "v2"]), GREEDY, use_tqdm=False)
    short = _llm(tiny[0], max_model_len=40)
    with pytest.raises(ValueError, match=r"the video needs 16 tokens .*max_model_len is 40"):
        short.chat(_conversation([], ["v2"]), GREEDY, use_tqdm=False)
    short.shutdown()
    broken = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAAAAAA"}}
    with pytest.raises(ValueError, match="video 0: "):
        llm.chat([{"role": "user", "content": [broken]}], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_qwen2_vl_video_matches_transformers(tmp_path):
    """Qwen2-VL: temporal positions count temporal patches (no tokens_per_second)."""
    hf = save_tiny_vl_video(tmp_path, "qwen2_vl")
    llm = _llm(tmp_path)
    (out,) = llm.chat(_conversation([], ["v1"]), GREEDY, use_tqdm=False)
    ids = out.prompt_token_ids
    assert out.outputs[0].token_ids == _hf_generate(hf, ids, [], [VIDEOS["v1"]])
    llm.shutdown()


def test_encoder_profile_takes_the_largest_allowed_video(tiny, llm):
    from pagoda.config import MultiModalConfig
    from pagoda.multimodal.image_processor import ImageProcessorConfig
    from pagoda.multimodal.video_processor import VideoOptions
    from pagoda.worker.encoder_runner import EncoderRunner

    images = ImageProcessorConfig(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    video = VideoOptions(min_pixels=VIDEO_MIN, max_pixels=VIDEO_MAX, max_frames=8)

    def grids(limits, max_model_len):
        mm = MultiModalConfig.from_user(limits, None)
        runner = EncoderRunner(None, images, mm, max_model_len, "cpu", torch.float32, video)
        return runner.profile_grids()

    # one image of 64 tokens, then a video of 8 frames at 16 tokens a frame pair: 64 tokens
    assert grids({"image": 1, "video": 1}, 1024) == [(1, 16, 16), (4, 8, 8)]
    # 35 tokens left after the image: 4 frames of 4x4 merged tokens (32) fit best
    small = grids({"image": 1, "video": 1}, 100)
    assert small == [(1, 16, 16), (2, 8, 8)]
    assert grids({"image": 0, "video": 2}, 1024) == [(4, 8, 8)] * 2
    report = llm.llm_engine.core.runner.memory_report
    assert report.encoder_weights_bytes > 0 and report.encoder_activation_bytes > 0
    assert "video" in report.encoder_profile_input and "vision encoder" in str(report)


def test_server_accepts_video_url_parts(tiny, llm):
    """The OpenAI endpoint: a video_url data URL works; a local path or garbage is a 400."""
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from pagoda.engine.args import EngineArgs
    from pagoda.engine.engine_process import start_engine
    from pagoda.entrypoints.openai.server import build_app

    clip = _frames(40, 56, 84, 13)
    url = "data:video/quicktime;base64," + base64.b64encode(_encode_lossless(clip, 20)).decode()
    parts = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    messages = [{"role": "user", "content": parts}]
    (expected,) = llm.chat(messages, GREEDY, use_tqdm=False)
    args = EngineArgs(model=str(tiny[0]), dtype="float32", device="cpu", max_model_len=512)
    engine = start_engine(args)
    try:
        with TestClient(build_app(engine, "vl")) as client:
            body = {"model": "vl", "messages": messages, "max_tokens": MAX_NEW, "temperature": 0}
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            text = _tokenizer().decode(expected.outputs[0].token_ids, skip_special_tokens=True)
            assert response.json()["choices"][0]["message"]["content"] == text
            for bad, message in [
                ("/tmp/clip.mp4", "offline API"),
                ("data:video/mp4;base64,AAAAAAAA", "not a readable video"),
            ]:
                parts[0]["video_url"]["url"] = bad
                response = client.post("/v1/chat/completions", json=body)
                assert response.status_code == 400 and message in response.text, response.text
    finally:
        engine.shutdown()
