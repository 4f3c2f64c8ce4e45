"""The vision side of a step for vision-language models: M-RoPE positions and image embeddings.

For every scheduled chunk that covers image-pad tokens, the images' encoder outputs are looked up
in a cache keyed by image hash, or computed (one encoder call per request, inside the step), and
scattered over those tokens' rows of `inputs_embeds`. A chunked prefill may split an image, so an
output stays cached until every request using it has computed all of that image's tokens.
Positions: a prompt token takes its precomputed [3] M-RoPE position, a later token
index + delta on all axes, so steps without image tokens keep plain [T] positions (CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagoda.config import MultiModalConfig
from pagoda.multimodal.image_processor import ImageProcessorConfig

if TYPE_CHECKING:
    from pagoda.multimodal.inputs import ImageInput
    from pagoda.step import ScheduledRequest


def patchify(
    pixels: torch.Tensor, config: ImageProcessorConfig, dtype: torch.dtype
) -> torch.Tensor:
    """[h, w, 3] uint8 (on the device) -> pixel_values [gh * gw, 3 * T * P * P] in `dtype`.

    The arithmetic of `patchify_reference` (HF's image processor): float64 rescale, float32
    normalize, patches in merge-block-major order, repeated over the temporal axis.
    """
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    device = pixels.device
    x = (pixels.permute(2, 0, 1).double() * config.rescale_factor).float()  # [3, h, w]
    mean = torch.tensor(config.image_mean, dtype=torch.float32, device=device)[:, None, None]
    std = torch.tensor(config.image_std, dtype=torch.float32, device=device)[:, None, None]
    x = (x - mean) / std
    c, h, w = x.shape
    gh, gw = h // p, w // p
    x = x.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    x = x.unsqueeze(5).expand(*x.shape[:5], t, p, p)  # [gh/m, gw/m, m, m, C, T, P, P]
    return x.reshape(gh * gw, c * t * p * p).to(dtype)


class EncoderRunner:
    """Per-step multimodal inputs for a model with `embed_images` / `embed_input_ids`."""

    def __init__(
        self,
        model: Any,
        image_config: ImageProcessorConfig,
        mm_config: MultiModalConfig,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.image_config = image_config
        self.mm_config = mm_config
        self.max_model_len = max_model_len
        self.device = device
        self.dtype = dtype
        self.cache: dict[str, torch.Tensor] = {}  # image hash -> [num_tokens, hidden]
        self.users: dict[str, set[str]] = {}  # image hash -> requests still needing it
        self.held: dict[str, set[str]] = {}  # request id -> hashes it holds
        self.num_encoded = 0  # images run through the encoder (tests, stats)

    # ------------------------------------------------------------------ per step

    def rope_positions(self, reqs: Sequence[ScheduledRequest], positions: np.ndarray) -> np.ndarray:
        """[T] token positions -> [T] (all axes equal) or [3, T] M-RoPE positions."""
        if all(r.mm_inputs is None for r in reqs):
            return positions  # text-only requests: M-RoPE is plain RoPE
        num_new = [r.num_new_tokens for r in reqs]
        deltas = [0 if r.mm_inputs is None else r.mm_inputs.mrope_delta for r in reqs]
        flat = positions + np.repeat(deltas, num_new)  # right for every token past its prompt
        out3: np.ndarray | None = None
        offset = 0
        for r, n in zip(reqs, num_new, strict=True):
            mm, start = r.mm_inputs, r.num_computed_tokens
            prompt_len = 0 if mm is None else mm.mrope_positions.shape[1]
            if start < prompt_len:  # prompt tokens take their precomputed positions
                k = min(n, prompt_len - start)
                seg = mm.mrope_positions[:, start : start + k]  # [3, k]
                if out3 is None and not ((seg[0] == seg[1]).all() and (seg[0] == seg[2]).all()):
                    out3 = np.broadcast_to(flat, (3, flat.shape[0])).copy()  # image tokens
                if out3 is not None:
                    out3[:, offset : offset + k] = seg
                flat[offset : offset + k] = seg[0]
            offset += n
        return flat if out3 is None else out3

    def inputs_embeds(
        self, reqs: Sequence[ScheduledRequest], input_ids: np.ndarray
    ) -> torch.Tensor | None:
        """[T, hidden] token embeddings with image rows filled in; None if no image token."""
        # (first row in the flat batch, request, image index, first / end token within image)
        spans: list[tuple[int, ScheduledRequest, int, int, int]] = []
        offset = 0
        for r in reqs:
            mm = r.mm_inputs
            start, end = r.num_computed_tokens, r.num_computed_tokens + r.num_new_tokens
            if mm is not None:
                for i, (img_off, img_len) in enumerate(mm.placeholders):
                    lo, hi = max(start, img_off), min(end, img_off + img_len)
                    if lo < hi:
                        spans.append((offset + lo - start, r, i, lo - img_off, hi - img_off))
            offset += r.num_new_tokens
        if not spans:
            return None
        self._encode_missing(spans)
        ids = torch.from_numpy(input_ids).to(self.device, non_blocking=True)
        embeds = self.model.embed_input_ids(ids)  # [T, hidden]
        for row, r, i, lo, hi in spans:
            embeds[row : row + hi - lo] = self.cache[r.mm_inputs.images[i].mm_hash][lo:hi]
        for _, r, i, _, hi in spans:
            image = r.mm_inputs.images[i]
            if hi == image.num_tokens:  # the request has computed all of this image
                self._release(r.req_id, image.mm_hash)
        return embeds

    def free(self, req_ids: Iterable[str]) -> None:
        """Finished or preempted requests drop their claims on cached outputs."""
        for req_id in req_ids:
            for mm_hash in list(self.held.get(req_id, ())):
                self._release(req_id, mm_hash)

    def _encode_missing(self, spans: list[tuple[int, ScheduledRequest, int, int, int]]) -> None:
        # One encoder call per request: its images are what one prompt may hold, the bound
        # the memory profile was taken with.
        todo: dict[str, list[ImageInput]] = {}
        planned: set[str] = set()  # an image shared by requests of this step is encoded once
        for _, r, i, _, _ in spans:
            image = r.mm_inputs.images[i]
            self.users.setdefault(image.mm_hash, set()).add(r.req_id)
            self.held.setdefault(r.req_id, set()).add(image.mm_hash)
            if image.mm_hash not in self.cache and image.mm_hash not in planned:
                planned.add(image.mm_hash)
                todo.setdefault(r.req_id, []).append(image)
        for images in todo.values():
            outputs = self._encode(images)
            for image, out in zip(images, outputs, strict=True):
                self.cache[image.mm_hash] = out

    def _encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        # uint8 pixels cross to the device (a quarter of float32 patches, without the
        # temporal copy); normalization and patch cutting run there.
        pixels = [torch.from_numpy(img.pixels).to(self.device) for img in images]
        pixel_values = torch.cat([patchify(p, self.image_config, self.dtype) for p in pixels])
        embeds = self.model.embed_images(pixel_values, [img.grid_thw for img in images])
        self.num_encoded += len(images)
        return list(embeds.split([img.num_tokens for img in images]))

    def _release(self, req_id: str, mm_hash: str) -> None:
        held = self.held.get(req_id)
        if held is not None:
            held.discard(mm_hash)
            if not held:
                del self.held[req_id]
        users = self.users.get(mm_hash)
        if users is not None:
            users.discard(req_id)
            if not users:
                del self.users[mm_hash]
                self.cache.pop(mm_hash, None)

    # ------------------------------------------------------------------ memory profile

    def profile_grids(self) -> list[tuple[int, int, int]]:
        """Patch grids of the largest images one prompt may carry.

        `limit_per_prompt` images of the largest size `max_pixels` allows, fewer and smaller
        when they could not all fit in `max_model_len` tokens (such prompts are refused).
        """
        cfg = self.image_config
        h, w = cfg.largest_image_hw()
        per_image = cfg.num_tokens(h, w)
        budget = self.max_model_len - 1
        if per_image > budget:  # the largest usable image: a square of at most `budget` tokens
            side = max(1, int(budget**0.5))
            h = w = side * cfg.factor
            per_image = side * side
        count = max(1, min(self.mm_config.limit_per_prompt, budget // per_image))
        return [(1, h // cfg.patch_size, w // cfg.patch_size)] * count

    def profile(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Encoder forward on the largest images; their outputs fill the first rows of the
        returned [T, hidden] embeddings, so they stay alive through the decoder forward."""
        grids = self.profile_grids()
        cfg = self.image_config
        patches = sum(t * h * w for t, h, w in grids)
        pixel_values = torch.zeros(patches, cfg.patch_dim, dtype=self.dtype, device=self.device)
        image_embeds = self.model.embed_images(pixel_values, grids)  # [tokens, hidden]
        embeds = self.model.embed_input_ids(input_ids)
        n = min(embeds.shape[0], image_embeds.shape[0])
        embeds[:n] = image_embeds[:n]
        return embeds

    def estimate_bytes(self, vision_config: Any) -> int:
        """Rough encoder activation peak, for the CPU (no allocator statistics there)."""
        patches = sum(t * h * w for t, h, w in self.profile_grids())
        dim = getattr(vision_config, "embed_dim", None) or vision_config.hidden_size
        inter = getattr(vision_config, "intermediate_size", None) or 4 * dim
        return patches * (8 * dim + 3 * inter) * self.dtype.itemsize
