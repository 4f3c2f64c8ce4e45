"""Video inputs for Qwen2-VL / Qwen2.5-VL, without a model.

Frame sampling and pixel bounds must follow qwen-vl-utils, patches the layout of transformers'
video processor (a 2-frame still video gives an image's patches), M-RoPE positions the original
Qwen2.5-VL `get_rope_index` (time steps of second_per_grid * tokens_per_second, the text after a
video resuming one past the largest position on any axis), and every bad input must fail with a
ValueError that names the problem and the option to change.
"""

from __future__ import annotations

import base64
import io
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from pagoda.config import MultiModalConfig
from pagoda.multimodal.image_processor import (
    ImageProcessorConfig,
    patchify_reference,
    preprocess_image,
)
from pagoda.multimodal.inputs import mrope_positions
from pagoda.multimodal.processor import MultiModalProcessor
from pagoda.multimodal.video_loader import VideoLoader
from pagoda.multimodal.video_processor import (
    VideoOptions,
    frame_bounds,
    patchify_video_reference,
    preprocess_video,
    sample_frame_indices,
)
from pagoda.worker.encoder_runner import patchify

IMAGE, START, END, VIDEO = 151655, 151652, 151653, 151656


def _frames(t: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


def original_rope_index(ids, image_grids, video_grids, second_per_grid_ts, tokens_per_second):
    """The Qwen2.5-VL release's `get_rope_index` (transformers 4.49-4.5x), one sequence.

    Kept here as the oracle: every vision block starts one past the largest position so far (on
    any axis); a video's temporal index is floor(t * second_per_grid * tokens_per_second) in
    float32; `tokens_per_second=None` is Qwen2-VL (temporal index t).
    """
    merge = 2
    ids_t = torch.tensor(ids)
    starts = torch.argwhere(ids_t == START).squeeze(1)
    vision_tokens = ids_t[starts + 1]
    image_nums, video_nums = (vision_tokens == IMAGE).sum(), (vision_tokens == VIDEO).sum()
    tokens = list(ids)
    pos_list: list[torch.Tensor] = []
    st = image_index = video_index = 0
    remain_images, remain_videos = int(image_nums), int(video_nums)
    for _ in range(image_nums + video_nums):
        ed_image = (
            tokens.index(IMAGE, st) if IMAGE in tokens and remain_images > 0 else len(ids) + 1
        )
        ed_video = (
            tokens.index(VIDEO, st) if VIDEO in tokens and remain_videos > 0 else len(ids) + 1
        )
        if ed_image < ed_video:
            t, h, w = image_grids[image_index]
            second_per_grid_t = torch.tensor(0.0)
            image_index += 1
            remain_images -= 1
            ed = ed_image
        else:
            t, h, w = video_grids[video_index]
            second_per_grid_t = torch.tensor(second_per_grid_ts[video_index], dtype=torch.float32)
            video_index += 1
            remain_videos -= 1
            ed = ed_video
        gt, gh, gw = t, h // merge, w // merge
        text_len = ed - st
        st_idx = pos_list[-1].max() + 1 if pos_list else 0
        pos_list.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)
        rng = torch.arange(gt).view(-1, 1).expand(-1, gh * gw)
        if tokens_per_second is None:
            t_index = rng.flatten()
        else:
            t_index = (rng * second_per_grid_t * tokens_per_second).long().flatten()
        h_index = torch.arange(gh).view(1, -1, 1).expand(gt, -1, gw).flatten()
        w_index = torch.arange(gw).view(1, 1, -1).expand(gt, gh, -1).flatten()
        pos_list.append(torch.stack([t_index, h_index, w_index]) + text_len + st_idx)
        st = ed + gt * gh * gw
    if st < len(tokens):
        st_idx = pos_list[-1].max() + 1 if pos_list else 0
        pos_list.append(torch.arange(len(tokens) - st).view(1, -1).expand(3, -1) + st_idx)
    positions = torch.cat(pos_list, dim=1)
    return positions.numpy(), int(positions.max()) + 1 - len(ids)


def _processor(limits=None, max_model_len: int = 4096, kwargs=None, tps=2) -> MultiModalProcessor:
    hf_config = SimpleNamespace(
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
        vision_config=SimpleNamespace(
            patch_size=14, temporal_patch_size=2, spatial_merge_size=2, tokens_per_second=tps
        ),
    )
    mm_config = MultiModalConfig.from_user(limits or {"image": 2, "video": 1}, kwargs)
    return MultiModalProcessor.from_model(None, hf_config, None, mm_config, max_model_len)


SMALL = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16}


# ---------------------------------------------------------------------- sampling and sizes


def test_frame_sampling_follows_qwen_vl_utils():
    opts = VideoOptions()
    # 10 s at 30 fps, 2 frames a second: 20 frames spread from the first to the last
    idx, fps = sample_frame_indices(300, 30.0, opts)
    assert len(idx) == 20 and idx[0] == 0 and idx[-1] == 299 and fps == 2.0
    assert np.array_equal(idx, np.round(np.linspace(0, 299, 20)).astype(int))
    # a short clip: min_frames (4), never more than the clip has
    idx, fps = sample_frame_indices(9, 30.0, opts)
    assert len(idx) == 4 and fps == pytest.approx(4 / 9 * 30)
    assert len(sample_frame_indices(3, 30.0, opts)[0]) == 2  # 3 frames: an even 2
    # max_frames and fps options
    assert len(sample_frame_indices(300, 30.0, VideoOptions(max_frames=7))[0]) == 6
    assert len(sample_frame_indices(300, 30.0, VideoOptions(fps=0.5))[0]) == 4  # min_frames
    assert len(sample_frame_indices(3000, 30.0, VideoOptions(fps=1.0))[0]) == 100
    with pytest.raises(ValueError, match="1 frame"):
        sample_frame_indices(1, 30.0, opts)


def test_frame_bounds_share_total_pixels():
    opts = VideoOptions(total_pixels=28 * 28 * 64)
    lo, hi = frame_bounds(8, opts)
    assert lo == opts.min_pixels
    # 64 tokens' worth of pixels over 4 frame pairs, but never below 1.05 x min_pixels
    assert hi == max(28 * 28 * 64 / 8 * 2, int(opts.min_pixels * 1.05))
    assert frame_bounds(2, VideoOptions())[1] == VideoOptions().max_pixels


def test_video_options_validation(tmp_path):
    with pytest.raises(ValueError, match="fps"):
        VideoOptions(fps=0)
    with pytest.raises(ValueError, match="max_frames"):
        VideoOptions(min_frames=8, max_frames=4)
    (tmp_path / "video_preprocessor_config.json").write_text(
        '{"size": {"shortest_edge": 3136, "longest_edge": 50176}, "fps": 1.0}'
    )
    opts = VideoOptions.from_model(str(tmp_path), {"max_frames": 16})
    assert (opts.min_pixels, opts.max_pixels, opts.fps, opts.max_frames) == (3136, 50176, 1.0, 16)
    # an image bound below the video minimum lowers the minimum with it
    low = VideoOptions.from_model(None, {"max_pixels": 28 * 28 * 30})
    assert low.min_pixels == low.max_pixels == 28 * 28 * 30
    cfg = MultiModalConfig.from_user({"image": 1, "video": 2}, {"fps": 1, "total_pixels": 10**6})
    assert (cfg.limit_per_prompt, cfg.video_limit_per_prompt) == (1, 2)
    with pytest.raises(ValueError, match="unknown key"):
        MultiModalConfig.from_user(None, {"nframes": 2})
    with pytest.raises(ValueError, match="audio"):
        MultiModalConfig.from_user({"audio": 1}, None)


def test_qwen3_vl_video_options_and_timestamps(tmp_path):
    """Qwen3-VL: qwen-vl-utils' token defaults at its 32-pixel merged patches; its processor
    file's `longest_edge` bounds the whole clip; timestamps as its processor computes them."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    from pagoda.multimodal.video_processor import temporal_patch_times

    opts = VideoOptions.from_model(None, {}, factor=32)
    assert (opts.min_pixels, opts.max_pixels) == (128 * 32 * 32, 768 * 32 * 32)
    assert opts.total_pixels == int(128000 * 0.9 * 32 * 32)
    (tmp_path / "video_preprocessor_config.json").write_text(
        '{"video_processor_type": "Qwen3VLVideoProcessor", '
        '"size": {"shortest_edge": 4096, "longest_edge": 25165824}}'
    )
    opts = VideoOptions.from_model(str(tmp_path), {"max_pixels": 32 * 32 * 100}, factor=32)
    assert (opts.min_pixels, opts.max_pixels, opts.total_pixels) == (4096, 102400, 25165824)
    for indices, fps in [([0, 13, 26, 39], 20.0), ([0, 5, 10, 15, 20], 7.5), ([3], 2.0)]:
        expected = Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)
        assert temporal_patch_times(np.asarray(indices) / fps, 2) == pytest.approx(expected)


# ---------------------------------------------------------------------- pixels


def test_still_video_patches_equal_image_patches():
    """Two identical frames are what the image processor makes of a still image (tiling)."""
    config = ImageProcessorConfig()
    frame = _frames(1, 56, 84)[0]
    video = preprocess_video(np.stack([frame, frame]), 2.0, VideoOptions(**SMALL), config)
    image = preprocess_image(Image.fromarray(frame), config)
    assert video.grid_thw == image.grid_thw == (1, 4, 6)
    assert np.array_equal(patchify_video_reference(video.pixels, config),
                          patchify_reference(image.pixels, config))  # fmt: skip


def test_video_patch_layout_and_device_patchify():
    config = ImageProcessorConfig()
    frames = _frames(5, 56, 84)  # odd: padded with the last frame
    video = preprocess_video(frames, 2.0, VideoOptions(**SMALL), config)
    assert video.pixels.shape == (6, 56, 84, 3) and np.array_equal(video.pixels[5], frames[4])
    assert video.grid_thw == (3, 4, 6) and video.num_tokens == 3 * 6
    assert video.modality == "video" and video.second_per_grid == 1.0
    ref = patchify_video_reference(video.pixels, config)  # [3 * 24, 3 * 2 * 14 * 14]
    # row block g holds frames 2g, 2g+1: channel-major values, frame inside channel
    x = ref.reshape(3, 24, 3, 2, 14, 14)
    first = (frames[2, :14, :14, 0].astype(np.float64) / 255).astype(np.float32)
    first = (first - np.float32(config.image_mean[0])) / np.float32(config.image_std[0])
    assert np.array_equal(x[1, 0, 0, 0], first)
    on_device = patchify(torch.from_numpy(video.pixels), config, torch.float32)
    assert torch.equal(on_device, torch.from_numpy(ref))


def test_video_resize_and_hash():
    config = ImageProcessorConfig()
    frames = _frames(4, 120, 200)
    small = preprocess_video(frames, 2.0, VideoOptions(**SMALL), config)
    assert small.pixels.shape[1] * small.pixels.shape[2] <= SMALL["max_pixels"]
    expected = np.asarray(
        Image.fromarray(frames[1]).resize(small.pixels.shape[2:0:-1], Image.Resampling.BICUBIC)
    )
    assert np.array_equal(small.pixels[1], expected)
    again = preprocess_video(frames.copy(), 2.0, VideoOptions(**SMALL), config)
    assert again.mm_hash == small.mm_hash
    # the same frames at another rate sit at other positions: another cache key
    assert preprocess_video(frames, 1.0, VideoOptions(**SMALL), config).mm_hash != small.mm_hash
    bigger = preprocess_video(
        frames, 2.0, VideoOptions(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 30), config
    )
    assert bigger.mm_hash != small.mm_hash and bigger.num_tokens > small.num_tokens


# ---------------------------------------------------------------------- positions


@pytest.mark.parametrize("tps", [2, None])
def test_video_positions_match_the_original_get_rope_index(tps):
    # image (1, 4, 6), a long video (8 temporal patches of 2x2 merged), a video at 0.5 fps
    grids = [(1, 4, 6), (8, 4, 4), (2, 4, 6)]
    spg = [0.0, 1.0, 4.0]
    ids = [1, START, *[IMAGE] * 6, END, 2, START, *[VIDEO] * 32, END, 3, START, *[VIDEO] * 12,
           END, 4, 5]  # fmt: skip
    placeholders = [(2, 6), (11, 32), (46, 12)]
    scales = [(0.0,)] + [(1.0,) if tps is None else (s, tps) for s in spg[1:]]
    ours, delta = mrope_positions(len(ids), placeholders, grids, 2, scales)
    ref, ref_delta = original_rope_index(ids, [grids[0]], grids[1:], spg[1:], tps)
    assert np.array_equal(ours, ref) and delta == ref_delta


def test_transformers_5_differs_after_a_long_video():
    """transformers 5 resumes the text at start + max(h, w) / merge after any vision block;
    the model's own code (and vLLM) at one past the largest position, which for a video with
    more temporal positions than rows or columns is further on."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    grids = [(4, 4, 4)]  # temporal positions 0, 2, 4, 6 (tokens_per_second 2); rows 0..1
    ids = [1, START, *[VIDEO] * 16, END, 2]
    ours, delta = mrope_positions(len(ids), [(2, 16)], grids, 2, [(1.0, 2)])
    config = Qwen2_5_VLConfig(vision_config={"spatial_merge_size": 2, "tokens_per_second": 2})
    fake = SimpleNamespace(config=config)
    fake.get_vision_position_ids = lambda *a, **k: Qwen2_5_VLModel.get_vision_position_ids(
        fake, *a, **k
    )
    input_ids = torch.tensor([ids])
    ref, _ = Qwen2_5_VLModel.get_rope_index(
        fake, input_ids, (input_ids == VIDEO).int() * 2, None, torch.tensor(grids),
        torch.tensor([1.0]),
    )  # fmt: skip
    ref = ref[:, 0].numpy()
    assert np.array_equal(ours[:, :18], ref[:, :18])  # the video itself agrees
    assert ours[0, 18] == 2 + 6 + 1 and ref[0, 18] == 2 + 2  # the text after it does not
    assert delta == (2 + 6 + 1 + 2) - len(ids)  # END at 9, the last token at 10


# ---------------------------------------------------------------------- loading


def test_loader_accepts_frames_and_refuses_bad_ones():
    loader = VideoLoader(MultiModalConfig())

    def sampler(total, fps):
        raise AssertionError("decoded frames are not sampled again")

    frames = _frames(3, 28, 56)
    assert np.array_equal(loader.load(frames, sampler).frames, frames)
    assert loader.load(frames, sampler).sample_fps is None
    pil = [Image.fromarray(f) for f in frames]
    assert np.array_equal(loader.load(pil, sampler).frames, frames)
    assert np.array_equal(loader.load(list(frames), sampler).frames, frames)
    assert np.array_equal(loader.load(torch.from_numpy(frames), sampler).frames, frames)
    for bad, message in [
        (frames.astype(np.float32), "uint8"),
        (frames[..., :2], r"\[T, H, W, 3\]"),
        ([], "empty list"),
        ([frames[0], frames[0, :14]], "one size"),
        (frames[:0], "no frames"),
        ("https://example.com/a.mp4", "remote media is disabled"),
        ("/etc/hostname", "offline API"),
        ("data:video/mp4,raw", "base64"),
    ]:
        with pytest.raises(ValueError, match=message):
            loader.load(bad, sampler)
    with pytest.raises(TypeError, match="a video must be"):
        loader.load(3, sampler)


def test_loader_without_pyav_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)
    loader = VideoLoader(MultiModalConfig())
    url = "data:video/mp4;base64," + base64.b64encode(b"\x00" * 32).decode()
    with pytest.raises(ValueError, match="pip install av"):
        loader.load(url, lambda total, fps: (np.arange(total), fps))


def _encode_lossless(frames: np.ndarray, fps: int, container_format: str = "mov") -> bytes:
    """Losslessly coded frames (decoding gives back the exact pixels): PNG in a QuickTime file
    (the header counts the frames) or FFV1 in Matroska (it does not)."""
    av = pytest.importorskip("av")
    codec, pix_fmt = {"mov": ("png", "rgb24"), "matroska": ("ffv1", "bgr0")}[container_format]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container_format) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = pix_fmt
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize("container_format", ["mov", "matroska"])
def test_loader_decodes_and_samples_encoded_videos(tmp_path, container_format):
    frames = _frames(30, 28, 56)
    data = _encode_lossless(frames, fps=10, container_format=container_format)  # 3 s
    loader = VideoLoader(MultiModalConfig())
    opts = VideoOptions(fps=2.0)
    seen = []

    def sampler(total, fps):
        seen.append((total, fps))
        return sample_frame_indices(total, fps, opts)

    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    out = loader.load(url, sampler)
    assert seen == [(30, 10.0)]
    idx, fps = sample_frame_indices(30, 10.0, opts)
    assert out.sample_fps == fps == 2.0 and len(idx) == 6
    assert np.array_equal(out.frames, frames[idx])
    path = tmp_path / "clip.mkv"
    path.write_bytes(data)
    assert np.array_equal(loader.load(str(path), sampler, allow_local_paths=True).frames,
                          frames[idx])  # fmt: skip
    for bad, message in [
        (b"\x00" * 64, "not a readable video"),
        ("data:video/mp4;base64," + base64.b64encode(b"garbage" * 10).decode(),
         "video data URL: not a readable video"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            loader.load(bad, sampler)


# ---------------------------------------------------------------------- prompts


def test_process_expands_video_placeholders_in_prompt_order():
    proc = _processor(kwargs=SMALL)
    img, video = Image.fromarray(_frames(1, 56, 84)[0]), _frames(8, 56, 56, seed=1)
    ids = [1, START, VIDEO, END, 2, START, IMAGE, END, 3]
    out_ids, mm = proc.process(ids, [img], videos=[video])
    assert [item.modality for item in mm.items] == ["video", "image"]
    assert mm.placeholders == [(2, 16), (21, 6)]
    assert out_ids == [1, START, *[VIDEO] * 16, END, 2, START, *[IMAGE] * 6, END, 3]
    # given frames are taken at `fps` (2): second_per_grid 1, time step 2 per temporal patch
    ref, delta = original_rope_index(out_ids, [(1, 4, 6)], [(4, 4, 4)], [1.0], 2)
    assert np.array_equal(mm.mrope_positions, ref) and mm.mrope_delta == delta
    assert [h for _, _, h in mm.hash_ranges()] == [item.mm_hash for item in mm.items]


def test_video_as_a_list_of_image_files(tmp_path):
    """qwen-vl-utils' frame lists: image references, under the image access rules."""
    proc = _processor(kwargs=SMALL)
    frames = _frames(4, 56, 56, seed=3)
    paths = []
    for i, frame in enumerate(frames):
        paths.append(str(tmp_path / f"{i}.png"))
        Image.fromarray(frame).save(paths[-1])
    ids = [START, VIDEO, END]
    _, from_files = proc.process(ids, [], allow_local_paths=True, videos=[paths])
    _, from_array = proc.process(ids, [], videos=[frames])
    assert from_files.items[0].mm_hash == from_array.items[0].mm_hash
    with pytest.raises(ValueError, match="video 0: .*offline API"):
        proc.process(ids, [], videos=[paths])  # a server: no local files


def test_process_rejects_bad_video_prompts():
    proc = _processor(kwargs=SMALL)
    video = _frames(4, 56, 56)
    with pytest.raises(ValueError, match=r"2 videos.*limit_mm_per_prompt.*'video': 2"):
        proc.process([START, VIDEO, END] * 2, [], videos=[video, video])
    with pytest.raises(ValueError, match="1 video placeholder"):
        proc.process([START, VIDEO, END], [], videos=[])
    with pytest.raises(ValueError, match="video 0: .*uint8"):
        proc.process([START, VIDEO, END], [], videos=[video.astype(np.int32)])
    short = _processor(max_model_len=20, kwargs=SMALL)
    with pytest.raises(ValueError, match=r"video needs 8 tokens.*max_model_len is 20") as e:
        short.process([1] * 12 + [START, VIDEO, END], [], videos=[video])
    assert "max_frames" in str(e.value) and "total_pixels" in str(e.value)
    few = _processor(kwargs={**SMALL, "max_frames": 2})
    with pytest.raises(ValueError, match=r"4 frames, more than max_frames=2.*'max_frames': 4"):
        few.process([START, VIDEO, END], [], videos=[video])
    no_video = _processor(limits={"image": 1, "video": 0})
    with pytest.raises(ValueError, match=r"limit_mm_per_prompt.*'video': 1"):
        no_video.process([START, VIDEO, END], [], videos=[video])


def test_multi_modal_data_with_video():
    img, video = _frames(1, 28, 28)[0], _frames(4, 28, 28)
    assert MultiModalProcessor.media_of({"video": video}) == ([], [video])
    assert MultiModalProcessor.media_of({"image": img, "video": [video, video]}) == (
        [img],
        [video, video],
    )
    frames = [Image.fromarray(f) for f in video]  # one video given as a list of frames
    assert MultiModalProcessor.media_of({"video": frames}) == ([], [frames])
    with pytest.raises(ValueError, match="unsupported modality audio"):
        MultiModalProcessor.media_of({"audio": img})


def test_parse_chat_video_parts():
    proc = _processor()
    video = _frames(4, 28, 28)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
                {"type": "image_url", "image_url": {"url": "data:x"}},
                {"type": "video", "video": video},
                {"type": "text", "text": "Describe"},
            ],
        }
    ]
    normalized, media = proc.parse_chat(messages)
    assert [kind for kind, _ in media] == ["video", "image", "video"]
    assert normalized[0]["content"][:3] == [{"type": "video"}, {"type": "image"}, {"type": "video"}]
    inline, _ = proc.parse_chat(messages, inline_placeholders=True)
    assert inline[0]["content"].count(proc.video_placeholder) == 2
    with pytest.raises(ValueError, match="without a video"):
        proc.parse_chat([{"role": "user", "content": [{"type": "video_url"}]}])


def test_command_line_flags():
    import argparse

    from pagoda.entrypoints.cli_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(
        ["--model", "m", "--limit-mm-per-prompt", '{"image": 3, "video": 2}',
         "--mm-processor-kwargs", '{"fps": 1, "max_pixels": 100352}']
    )  # fmt: skip
    kwargs = engine_kwargs(ns)
    assert kwargs["limit_mm_per_prompt"] == {"image": 3, "video": 2}
    assert kwargs["mm_processor_kwargs"] == {"fps": 1, "max_pixels": 100352}
    assert kwargs["allow_remote_images"] is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--limit-mm-per-prompt", "video=2"])
