"""Qwen3-VL with videos against transformers' Qwen3VLForConditionalGeneration (tiny, random).

A Qwen3-VL video is written as its temporal patches, each after a "<t seconds>" timestamp and
between vision start / end tokens; the prompt must be what the model's original processor
builds (its timestamp rule is transformers' `_calculate_timestamps`). Reference pixel values are
cut by transformers' own Qwen3-VL video `patchify` (its video processor needs torchvision);
DeepStack features reach the video tokens inside transformers' forward, so logits and greedy
tokens compare the whole path.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams
from tests.models.test_qwen2_5_vl import IMAGE_TOKEN, IMAGES, _data_url, _tokenizer
from tests.models.test_qwen2_5_vl_video import _llm as _video_llm
from tests.models.test_qwen3_vl import _hf_inputs, save_tiny_qwen3_vl
from tests.multimodal.test_video_inputs import _encode_lossless

VIDEO_TOKEN, VISION_START, VISION_END = 151656, 151652, 151653
MAX_NEW = 8
QUESTION = "What happens in the video?"
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _frames(t: int, h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


# Frame sizes are multiples of 32 inside the pixel bounds, so frames keep their size.
VIDEOS = {"v1": _frames(4, 64, 96, 10), "v2": _frames(6, 96, 64, 11)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_vl_video")
    hf = save_tiny_qwen3_vl(path)
    (path / "video_preprocessor_config.json").write_text(
        json.dumps(
            {
                "video_processor_type": "Qwen3VLVideoProcessor",
                "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 96},
            }
        )
    )
    return path, hf


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return _llm(tiny[0])


def _llm(path: Path, **kwargs) -> LLM:
    return _video_llm(path, **{"limit_mm_per_prompt": {"image": 1, "video": 2}, **kwargs})


def _conversation(image_keys: list[str], videos: list, question: str = QUESTION) -> list[dict]:
    parts: list[dict] = [
        {"type": "image_url", "image_url": {"url": _data_url(IMAGES[k])}} for k in image_keys
    ]
    parts += [{"type": "video", "video": v} for v in videos]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def _video_patches(frames: np.ndarray) -> torch.Tensor:
    """transformers' Qwen3-VL video `patchify` over normalized frames (mean = std = 0.5)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    x = ((frames.astype(np.float64) / 255).astype(np.float32) - 0.5) / 0.5  # [T, h, w, 3]
    x = torch.from_numpy(x).permute(0, 3, 1, 2)[None].contiguous()  # [1, T, C, h, w]
    patches, *_ = Qwen3VLVideoProcessor.patchify(
        None, x, patch_size=16, merge_size=2, temporal_patch_size=2
    )
    return patches[0]


def _hf_kwargs(ids: list[int], image_keys: list[str], videos: list[np.ndarray]) -> dict:
    kwargs = _hf_inputs(ids, image_keys)
    if videos:
        kwargs["pixel_values_videos"] = torch.cat([_video_patches(v) for v in videos])
        kwargs["video_grid_thw"] = torch.tensor(
            [[v.shape[0] // 2, v.shape[1] // 16, v.shape[2] // 16] for v in videos]
        )
    kwargs["mm_token_type_ids"] += 2 * (kwargs["input_ids"] == VIDEO_TOKEN).int()
    return kwargs


def _hf_generate(hf, ids, image_keys, videos) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            **_hf_kwargs(ids, image_keys, videos), max_new_tokens=MAX_NEW, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def _original_prompt(image_keys, videos, frame_indices, video_fps) -> list[int]:
    """The original Qwen3-VL processor's text: the template's <|vision_start|><|video_pad|>
    <|vision_end|> replaced by each temporal patch's timestamp and tokens, image pads by the
    image's tokens (transformers' image processor), then tokenized."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    tokenizer = _tokenizer()
    conv = _conversation(image_keys, videos)
    text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    if image_keys:
        for t, h, w in _hf_inputs([], image_keys)["image_grid_thw"].tolist():
            text = text.replace("<|image_pad|>", "<|placeholder|>" * (t * h * w // 4), 1)
        text = text.replace("<|placeholder|>", "<|image_pad|>")
    for frames, indices in zip(videos, frame_indices, strict=True):
        times = Qwen3VLProcessor._calculate_timestamps(None, indices, video_fps, 2)
        per_patch = frames.shape[1] // 32 * frames.shape[2] // 32
        block = "".join(
            f"<{t:.1f} seconds><|vision_start|>" + "<|video_pad|>" * per_patch + "<|vision_end|>"
            for t in times
        )
        text = text.replace("<|vision_start|><|video_pad|><|vision_end|>", block, 1)
    return tokenizer(text)["input_ids"]


def test_prompt_and_positions_are_the_original_processors(tiny, llm):
    """Timestamps, vision start / end per temporal patch, and M-RoPE positions (each temporal
    patch a (1, h, w) block; transformers' get_rope_index splits the grid the same way)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    _, hf = tiny
    videos = [VIDEOS["v1"], VIDEOS["v2"]]
    conv = _conversation(["a"], videos)
    processed = llm.llm_engine.input_processor.process_chat(conv)
    ids = processed.prompt_token_ids
    # given frames are taken at the sampling rate (fps=2): frame i at i / 2 seconds
    assert ids == _original_prompt(["a"], videos, [list(range(4)), list(range(6))], 2.0)
    text = _tokenizer().decode(ids)
    assert "<0.2 seconds><|vision_start|>" in text and "<2.2 seconds><|vision_start|>" in text
    assert ids.count(VIDEO_TOKEN) == 2 * 6 + 3 * 6
    kwargs = _hf_kwargs(ids, ["a"], videos)
    ref, delta = Qwen3VLModel.get_rope_index(
        hf.model, kwargs["input_ids"], kwargs["mm_token_type_ids"], kwargs["image_grid_thw"],
        kwargs["video_grid_thw"],
    )  # fmt: skip
    mm = processed.mm_inputs
    assert np.array_equal(mm.mrope_positions, ref[:, 0].numpy())
    assert mm.mrope_delta == int(delta)
    assert [item.grid_thw for item in mm.items] == [(1, 6, 4)] + [(1, 4, 6)] * 2 + [(1, 6, 4)] * 3


def test_logits_match_transformers(tiny, llm):
    """Image + video: pagoda's model (DeepStack on the video tokens) against transformers'."""
    from pagoda.worker.encoder_runner import patchify

    _, hf = tiny
    conv = _conversation(["a"], [VIDEOS["v1"]])
    processed = llm.llm_engine.input_processor.process_chat(conv)
    ids, mm = processed.prompt_token_ids, processed.mm_inputs
    model = llm.llm_engine.core.runner.model
    image_config = llm.llm_engine.input_processor.mm_processor.image_config
    kwargs = _hf_kwargs(ids, ["a"], [VIDEOS["v1"]])
    with torch.no_grad():
        ref = hf(**kwargs).logits[0]
        ids_t = torch.tensor(ids)
        embeds = model.embed_input_ids(ids_t)
        pv = torch.cat(
            [patchify(torch.from_numpy(i.pixels), image_config, torch.float32) for i in mm.items]
        )
        assert torch.equal(pv[-12 * 4 :], kwargs["pixel_values_videos"])
        vision = (ids_t == IMAGE_TOKEN) | (ids_t == VIDEO_TOKEN)
        embeds[vision] = model.embed_images(pv, [i.grid_thw for i in mm.items])
        positions = torch.from_numpy(mm.mrope_positions)
        ours = model.compute_logits(model(None, positions, None, inputs_embeds=embeds))
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_greedy_matches_transformers(tiny, llm):
    """One video, and an image with two videos; then a prefix-cache hit."""
    _, hf = tiny
    cases = [([], [VIDEOS["v1"]]), (["a"], [VIDEOS["v1"], VIDEOS["v2"]])]
    outs = llm.chat([_conversation(i, v) for i, v in cases], GREEDY, use_tqdm=False)
    expected = []
    for out, (image_keys, videos) in zip(outs, cases, strict=True):
        expected.append(_hf_generate(hf, out.prompt_token_ids, image_keys, videos))
        assert out.outputs[0].token_ids == expected[-1]
    runner = llm.llm_engine.core.runner.encoder_runner
    encoded = runner.num_encoded
    (again,) = llm.chat(_conversation(*cases[0]), GREEDY, use_tqdm=False)
    assert again.outputs[0].token_ids == expected[0]
    assert again.num_cached_tokens >= 16 and runner.num_encoded == encoded


def test_chunked_prefill_splitting_the_video_patches(tiny):
    path, hf = tiny
    chunked = _llm(path, max_num_batched_tokens=8)
    (out,) = chunked.chat(_conversation([], [VIDEOS["v2"]]), GREEDY, use_tqdm=False)
    chunked.shutdown()
    assert out.outputs[0].token_ids == _hf_generate(hf, out.prompt_token_ids, [], [VIDEOS["v2"]])


def test_encoded_video_timestamps_follow_the_container(tiny, llm):
    """A decoded file: frames sampled at 2 fps from a 20 fps clip; timestamps are the kept
    frames' times in the clip (indices / 20), and tokens equal transformers'."""
    _, hf = tiny
    clip = _frames(40, 64, 96, 13)  # 2 s at 20 fps -> 4 frames (min_frames): 0, 13, 26, 39
    url = "data:video/quicktime;base64," + base64.b64encode(_encode_lossless(clip, 20)).decode()
    parts = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    conv = [{"role": "user", "content": parts}]
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False)
    indices = [0, 13, 26, 39]
    sampled = clip[indices]
    expected = _original_prompt([], [sampled], [indices], 20.0)
    assert out.prompt_token_ids == expected
    text = _tokenizer().decode(out.prompt_token_ids)
    assert "<0.3 seconds>" in text and "<1.6 seconds>" in text
    assert out.outputs[0].token_ids == _hf_generate(hf, out.prompt_token_ids, [], [sampled])


def test_generate_with_video_data_and_clear_errors(tiny, llm):
    """multi_modal_data={"video": frames} with the template's placeholder or a bare video
    token gives the chat path's prompt; a pre-expanded placeholder is refused clearly."""
    conv = _conversation([], [VIDEOS["v1"]])
    (chat,) = llm.chat(conv, GREEDY, use_tqdm=False)
    head = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    tail = f"{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    data = {"video": VIDEOS["v1"]}
    for mark in ("<|vision_start|><|video_pad|><|vision_end|>", "<|video_pad|>"):
        prompt = {"prompt": head + mark + tail, "multi_modal_data": data}
        (out,) = llm.generate(prompt, GREEDY, use_tqdm=False)
        assert out.prompt_token_ids == chat.prompt_token_ids
        assert out.outputs[0].token_ids == chat.outputs[0].token_ids
    expanded = head + "<|vision_start|>" + "<|video_pad|>" * 12 + "<|vision_end|>" + tail
    with pytest.raises(ValueError, match=r"video 0: its placeholder is 12 tokens long"):
        llm.generate({"prompt": expanded, "multi_modal_data": data}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"3 videos.*limit_mm_per_prompt=\{'video': 3\}"):
        llm.chat(_conversation([], [VIDEOS["v1"]] * 3), GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    # too long: the count includes the timestamps and each patch's start / end tokens
    from pagoda.config import MultiModalConfig
    from pagoda.multimodal.processor import MultiModalProcessor

    tokenizer = _tokenizer()
    short = MultiModalProcessor.from_model(
        str(tiny[0]), tiny[1].config, tokenizer, MultiModalConfig(), max_model_len=20
    )
    stamps = sum(len(tokenizer.encode(f"<{t} seconds>")) for t in ("0.2", "1.2"))
    with pytest.raises(ValueError, match=rf"the video needs {12 + 4 + stamps} tokens \(4 frames"):
        short.process([VIDEO_TOKEN], [], videos=[VIDEOS["v1"]])


@pytest.mark.gpu
def test_gpu_4b_shape_video_matches_transformers_within_ties(tmp_path):
    """Qwen3-VL-4B's shape (benchmarks/configs/qwen3-vl-4b.json, random bf16 weights), a
    16-frame 640x360 video through the engine on CUDA (Triton kernels, CUDA graphs): greedy
    tokens equal transformers' unless its own top two logits tie within bf16 rounding."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from tests.models.test_qwen3_vl import _input_processor

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "config.json").write_text(
        (root / "benchmarks" / "configs" / "qwen3-vl-4b.json").read_text()
    )
    config = Qwen3VLConfig.from_pretrained(tmp_path)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = Qwen3VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16).eval()
    hf.save_pretrained(tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    conv = _conversation([], [_frames(16, 360, 640, 21)])
    processed = _input_processor(tmp_path, hf.config).process_chat(conv)
    ids, mm = processed.prompt_token_ids, processed.mm_inputs
    frames = np.concatenate([item.pixels for item in mm.items])  # as pagoda resized them
    kwargs = {k: v.cuda() for k, v in _hf_kwargs(ids, [], [frames]).items()}
    kwargs["pixel_values_videos"] = kwargs["pixel_values_videos"].to(torch.bfloat16)
    with torch.no_grad():
        out = hf.generate(
            **kwargs, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
            pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    ref, logits = out.sequences[0, len(ids) :].tolist(), [s[0].float() for s in out.logits]
    del hf, out
    torch.cuda.empty_cache()
    llm = _llm(tmp_path, device="cuda", dtype="bfloat16", max_model_len=4096,
               gpu_memory_utilization=0.5)  # fmt: skip
    (got,) = llm.chat(conv, GREEDY, use_tqdm=False)
    assert got.prompt_token_ids == ids and ids.count(VIDEO_TOKEN) == 8 * 11 * 20
    tokens = got.outputs[0].token_ids
    if tokens != ref:
        k = next(j for j in range(len(ref)) if tokens[j] != ref[j])
        gap = (logits[k][ref[k]] - logits[k][tokens[k]]).item()
        assert gap <= 2**-7 * abs(logits[k][ref[k]].item()) + 1e-3, (k, gap, tokens, ref)
