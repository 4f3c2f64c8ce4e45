"""Qwen3-VL (dense): a vision transformer with DeepStack features in front of a Qwen3 decoder.

The vision tower embeds 16x16 (x2 frames) patches, adds learned position embeddings resampled
bilinearly to the image's grid, runs full-attention blocks with 2-D RoPE, and merges 2x2
patches into one LLM token; three more mergers turn early blocks' outputs into DeepStack
features that are added to the image tokens' hidden states after the first decoder layers.
`embed_images` returns [tokens, hidden * (1 + deepstack)] (main | features), so the runner's
embedding cache and scatter carry them unchanged; text rows are zero there. The decoder uses
interleaved M-RoPE. Module names are transformers 5's (`model.visual`, `model.language_model`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers.attention import AttentionMetadata
from pagoda.layers.linear import (
    LinearMethodFactory,
)
from pagoda.models.llama import (
    DecoderModel,
    DecoderOptions,
)
from pagoda.models.qwen2_5_vl import (
    QwenVLBase,
    VisionBlock,
    VisionPatchEmbed,
    VisionRotaryEmbedding,
    _full_cu_seqlens,
    _int,
    _Segments,
    _vision_positions,
    vision_linear,
)

_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}


class Qwen3VisionMLP(nn.Module):
    """linear_fc2(act(linear_fc1(x))), with biases."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        act: str,
        linear_method_factory: LinearMethodFactory,
        prefix: str,
    ) -> None:
        super().__init__()
        if act not in _ACTIVATIONS:
            raise NotImplementedError(f"vision hidden_act={act!r} is not supported")
        self.act = _ACTIVATIONS[act]
        self.linear_fc1 = vision_linear(dim, hidden, linear_method_factory, f"{prefix}.linear_fc1")
        self.linear_fc2 = vision_linear(hidden, dim, linear_method_factory, f"{prefix}.linear_fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3PatchMerger(nn.Module):
    """2x2 neighbouring patches -> one LLM token; LayerNorm before the shuffle (main merger)
    or after it (DeepStack mergers)."""

    def __init__(
        self,
        out_dim: int,
        context_dim: int,
        merge_size: int,
        postshuffle_norm: bool,
        linear_method_factory: LinearMethodFactory,
        prefix: str,
    ) -> None:
        super().__init__()
        self.hidden_size = context_dim * merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.hidden_size if postshuffle_norm else context_dim, eps=1e-6)
        size, factory = self.hidden_size, linear_method_factory
        self.linear_fc1 = vision_linear(size, size, factory, f"{prefix}.linear_fc1")
        self.linear_fc2 = vision_linear(size, out_dim, factory, f"{prefix}.linear_fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, E] -> [N / merge**2, out]
        if self.postshuffle_norm:
            x = self.norm(x.view(-1, self.hidden_size))
        else:
            x = self.norm(x).view(-1, self.hidden_size)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def _interpolation_taps(
    grid_thw: Sequence[tuple[int, int, int]], side: int, merge: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners) taps into the side x side position table: indices, weights
    [N, 4] for every patch, in the processor's merge-block-major order, repeated over t."""
    all_idx, all_w = [], []
    for t, h, w in grid_thw:
        hs = torch.linspace(0, side - 1, h)  # float32, as the original implementation
        ws = torch.linspace(0, side - 1, w)
        h0, w0 = hs.int(), ws.int()
        h1, w1 = (h0 + 1).clamp(max=side - 1), (w0 + 1).clamp(max=side - 1)
        dh, dw = (hs - h0)[:, None], (ws - w0)[None, :]  # [h, 1], [1, w]
        idx = torch.stack(
            [
                h0[:, None] * side + w0[None, :],
                h0[:, None] * side + w1[None, :],
                h1[:, None] * side + w0[None, :],
                h1[:, None] * side + w1[None, :],
            ],
            dim=-1,
        )  # [h, w, 4]
        weight = torch.stack(
            [(1 - dh) * (1 - dw), (1 - dh) * dw, dh * (1 - dw), dh * dw], dim=-1
        )  # [h, w, 4]
        shape = (h // merge, merge, w // merge, merge, 4)
        idx = idx.reshape(shape).transpose(1, 2).reshape(-1, 4)
        weight = weight.reshape(shape).transpose(1, 2).reshape(-1, 4)
        all_idx.append(idx.repeat(t, 1))
        all_w.append(weight.repeat(t, 1))
    return torch.cat(all_idx).long(), torch.cat(all_w)


class Qwen3VisionTransformer(nn.Module):
    """HF's `Qwen3VLVisionModel`: returns the merged tokens and the DeepStack features."""

    def __init__(
        self, config: Any, linear_method_factory: LinearMethodFactory, prefix: str = "model.visual"
    ) -> None:
        super().__init__()
        dim = config.hidden_size
        self.patch_size = _int(config.patch_size)
        self.merge_size = config.spatial_merge_size
        self.patch_embed = VisionPatchEmbed(
            self.patch_size, _int(config.temporal_patch_size), config.in_channels, dim, bias=True
        )
        self.pos_embed = nn.Embedding(config.num_position_embeddings, dim)
        self.num_grid_per_side = int(config.num_position_embeddings**0.5)
        rope = getattr(config, "rope_parameters", None) or {}
        self.rotary_pos_emb = VisionRotaryEmbedding(
            dim // config.num_heads, float(rope.get("rope_theta", 10000.0))
        )
        self.blocks = nn.ModuleList(
            VisionBlock(
                dim,
                config.num_heads,
                Qwen3VisionMLP(
                    dim,
                    config.intermediate_size,
                    config.hidden_act,
                    linear_method_factory,
                    f"{prefix}.blocks.{i}.mlp",
                ),
                "layer",
                linear_method_factory,
                f"{prefix}.blocks.{i}",
            )
            for i in range(config.depth)
        )
        out_dim = config.out_hidden_size
        self.merger = Qwen3PatchMerger(
            out_dim, dim, self.merge_size, False, linear_method_factory, f"{prefix}.merger"
        )
        self.deepstack_visual_indexes = list(config.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(
                out_dim,
                dim,
                self.merge_size,
                True,
                linear_method_factory,
                f"{prefix}.deepstack_merger_list.{i}",
            )
            for i in range(len(self.deepstack_visual_indexes))
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]
    ) -> torch.Tensor:
        """[N, C*T*P*P] -> [N / merge**2, out_dim * (1 + deepstack)] (main | features)."""
        device = pixel_values.device
        x = self.patch_embed(pixel_values)  # [N, E]
        idx, weight = _interpolation_taps(grid_thw, self.num_grid_per_side, self.merge_size)
        pos = self.pos_embed(idx.to(device)) * weight.to(device)[:, :, None]  # [N, 4, E]
        x = x + pos.sum(1).to(x.dtype)
        cos, sin = self.rotary_pos_emb(_vision_positions(grid_thw, self.merge_size).to(device))
        segments = _Segments.build(_full_cu_seqlens(grid_thw), device)
        features = []
        for i, block in enumerate(self.blocks):
            x = block(x, segments, cos, sin)
            if i in self.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)]
                features.append(merger(x))
        return torch.cat([self.merger(x), *features], dim=-1)


class Qwen3VLTextModel(DecoderModel):
    """The Qwen3 decoder; DeepStack features ride in `inputs_embeds`' extra columns and are
    added to the hidden states after the first decoder layers (zeros on text tokens)."""

    def forward(
        self,
        input_ids: torch.Tensor | None,  # [T]
        positions: torch.Tensor,  # [T] or [3, T]
        attn_metadata: AttentionMetadata | None,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden * (1 + deepstack)]
    ) -> torch.Tensor:  # [T, hidden]
        hidden_size = self.embed_tokens.weight.shape[1]
        deepstack = None
        if inputs_embeds is not None and inputs_embeds.shape[-1] > hidden_size:
            num_tokens = inputs_embeds.shape[0]
            deepstack = inputs_embeds[:, hidden_size:].view(num_tokens, -1, hidden_size)
            inputs_embeds = inputs_embeds[:, :hidden_size]
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, attn_metadata)
            if deepstack is not None and i < deepstack.shape[1]:
                # HF adds the features to the layer's output (hidden + residual here).
                residual = residual + deepstack[:, i]
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3VLForConditionalGeneration(QwenVLBase):
    """Qwen3-VL (dense): `inputs_embeds` carry the DeepStack columns ([T, hidden * (1 +
    deepstack)]); videos arrive as one (1, h, w) item per temporal patch (the tower attends
    within a frame), with their timestamps as prompt text."""

    def __init__(
        self, hf_config: Any, linear_method_factory: LinearMethodFactory | None = None
    ) -> None:
        super().__init__(hf_config, linear_method_factory)
        self.num_deepstack = len(self.model.visual.deepstack_visual_indexes)

    def build_vision_tower(
        self, linear_method_factory: LinearMethodFactory
    ) -> Qwen3VisionTransformer:
        return Qwen3VisionTransformer(self.hf_config.vision_config, linear_method_factory)

    def build_decoder(self, linear_method_factory: LinearMethodFactory) -> Qwen3VLTextModel:
        text_config = self.hf_config.text_config
        bias = bool(getattr(text_config, "attention_bias", False))
        return Qwen3VLTextModel(
            text_config,
            DecoderOptions(qkv_bias=bias, o_proj_bias=bias, qk_norm=True),
            linear_method_factory,
            prefix="model.language_model",
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden * (1 + deepstack)]: token embeddings, zero DeepStack columns."""
        embeds = self.model.language_model.embed_tokens(input_ids)
        if self.num_deepstack == 0:
            return embeds
        zeros = embeds.new_zeros(embeds.shape[0], embeds.shape[1] * self.num_deepstack)
        return torch.cat([embeds, zeros], dim=-1)
