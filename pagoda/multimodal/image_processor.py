"""Qwen2-VL / Qwen2.5-VL image preprocessing: resize to the pixel bounds, hash, patchify.

Same arithmetic as transformers' `Qwen2VLImageProcessorPil`: RGB, bicubic resize (PIL) to sides
that are multiples of patch_size * merge_size with min_pixels <= h * w <= max_pixels, rescale
by 1/255 (float64, then float32), normalize with the CLIP mean/std, cut into patches. Here the
image stops after the resize (uint8); `patchify_reference` is the NumPy form of the rest, which
the runner does on the device.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagoda.multimodal.inputs import ImageInput

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_PREPROCESSOR_FILE = "preprocessor_config.json"
_MAX_ASPECT_RATIO = 200
_IMAGE_KWARGS = ("min_pixels", "max_pixels")


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Resize bounds, patch geometry and normalization of a model's images."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280  # HF's default; Qwen2.5-VL checkpoints ship 12845056
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255

    def __post_init__(self) -> None:
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) > max_pixels ({self.max_pixels})")
        if self.max_pixels < self.factor**2:
            raise ValueError(
                f"max_pixels ({self.max_pixels}) is below one merged patch "
                f"({self.factor}x{self.factor} = {self.factor**2} pixels)"
            )

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one LLM token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size**2

    def largest_image_hw(self) -> tuple[int, int]:
        """The square image with the most tokens that the bounds allow."""
        side = max(self.factor, math.isqrt(self.max_pixels) // self.factor * self.factor)
        return side, side

    def num_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens of an image of this (resized) size."""
        return (height // self.factor) * (width // self.factor)

    @classmethod
    def from_model(
        cls, model_path: str | None, vision_config: Any, processor_kwargs: Mapping[str, Any]
    ) -> ImageProcessorConfig:
        """Defaults < the model's preprocessor_config.json < the user's mm_processor_kwargs.

        Patch geometry comes from the vision config (it must match the weights); the pixel
        bounds and normalization from the preprocessor file when the model has one.
        """
        values: dict[str, Any] = {
            "patch_size": _first_int(getattr(vision_config, "patch_size", None), 14),
            "temporal_patch_size": _first_int(
                getattr(vision_config, "temporal_patch_size", None), 2
            ),
            "merge_size": int(getattr(vision_config, "spatial_merge_size", None) or 2),
        }
        if str(getattr(vision_config, "model_type", "")).startswith("qwen3_vl"):
            # Qwen3-VL's processor defaults (a checkpoint without preprocessor_config.json)
            values.update(
                image_mean=(0.5, 0.5, 0.5),
                image_std=(0.5, 0.5, 0.5),
                min_pixels=65536,
                max_pixels=16777216,
            )
        pre = _read_preprocessor_config(model_path)
        size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
        min_pixels = pre.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
        max_pixels = pre.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
        if min_pixels:
            values["min_pixels"] = int(min_pixels)
        if max_pixels:
            values["max_pixels"] = int(max_pixels)
        if pre.get("image_mean"):
            values["image_mean"] = tuple(float(x) for x in pre["image_mean"])
        if pre.get("image_std"):
            values["image_std"] = tuple(float(x) for x in pre["image_std"])
        if pre.get("rescale_factor"):
            values["rescale_factor"] = float(pre["rescale_factor"])
        # The pixel bounds apply to images and video frames; other keys shape videos only.
        values.update({k: v for k, v in processor_kwargs.items() if k in _IMAGE_KWARGS})
        return cls(**values)


def _first_int(value: Any, default: int) -> int:
    # HF configs allow `patch_size: int | [int, int]`; the Qwen vision towers use square ones.
    if isinstance(value, (list, tuple)):
        value = value[0]
    return int(value or default)


def _read_preprocessor_config(model_path: str | None) -> dict[str, Any]:
    if not model_path or not os.path.isdir(model_path):
        return {}
    path = os.path.join(model_path, _PREPROCESSOR_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read the image preprocessor config ({e})") from e
    return data if isinstance(data, dict) else {}


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Sides that are multiples of `factor`, near the aspect ratio, within the pixel bounds.

    HF's `smart_resize`, bit for bit (Python's round-half-to-even included).
    """
    if max(height, width) / min(height, width) > _MAX_ASPECT_RATIO:
        raise ValueError(
            f"the image is {width}x{height}: its aspect ratio must be below {_MAX_ASPECT_RATIO}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess_image(image: Any, config: ImageProcessorConfig) -> ImageInput:
    """A decoded PIL image -> resized RGB pixels, patch grid and content hash."""
    from PIL import Image

    if image.mode != "RGB":
        image = image.convert("RGB")  # as HF: alpha is dropped, palettes expanded
    width, height = image.size
    new_h, new_w = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
    if (new_w, new_h) != (width, height):
        image = image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
    pixels = np.array(image, dtype=np.uint8)  # [h, w, 3], a writable copy (torch wants one)
    grid = (1, new_h // config.patch_size, new_w // config.patch_size)
    # The resized pixels are exactly what the encoder sees (normalization is fixed per model),
    # so equal hashes mean equal image embeddings; blake2b is ~3x faster than sha256 here.
    digest = hashlib.blake2b(pixels.tobytes(), digest_size=16)
    digest.update(np.asarray(pixels.shape, dtype=np.int64).tobytes())
    return ImageInput(
        pixels=pixels,
        grid_thw=grid,
        mm_hash=digest.hexdigest(),
        num_tokens=config.num_tokens(new_h, new_w),
    )


def patchify_reference(pixels: np.ndarray, config: ImageProcessorConfig) -> np.ndarray:
    """[h, w, 3] uint8 -> pixel_values [grid_h * grid_w, 3 * T * P * P] float32 (NumPy).

    Rows run over 2x2 (merge_size) blocks of patches, block-major, as the patch merger expects;
    each patch is repeated over the temporal axis (a still image is a 1-frame video).
    """
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    x = pixels.transpose(2, 0, 1).astype(np.float64) * config.rescale_factor
    x = x.astype(np.float32)
    mean = np.asarray(config.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(config.image_std, dtype=np.float32)[:, None, None]
    x = (x - mean) / std  # [3, h, w]
    c, h, w = x.shape
    gh, gw = h // p, w // p
    x = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
    return x.reshape(gh * gw, c * t * p * p)
