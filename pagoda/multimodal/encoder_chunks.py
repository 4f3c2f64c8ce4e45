"""Vision-tower inputs in chunks of whole frames, to bound the encoder's activation memory.

The Qwen-VL vision towers attend within a frame (a temporal patch of a video, or an image):
window and full attention, the 2-D rotary positions and the patch merger never cross one. So a
long video, or several images, can go through the tower a few frames at a time with the same
result, and the tower's activations scale with the chunk instead of the whole input (a 48-frame
video alone held ~2 GiB in the memory profile).
"""

from __future__ import annotations

from collections.abc import Sequence

# Patches one vision-tower forward takes (a larger frame goes alone): ~0.5 GiB of Qwen2.5-VL-3B
# encoder activations in bf16 (2.23 GiB measured for 32,644 patches).
ENCODER_CHUNK_PATCHES = 8192


def split_grids(
    grid_thw: Sequence[tuple[int, int, int]], max_patches: int = ENCODER_CHUNK_PATCHES
) -> list[list[tuple[int, int, int]]]:
    """Patch grids (t, h, w), in order, cut into consecutive chunks of at most `max_patches`
    patches each; a video's grid may be cut along t (frames); a frame is never cut."""
    chunks: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    used = 0
    for t, h, w in grid_thw:
        per_frame = h * w
        left = t
        while left:
            room = (max_patches - used) // per_frame
            if room <= 0 and current:
                chunks.append(current)
                current, used = [], 0
                continue
            take = min(left, max(room, 1))  # a frame larger than the bound goes alone
            current.append((take, h, w))
            used += take * per_frame
            left -= take
    if current:
        chunks.append(current)
    return chunks
