"""Qwen2-VL / Qwen2.5-VL video preprocessing: sample frames, resize, pad, hash, patchify.

Frame sampling and the per-frame pixel bounds follow Qwen's own `qwen-vl-utils` (the code the
models were released with): `fps` frames a second, an even count between `min_frames` and
`max_frames`, frames spread evenly over the clip; each frame at most `max_pixels`, and all
frames together about `total_pixels`. Frames are resized like images (PIL bicubic, sides a
multiple of patch_size * merge_size) and padded to a multiple of `temporal_patch_size` by
repeating the last one; `patchify_video_reference` is the NumPy form of what the runner does.
Qwen3-VL videos are one image-like item per temporal patch (`split_temporal_patches`), each
after its timestamp text (`temporal_patch_times`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from pagoda.multimodal.image_processor import ImageProcessorConfig, smart_resize
from pagoda.multimodal.inputs import ImageInput

_VIDEO_PREPROCESSOR_FILE = "video_preprocessor_config.json"
# qwen-vl-utils' defaults, in merged tokens (times factor**2 pixels: 28x28 for Qwen2-VL /
# Qwen2.5-VL, 32x32 for Qwen3-VL).
_VIDEO_MIN_TOKENS = 128
_VIDEO_MAX_TOKENS = 768
_VIDEO_TOTAL_TOKENS = 128000 * 0.9
_VIDEO_MIN_PIXELS = _VIDEO_MIN_TOKENS * 28 * 28
_VIDEO_MAX_PIXELS = _VIDEO_MAX_TOKENS * 28 * 28
_VIDEO_TOTAL_PIXELS = int(_VIDEO_TOTAL_TOKENS * 28 * 28)
# Video processors whose `size.longest_edge` bounds the whole clip (t * h * w), not one frame.
_CLIP_BUDGET_PROCESSORS = ("Qwen3VLVideoProcessor",)
# mm_processor_kwargs that shape videos (min_pixels / max_pixels apply to images too).
VIDEO_KWARGS = ("fps", "min_frames", "max_frames", "total_pixels", "min_pixels", "max_pixels")


@dataclass(frozen=True)
class VideoOptions:
    """How a video becomes frames: sampling rate, frame count and pixel bounds."""

    fps: float = 2.0  # frames sampled per second of video; for given frames: their rate
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = _VIDEO_MIN_PIXELS  # per frame
    max_pixels: int = _VIDEO_MAX_PIXELS  # per frame
    total_pixels: int = _VIDEO_TOTAL_PIXELS  # all sampled frames together (a soft bound)

    def __post_init__(self) -> None:
        if isinstance(self.fps, bool) or not isinstance(self.fps, (int, float)) or self.fps <= 0:
            raise ValueError(f"mm_processor_kwargs['fps'] must be a number > 0, got {self.fps!r}")
        for name in ("min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"mm_processor_kwargs[{name!r}] must be an integer > 0, got {value!r}"
                )
        if self.min_frames > self.max_frames:
            raise ValueError(
                f"mm_processor_kwargs: min_frames ({self.min_frames}) > max_frames "
                f"({self.max_frames})"
            )
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"mm_processor_kwargs: min_pixels ({self.min_pixels}) > max_pixels "
                f"({self.max_pixels})"
            )

    @classmethod
    def from_model(
        cls, model_path: str | None, processor_kwargs: Mapping[str, Any], factor: int = 28
    ) -> VideoOptions:
        """qwen-vl-utils' defaults < the model's video_preprocessor_config.json < the user's.

        `factor` is the model's merged-patch side in pixels (qwen-vl-utils scales its pixel
        defaults with it). Qwen3-VL's file bounds the whole clip with `size.longest_edge`: that
        becomes `total_pixels`, as the per-frame cap of its own processor reads it.
        """
        values: dict[str, Any] = {}
        if factor != 28:
            values["min_pixels"] = _VIDEO_MIN_TOKENS * factor * factor
            values["max_pixels"] = _VIDEO_MAX_TOKENS * factor * factor
            values["total_pixels"] = int(_VIDEO_TOTAL_TOKENS * factor * factor)
        pre = _read_json(model_path, _VIDEO_PREPROCESSOR_FILE)
        size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
        lo = pre.get("min_pixels") or size.get("shortest_edge")
        hi = pre.get("max_pixels") or size.get("longest_edge")
        if lo:
            values["min_pixels"] = int(lo)
        if hi and pre.get("video_processor_type") in _CLIP_BUDGET_PROCESSORS:
            values["total_pixels"] = int(hi)
        elif hi:
            values["max_pixels"] = int(hi)
        for key in ("fps", "min_frames", "max_frames"):
            if pre.get(key):
                values[key] = pre[key]
        names = {f.name for f in fields(cls)}
        values.update({k: v for k, v in processor_kwargs.items() if k in names})
        for lo_key, hi_key in (("min_pixels", "max_pixels"), ("min_frames", "max_frames")):
            lo = values.get(lo_key, getattr(cls, lo_key))
            if lo_key not in processor_kwargs and lo > values.get(hi_key, lo):
                # A user bound below the default minimum (a max_pixels set for images, say)
                # lowers the minimum with it.
                values[lo_key] = values[hi_key]
        return cls(**values)


def _read_json(model_path: str | None, name: str) -> dict[str, Any]:
    if not model_path or not os.path.isdir(model_path):
        return {}
    path = os.path.join(model_path, name)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read it ({e})") from e
    return data if isinstance(data, dict) else {}


def _floor_by(x: float, factor: int) -> int:
    return math.floor(x / factor) * factor


def _ceil_by(x: float, factor: int) -> int:
    return math.ceil(x / factor) * factor


def sample_frame_indices(
    total_frames: int, video_fps: float, options: VideoOptions, frame_factor: int = 2
) -> tuple[np.ndarray, float]:
    """Which decoded frames to keep, and the rate they represent (frames per second).

    qwen-vl-utils' `smart_nframes`: `fps` frames per second of video, at least `min_frames`
    and at most `max_frames` and the clip's own frame count, rounded down to an even number;
    the frames are spread evenly from the first to the last.
    """
    if total_frames < frame_factor:
        raise ValueError(
            f"the video has {total_frames} frame(s); at least {frame_factor} are needed"
        )
    min_frames = _ceil_by(options.min_frames, frame_factor)
    max_frames = _floor_by(min(options.max_frames, total_frames), frame_factor)
    wanted = total_frames / video_fps * options.fps
    n = _floor_by(min(max(wanted, min_frames), max_frames, total_frames), frame_factor)
    if n < frame_factor:
        raise ValueError(
            f"the video has {total_frames} frames; with max_frames={options.max_frames} fewer "
            f"than {frame_factor} would be kept"
        )
    indices = np.round(np.linspace(0, total_frames - 1, n)).astype(np.int64)
    return indices, n / total_frames * video_fps


def frame_bounds(
    num_frames: int, options: VideoOptions, frame_factor: int = 2
) -> tuple[int, float]:
    """(min_pixels, max_pixels) of each frame of a clip of `num_frames` sampled frames."""
    # qwen-vl-utils: an even share of total_pixels per frame pair, never below 1.05 x the
    # minimum, and never above the per-frame maximum.
    share = options.total_pixels / num_frames * frame_factor
    max_pixels = max(min(options.max_pixels, share), int(options.min_pixels * 1.05))
    return options.min_pixels, min(options.max_pixels, max_pixels)


def preprocess_video(
    frames: np.ndarray, sample_fps: float, options: VideoOptions, config: ImageProcessorConfig
) -> ImageInput:
    """Sampled frames [T, H, W, 3] uint8 -> resized, padded frames with grid, hash, timing.

    `sample_fps` is the rate the frames represent (each temporal patch then spans
    temporal_patch_size / sample_fps seconds: `second_per_grid`, the M-RoPE time step).
    """
    from PIL import Image

    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(
            f"video frames must be uint8 [T, H, W, 3]; got {frames.dtype} {list(frames.shape)}"
        )
    num, height, width = frames.shape[:3]
    if num == 0:
        raise ValueError("the video has no frames")
    tp = config.temporal_patch_size
    lo, hi = frame_bounds(_ceil_by(num, tp), options, tp)
    new_h, new_w = smart_resize(height, width, config.factor, lo, hi)
    if (new_h, new_w) != (height, width):
        frames = np.stack(
            [
                np.asarray(
                    Image.fromarray(f).resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
                )
                for f in frames
            ]
        )
    else:
        frames = np.ascontiguousarray(frames)
    if pad := -num % tp:  # a whole number of temporal patches: repeat the last frame
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    grid = (frames.shape[0] // tp, new_h // config.patch_size, new_w // config.patch_size)
    second_per_grid = tp / sample_fps
    # Positions depend on the frame timing, so it is part of the prefix-cache key.
    digest = hashlib.blake2b(frames.tobytes(), digest_size=16)
    digest.update(np.asarray(frames.shape, dtype=np.int64).tobytes())
    digest.update(f"video:{second_per_grid!r}".encode())
    return ImageInput(
        pixels=frames,
        grid_thw=grid,
        mm_hash=digest.hexdigest(),
        num_tokens=grid[0] * config.num_tokens(new_h, new_w),
        modality="video",
        second_per_grid=second_per_grid,
    )


def video_num_tokens(
    num_frames: int, height: int, width: int, options: VideoOptions, config: ImageProcessorConfig
) -> int:
    """Tokens of a clip of `num_frames` sampled frames of this size (for limits and profiling)."""
    tp = config.temporal_patch_size
    num_frames = _ceil_by(num_frames, tp)
    lo, hi = frame_bounds(num_frames, options, tp)
    new_h, new_w = smart_resize(height, width, config.factor, lo, hi)
    return num_frames // tp * config.num_tokens(new_h, new_w)


def patchify_video_reference(frames: np.ndarray, config: ImageProcessorConfig) -> np.ndarray:
    """[T, h, w, 3] uint8 (T a multiple of temporal_patch_size) -> [T/tp * gh * gw, C*tp*P*P].

    The layout of transformers' Qwen2-VL video processor: rows over temporal patches, then 2x2
    merge blocks; each row holds channel-major (C, tp, P, P) values.
    """
    p, m, tp = config.patch_size, config.merge_size, config.temporal_patch_size
    x = frames.transpose(0, 3, 1, 2).astype(np.float64) * config.rescale_factor
    x = x.astype(np.float32)
    mean = np.asarray(config.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(config.image_std, dtype=np.float32)[:, None, None]
    x = (x - mean) / std  # [T, 3, h, w]
    t, c, h, w = x.shape
    gt, gh, gw = t // tp, h // p, w // p
    x = x.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [gt, gh/m, gw/m, m, m, C, tp, P, P]
    return np.ascontiguousarray(x).reshape(gt * gh * gw, c * tp * p * p)


def temporal_patch_times(frame_times: np.ndarray, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal patch: the mean of its first and last frame's time, the last
    frame repeated to fill the final patch (Qwen3-VL's processor, `_calculate_timestamps`)."""
    times = [float(t) for t in frame_times]
    if not times:
        raise ValueError("the video has no frames")
    times += [times[-1]] * (-len(times) % temporal_patch_size)
    return [
        (times[i] + times[i + temporal_patch_size - 1]) / 2
        for i in range(0, len(times), temporal_patch_size)
    ]


def split_temporal_patches(video: ImageInput, temporal_patch_size: int) -> list[ImageInput]:
    """A preprocessed video -> one item per temporal patch, grid (1, h, w) each.

    For an encoder whose attention stays within a frame (Qwen3-VL: full attention per temporal
    patch, position embeddings repeated over time) this is the same computation as the whole
    video; each item is keyed by its own content, so a repeated clip reuses its patches.
    """
    t, h, w = video.grid_thw
    per_patch = video.num_tokens // t
    items = []
    for k in range(t):
        frames = video.pixels[k * temporal_patch_size : (k + 1) * temporal_patch_size]
        digest = hashlib.blake2b(frames.tobytes(), digest_size=16)
        digest.update(np.asarray(frames.shape, dtype=np.int64).tobytes())
        digest.update(b"video-patch")
        items.append(
            ImageInput(
                pixels=frames,
                grid_thw=(1, h, w),
                mm_hash=digest.hexdigest(),
                num_tokens=per_patch,
                modality="video",
                second_per_grid=video.second_per_grid,
            )
        )
    return items
