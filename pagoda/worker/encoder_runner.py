"""The vision side of a step for vision-language models: M-RoPE positions and image embeddings.

For every scheduled chunk that covers image- or video-pad tokens, the items' encoder outputs are
looked up in a cache keyed by content hash, or computed (one encoder call per request, inside the
step), and scattered over those tokens' rows of `inputs_embeds`. A chunked prefill may split an
item, so an output stays cached until every request using it has computed all of its tokens.
Positions: a prompt token takes its precomputed [3] M-RoPE position, a later token
index + delta on all axes, so steps without image tokens keep plain [T] positions (CUDA graphs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagoda.config import MultiModalConfig
from pagoda.multimodal.encoder_chunks import split_grids
from pagoda.multimodal.image_processor import ImageProcessorConfig
from pagoda.multimodal.video_processor import VideoOptions, frame_bounds

if TYPE_CHECKING:
    from pagoda.multimodal.inputs import ImageInput
    from pagoda.step import ScheduledRequest


def patchify(
    pixels: torch.Tensor, config: ImageProcessorConfig, dtype: torch.dtype
) -> torch.Tensor:
    """uint8 pixels (on the device) -> pixel_values [patches, 3 * T * P * P] in `dtype`.

    An image [h, w, 3]: the arithmetic of `patchify_reference` (HF's image processor): float64
    rescale, float32 normalize, patches in merge-block-major order, repeated over the temporal
    axis. Video frames [F, h, w, 3] (F a multiple of T): `patchify_video_reference`, rows over
    temporal patches first.
    """
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    device = pixels.device
    frames = pixels if pixels.dim() == 4 else pixels.unsqueeze(0)  # [F, h, w, 3]
    x = (frames.permute(0, 3, 1, 2).double() * config.rescale_factor).float()  # [F, 3, h, w]
    mean = torch.tensor(config.image_mean, dtype=torch.float32, device=device)[:, None, None]
    std = torch.tensor(config.image_std, dtype=torch.float32, device=device)[:, None, None]
    x = (x - mean) / std
    f, c, h, w = x.shape
    gh, gw = h // p, w // p
    if pixels.dim() == 3:  # a still image: its one frame repeated over the temporal patch
        x = x.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        x = x.unsqueeze(5).expand(*x.shape[:5], t, p, p)  # [gh/m, gw/m, m, m, C, T, P, P]
        return x.reshape(gh * gw, c * t * p * p).to(dtype)
    gt = f // t
    x = x.reshape(gt, t, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [gt, gh/m, gw/m, m, m, C, T, P, P]
    return x.reshape(gt * gh * gw, c * t * p * p).to(dtype)


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
        video_options: VideoOptions | None = None,
    ) -> None:
        self.model = model
        self.image_config = image_config
        self.video_options = video_options  # None: the model takes no video
        self.mm_config = mm_config
        self.max_model_len = max_model_len
        self.device = device
        self.dtype = dtype
        self.cache: dict[str, torch.Tensor] = {}  # image hash -> [num_tokens, hidden]
        self.users: dict[str, set[str]] = {}  # image hash -> requests still needing it
        self.held: dict[str, set[str]] = {}  # request id -> hashes it holds
        self.num_encoded = 0  # images and videos run through the encoder (tests, stats)
        self.profile_peak_bytes = 0  # the encoder's activation peak in the memory profile

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
            embeds[row : row + hi - lo] = self.cache[r.mm_inputs.items[i].mm_hash][lo:hi]
        for _, r, i, _, hi in spans:
            image = r.mm_inputs.items[i]
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
            image = r.mm_inputs.items[i]
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
        """Patch grids of `profile_inputs`."""
        return [grid for _, grid in self.profile_inputs()]

    def profile_inputs(self) -> list[tuple[str, tuple[int, int, int]]]:
        """(kind, patch grid) of the largest input one prompt may carry within the limits.

        `limit_per_prompt` images of the largest size `max_pixels` allows, then (for models
        with video) `video_limit_per_prompt` videos of the most tokens the video options allow
        (frame count, per-frame and total pixel bounds); everything within `max_model_len`
        tokens, later items shrunk or dropped to fit (longer prompts are refused).
        """
        cfg = self.image_config
        budget = self.max_model_len - 1
        grids: list[tuple[str, tuple[int, int, int]]] = []
        h, w = cfg.largest_image_hw()
        per_image = cfg.num_tokens(h, w)
        if per_image > budget:  # the largest usable image: a square of at most `budget` tokens
            side = max(1, int(budget**0.5))
            h = w = side * cfg.factor
            per_image = side * side
        count = min(self.mm_config.limit_per_prompt, budget // per_image)
        grids += [("image", (1, h // cfg.patch_size, w // cfg.patch_size))] * count
        budget -= count * per_image
        if self.video_options is not None:
            for _ in range(self.mm_config.video_limit_per_prompt):
                grid = self._largest_video_grid(budget)
                if grid is None:
                    break
                grids.append(("video", grid))
                budget -= grid[0] * grid[1] * grid[2] // cfg.merge_size**2
        if not grids:  # no image allowed: still measure one image of the whole context
            side = max(1, int((self.max_model_len - 1) ** 0.5))
            grids.append(("image", (1, side * cfg.merge_size, side * cfg.merge_size)))
        return grids

    def _largest_video_grid(self, budget: int) -> tuple[int, int, int] | None:
        """The grid of the video with the most tokens (<= budget) the video options allow:
        square frames between the per-frame bounds, up to max_frames of them."""
        cfg, opts = self.image_config, self.video_options
        assert opts is not None
        tp = cfg.temporal_patch_size
        # frames are never smaller than min_pixels (smart_resize scales them up)
        min_side = max(1, math.ceil(math.sqrt(opts.min_pixels) / cfg.factor))
        best: tuple[int, int, int] | None = None
        best_tokens = 0
        for frames in range(tp, opts.max_frames // tp * tp + 1, tp):
            max_pixels = frame_bounds(frames, opts, tp)[1]
            side = max(1, math.isqrt(int(max_pixels)) // cfg.factor)  # merged tokens a side
            side = min(side, math.isqrt(budget // (frames // tp)))
            tokens = frames // tp * side * side
            if side < min_side or tokens <= best_tokens:
                continue
            best_tokens = tokens
            best = (frames // tp, side * cfg.merge_size, side * cfg.merge_size)
        return best

    def profile(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Encoder forward on the largest input; its outputs fill the first rows of the
        returned [T, hidden] embeddings, so they stay alive through the decoder forward.

        On CUDA the encoder's own peak (above what was allocated before it) is recorded in
        `profile_peak_bytes` for the memory report.
        """
        grids = self.profile_grids()
        cfg = self.image_config
        patches = sum(t * h * w for t, h, w in grids)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        pixel_values = torch.zeros(patches, cfg.patch_dim, dtype=self.dtype, device=self.device)
        image_embeds = self.model.embed_images(pixel_values, grids)  # [tokens, hidden]
        if cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - base
            self.profile_peak_bytes = max(self.profile_peak_bytes, peak)
        embeds = self.model.embed_input_ids(input_ids)
        n = min(embeds.shape[0], image_embeds.shape[0])
        embeds[:n] = image_embeds[:n]
        return embeds

    def profile_description(self) -> str:
        """What the memory profile ran through the encoder, in words."""
        p, m = self.image_config.patch_size, self.image_config.merge_size
        parts = []
        for kind, (t, h, w) in self.profile_inputs():
            tokens = t * h * w // m**2
            if kind == "image":
                parts.append(f"image {w * p}x{h * p} ({tokens} tokens)")
            else:
                frames = t * self.image_config.temporal_patch_size
                parts.append(f"video {frames} frames {w * p}x{h * p} ({tokens} tokens)")
        return ", ".join(parts)

    def estimate_bytes(self, vision_config: Any) -> int:
        """Rough encoder activation peak, for the CPU (no allocator statistics there)."""
        # the tower runs a chunk of frames at a time (`split_grids`): the largest chunk counts
        chunks = split_grids(self.profile_grids())
        patches = max(sum(t * h * w for t, h, w in chunk) for chunk in chunks)
        dim = getattr(vision_config, "embed_dim", None) or vision_config.hidden_size
        inter = getattr(vision_config, "intermediate_size", None) or 4 * dim
        estimate = patches * (8 * dim + 3 * inter) * self.dtype.itemsize
        self.profile_peak_bytes = max(self.profile_peak_bytes, estimate)
        return estimate
