"""What a multimodal prompt carries from the input processor to the model runner.

`MultiModalInputs` holds each image or video resized but not yet normalized (uint8),
where its placeholder tokens sit in the prompt, and the prompt's M-RoPE positions. It is NumPy
only and read-only once built, so requests (and `n > 1` siblings) can share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image or video (the encoder treats both alike)."""

    # image: [h, w, 3] uint8 RGB; video: [T, h, w, 3], T a multiple of temporal_patch_size;
    # h and w are multiples of patch_size * merge_size
    pixels: np.ndarray
    grid_thw: tuple[int, int, int]  # patches along (time, height, width)
    mm_hash: str  # content hash of `pixels` (and timing): the prefix- and encoder-cache key
    num_tokens: int  # placeholder tokens in the prompt: t * h * w / merge_size**2
    modality: str = "image"  # "image" | "video"
    second_per_grid: float = 0.0  # video: seconds one temporal patch spans


@dataclass(frozen=True)
class MultiModalInputs:
    """Images and videos of one prompt (in prompt order), their placeholder ranges and the
    prompt's M-RoPE positions."""

    items: list[ImageInput]
    placeholders: list[tuple[int, int]]  # (offset, length) of each item's tokens, in order
    mrope_positions: np.ndarray  # [3, prompt_len] int64: (temporal, height, width) positions
    # Tokens after the prompt sit at index + delta on all three axes (delta <= 0 when the
    # vision blocks span fewer positions than tokens).
    mrope_delta: int

    def hash_ranges(self) -> list[tuple[int, int, str]]:
        """(offset, length, hash) per item: `Request.mm_hashes`."""
        return [
            (off, length, item.mm_hash)
            for (off, length), item in zip(self.placeholders, self.items, strict=True)
        ]


def mrope_positions(
    num_tokens: int,
    placeholders: Sequence[tuple[int, int]],
    grids: Sequence[tuple[int, int, int]],
    merge_size: int,
    time_scales: Sequence[tuple[float, ...]] | None = None,
) -> tuple[np.ndarray, int]:
    """M-RoPE positions [3, num_tokens] and the decode delta, as the Qwen2-VL / Qwen2.5-VL
    release's `get_rope_index`.

    Text runs count up on all three axes. A vision block's tokens get (t', row, col) of its
    merged grid, offset by the position where the block starts, with t' = t times the block's
    `time_scales` factors one after the other in float32, truncated (Qwen2.5-VL videos:
    (second_per_grid, tokens_per_second); Qwen2-VL: (1,); a still image has t = 0 only). The
    text after a block resumes one past the largest position on any axis. (transformers 5
    resumes at start + max(rows, cols): the same for images, lower after a video with more
    time steps than rows or columns; the model was trained with the original rule, which vLLM
    also keeps.)
    """
    scales = [(1.0,)] * len(grids) if time_scales is None else list(time_scales)
    pos = np.empty((3, num_tokens), dtype=np.int64)
    current = 0  # the next text position
    prev_end = 0
    for (offset, length), (t, h, w), scale in zip(placeholders, grids, scales, strict=True):
        n_text = offset - prev_end
        pos[:, prev_end:offset] = np.arange(current, current + n_text)
        current += n_text
        rows, cols = h // merge_size, w // merge_size
        assert length == t * rows * cols, "placeholder length does not match the grid"
        # float32 products truncated, as the original torch code computes them
        times = np.arange(t).astype(np.float32)
        for factor in scale:
            times = times * np.float32(factor)
        times = times.astype(np.int64)
        tt, hh, ww = np.meshgrid(times, np.arange(rows), np.arange(cols), indexing="ij")
        pos[0, offset : offset + length] = tt.reshape(-1) + current
        pos[1, offset : offset + length] = hh.reshape(-1) + current
        pos[2, offset : offset + length] = ww.reshape(-1) + current
        if length:
            current = int(pos[:, offset : offset + length].max()) + 1
        prev_end = offset + length
    pos[:, prev_end:] = np.arange(current, current + num_tokens - prev_end)
    delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
    return pos, delta
