"""What a multimodal prompt carries from the input processor to the model runner.

`MultiModalInputs` holds each image resized but not yet normalized (uint8, a few MB at most),
where its placeholder tokens sit in the prompt, and the prompt's M-RoPE positions. It is NumPy
only and read-only once built, so requests (and `n > 1` siblings) can share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image."""

    pixels: np.ndarray  # [h, w, 3] uint8 RGB; h and w are multiples of patch_size * merge_size
    grid_thw: tuple[int, int, int]  # patches along (time, height, width)
    mm_hash: str  # content hash of `pixels`: the prefix-cache and encoder-cache key
    num_tokens: int  # placeholder tokens in the prompt: t * h * w / merge_size**2


@dataclass(frozen=True)
class MultiModalInputs:
    """Images of one prompt, their placeholder ranges and the prompt's M-RoPE positions."""

    images: list[ImageInput]
    placeholders: list[tuple[int, int]]  # (offset, length) of each image's tokens, in order
    mrope_positions: np.ndarray  # [3, prompt_len] int64: (temporal, height, width) positions
    # Tokens after the prompt sit at index + delta on all three axes (delta <= 0: an image of
    # n tokens advances the position by only max(h, w) / merge).
    mrope_delta: int

    def hash_ranges(self) -> list[tuple[int, int, str]]:
        """(offset, length, hash) per image: `Request.mm_hashes`."""
        return [
            (off, length, img.mm_hash)
            for (off, length), img in zip(self.placeholders, self.images, strict=True)
        ]


def mrope_positions(
    num_tokens: int,
    placeholders: Sequence[tuple[int, int]],
    grids: Sequence[tuple[int, int, int]],
    merge_size: int,
) -> tuple[np.ndarray, int]:
    """M-RoPE positions [3, num_tokens] and the decode delta, as HF's `get_rope_index`.

    Text runs count up on all three axes. An image's tokens get (t, row, col) of its merged
    grid, each offset by the position where the image starts; the text after it resumes at
    start + max(rows, cols). Still images use t = 0 (no temporal spacing).
    """
    pos = np.empty((3, num_tokens), dtype=np.int64)
    current = 0  # the next text position
    prev_end = 0
    for (offset, length), (t, h, w) in zip(placeholders, grids, strict=True):
        n_text = offset - prev_end
        pos[:, prev_end:offset] = np.arange(current, current + n_text)
        current += n_text
        rows, cols = h // merge_size, w // merge_size
        assert length == t * rows * cols, "placeholder length does not match the image grid"
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(rows), np.arange(cols), indexing="ij")
        pos[0, offset : offset + length] = tt.reshape(-1) + current
        pos[1, offset : offset + length] = hh.reshape(-1) + current
        pos[2, offset : offset + length] = ww.reshape(-1) + current
        current += max(rows, cols)
        prev_end = offset + length
    pos[:, prev_end:] = np.arange(current, current + num_tokens - prev_end)
    delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
    return pos, delta
