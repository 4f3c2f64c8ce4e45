"""Qwen2.5-VL and Qwen2-VL: a vision transformer in front of the shared Qwen2 decoder.

The vision tower embeds 14x14 (x2 frames) patches, runs blocks with 2-D rotary attention
(Qwen2.5-VL: windowed, except the `fullatt_block_indexes` blocks; Qwen2-VL: all full) and merges
2x2 patches into one LLM token. The runner scatters those embeddings over the image-pad tokens
via `inputs_embeds` and passes M-RoPE positions [3, T]. Module names mirror transformers 5
(`model.visual`, `model.language_model`, `lm_head`); both that layout and the original release's
(`visual.*`, `model.*`) load by name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers.activation import SiluAndMul
from pagoda.layers.attention import Attention, AttentionMetadata
from pagoda.layers.linear import (
    LinearMethodFactory,
    MergedColumnLinear,
    ReplicatedLinear,
    default_linear_method_factory,
)
from pagoda.layers.norm import RMSNorm
from pagoda.models.llama import (
    DecoderModel,
    DecoderOptions,
    LlamaForCausalLM,
    build_lm_head,
    load_hf_weights,
)
from pagoda.multimodal.encoder_chunks import split_grids

# Original Qwen release / transformers 4.x save layout -> our (transformers 5) module names;
# the same renames as transformers' checkpoint conversion mapping for these models.
_CHECKPOINT_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^visual\."), "model.visual."),
    (re.compile(r"^model\.(?!language_model\.|visual\.)"), "model.language_model."),
)
_VISION_SKIPPED_SUFFIXES = ("rotary_pos_emb.inv_freq",)


# ---------------------------------------------------------------------- vision geometry


@dataclass
class _Segments:
    """Block-diagonal attention layout: tokens [cu[i], cu[i+1]) attend to each other only."""

    cu_seqlens: list[int]
    index: torch.Tensor | None = None  # [B, L] token of each padded slot (None: one segment)
    valid: torch.Tensor | None = None  # [B, L] bool, real (not padding) slots

    @classmethod
    def build(cls, cu_seqlens: list[int], device: torch.device) -> _Segments:
        lens = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:], strict=False)]
        if len(lens) <= 1:
            return cls(cu_seqlens)
        # Pad every segment to the longest: one batched SDPA call instead of one per window.
        longest = max(lens)
        slot = torch.arange(longest)
        valid = slot[None, :] < torch.tensor(lens)[:, None]  # [B, L]
        index = torch.tensor(cu_seqlens[:-1])[:, None] + slot[None, :]
        index = torch.where(valid, index, torch.zeros_like(index))
        return cls(cu_seqlens, index.to(device), valid.to(device))


def _vision_positions(grid_thw: Sequence[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(row, col) of every patch [N, 2], in the processor's merge-block-major order."""
    out = []
    for t, h, w in grid_thw:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(1, 2).reshape(-1)
        cols = cols.reshape(shape).transpose(1, 2).reshape(-1)
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def _full_cu_seqlens(grid_thw: Sequence[tuple[int, int, int]]) -> list[int]:
    """Full attention within each frame of each image."""
    cu = [0]
    for t, h, w in grid_thw:
        for _ in range(t):
            cu.append(cu[-1] + h * w)
    return cu


def _window_index(
    grid_thw: Sequence[tuple[int, int, int]], merge: int, window_size: int, patch_size: int
) -> tuple[torch.Tensor, list[int]]:
    """Merge-unit order that makes each attention window contiguous, and the window bounds.

    HF's `get_vision_window_index`: windows of window_size pixels, i.e.
    window_size / patch / merge merged units a side; edge windows are smaller, empty ones drop.
    """
    unit = merge * merge
    win = window_size // merge // patch_size
    indices: list[torch.Tensor] = []
    cu = [0]
    base = 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = win - gh % win, win - gw % win
        nh, nw = (gh + pad_h) // win, (gw + pad_w) // win
        padded = F.pad(index, (0, pad_w, 0, pad_h), value=-100)
        padded = padded.reshape(t, nh, win, nw, win).permute(0, 1, 3, 2, 4)
        padded = padded.reshape(t, nh * nw, win, win)
        seqlens = (padded != -100).sum([2, 3]).reshape(-1)
        flat = padded.reshape(-1)
        indices.append(flat[flat != -100] + base)
        for n in (seqlens.cumsum(0) * unit + cu[-1]).tolist():
            if n != cu[-1]:  # empty windows (full padding rows / columns) add nothing
                cu.append(n)
        base += t * gh * gw
    return torch.cat(indices), cu


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# ---------------------------------------------------------------------- vision modules


def vision_linear(
    in_features: int, out_features: int, linear_method_factory: LinearMethodFactory, name: str
) -> ReplicatedLinear:
    """A vision linear with bias, its method asked of the factory under its module name (so an
    ignore rule such as `re:.*visual.*` keeps it dense)."""
    return ReplicatedLinear(
        in_features,
        out_features,
        bias=True,
        linear_method=linear_method_factory(name),
        prefix=name,
    )


class VisionPatchEmbed(nn.Module):
    """HF's Conv3d with stride == kernel over pre-cut patches, computed as one matmul.

    The weight keeps the checkpoint's [E, C, T, P, P] shape, so it loads (and could be
    quantization-ignored) by name; a matmul over flattened patches is the same operation.
    Qwen3-VL's has a bias.
    """

    def __init__(
        self,
        patch_size: int,
        temporal_patch_size: int,
        in_channels: int,
        dim: int,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.dim = dim
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(
            torch.empty(dim, in_channels, temporal_patch_size, patch_size, patch_size),
            requires_grad=False,
        )
        self.proj.bias = nn.Parameter(torch.empty(dim), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, C*T*P*P] -> [N, E]
        weight = self.proj.weight
        return F.linear(x.to(weight.dtype), weight.view(self.dim, -1), self.proj.bias)


class VisionRotaryEmbedding(nn.Module):
    """Axial 2-D RoPE: the first half of each head's frequencies by row, the second by column."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        spatial_dim = head_dim // 2
        exponent = torch.arange(0, spatial_dim, 2, dtype=torch.float32) / spatial_dim
        self.register_buffer("inv_freq", 1.0 / (theta**exponent), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [N, 2] (row, col) -> cos, sin [N, head_dim] float32
        freqs = positions[..., None].float() * self.inv_freq.float()  # [N, 2, D/4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)  # [N, D/2]
        freqs = torch.cat([freqs, freqs], dim=-1)  # [N, D]
        return freqs.cos(), freqs.sin()


class VisionAttention(nn.Module):
    """Bidirectional attention within segments (windows or whole images), SDPA."""

    def __init__(
        self, dim: int, num_heads: int, linear_method_factory: LinearMethodFactory, prefix: str
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = vision_linear(dim, 3 * dim, linear_method_factory, f"{prefix}.qkv")
        self.proj = vision_linear(dim, dim, linear_method_factory, f"{prefix}.proj")

    def forward(
        self, x: torch.Tensor, segments: _Segments, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:  # [N, E]
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # [N, H, D]
        # RoPE in float32, as HF's apply_rotary_pos_emb_vision
        cos, sin = cos[:, None], sin[:, None]
        qf, kf = q.float(), k.float()
        q = (qf * cos + _rotate_half(qf) * sin).to(v.dtype)
        k = (kf * cos + _rotate_half(kf) * sin).to(v.dtype)
        if segments.index is None:
            # 4-D inputs: the fused (flash / memory-efficient) SDPA kernels take no others and
            # the math fallback would materialize [H, N, N] scores for a large image.
            qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, N, D]
            out = F.scaled_dot_product_attention(qb, kb, vb, scale=self.scale)
            out = out[0].transpose(0, 1)  # [N, H, D]
        else:
            index, valid = segments.index, segments.valid
            qp, kp, vp = (t[index].transpose(1, 2) for t in (q, k, v))  # [B, H, L, D]
            mask = valid[:, None, None, :]  # padding keys are never attended to
            out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=self.scale)
            out = out.transpose(1, 2)[valid]  # [N, H, D], back in token order
        return self.proj(out.reshape(n, -1))


class VisionSwiGLU(nn.Module):
    """Qwen2.5-VL vision MLP: down(silu(gate(x)) * up(x)), with biases; gate/up fused."""

    def __init__(
        self, dim: int, hidden: int, linear_method_factory: LinearMethodFactory, prefix: str
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(
            dim,
            [hidden, hidden],
            bias=True,
            linear_method=linear_method_factory(f"{prefix}.gate_up_proj"),
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = vision_linear(hidden, dim, linear_method_factory, f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class VisionQuickGeluMLP(nn.Module):
    """Qwen2-VL vision MLP: fc2(quick_gelu(fc1(x)))."""

    def __init__(
        self, dim: int, hidden: int, linear_method_factory: LinearMethodFactory, prefix: str
    ) -> None:
        super().__init__()
        self.fc1 = vision_linear(dim, hidden, linear_method_factory, f"{prefix}.fc1")
        self.fc2 = vision_linear(hidden, dim, linear_method_factory, f"{prefix}.fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(h * torch.sigmoid(1.702 * h))


class VisionBlock(nn.Module):
    """Pre-norm attention + MLP, residual adds in the activation dtype."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp: nn.Module,
        norm: str,
        linear_method_factory: LinearMethodFactory,
        prefix: str,
    ) -> None:
        super().__init__()
        self.norm1 = _vision_norm(norm, dim)
        self.norm2 = _vision_norm(norm, dim)
        self.attn = VisionAttention(dim, num_heads, linear_method_factory, f"{prefix}.attn")
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, segments: _Segments, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), segments, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norm, then 2x2 neighbouring patches concatenated -> MLP -> one LLM token."""

    def __init__(
        self,
        out_dim: int,
        context_dim: int,
        merge_size: int,
        norm: str,
        linear_method_factory: LinearMethodFactory,
        prefix: str,
    ) -> None:
        super().__init__()
        self.hidden_size = context_dim * merge_size**2
        self.ln_q = _vision_norm(norm, context_dim)
        # A ModuleList keeps HF's nn.Sequential names: mlp.0 (Linear), mlp.1 (GELU), mlp.2.
        size, factory = self.hidden_size, linear_method_factory
        self.mlp = nn.ModuleList(
            [
                vision_linear(size, size, factory, f"{prefix}.mlp.0"),
                nn.GELU(),
                vision_linear(size, out_dim, factory, f"{prefix}.mlp.2"),
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, E] -> [N / merge**2, out]
        x = self.ln_q(x).view(-1, self.hidden_size)
        for layer in self.mlp:
            x = layer(x)
        return x


def _vision_norm(kind: str, dim: int) -> nn.Module:
    return RMSNorm(dim, eps=1e-6) if kind == "rms" else nn.LayerNorm(dim, eps=1e-6)


class VisionTransformer(nn.Module):
    """HF's `Qwen2_5_VisionTransformerPretrainedModel` (or Qwen2-VL's, `variant="qwen2"`)."""

    def __init__(
        self,
        config: Any,
        variant: str,
        linear_method_factory: LinearMethodFactory,
        prefix: str = "model.visual",
    ) -> None:
        super().__init__()
        factory = linear_method_factory
        if variant == "qwen2_5":
            dim, out_dim = config.hidden_size, config.out_hidden_size
            self.window_size: int | None = config.window_size
            self.fullatt_block_indexes = set(config.fullatt_block_indexes)
            norm = "rms"
            if config.hidden_act != "silu":
                raise NotImplementedError(
                    f"vision hidden_act={config.hidden_act!r}; only 'silu' is supported"
                )
        else:  # Qwen2-VL: LayerNorm, quick-GELU MLP, full attention everywhere
            dim, out_dim = config.embed_dim, config.hidden_size
            self.window_size = None
            self.fullatt_block_indexes = set(range(config.depth))
            norm = "layer"
        self.patch_size = _int(config.patch_size)
        self.merge_size = config.spatial_merge_size
        self.patch_embed = VisionPatchEmbed(
            self.patch_size, _int(config.temporal_patch_size), config.in_channels, dim
        )
        rope = getattr(config, "rope_parameters", None) or {}
        self.rotary_pos_emb = VisionRotaryEmbedding(
            dim // config.num_heads, float(rope.get("rope_theta", 10000.0))
        )
        blocks = []
        for i in range(config.depth):
            p = f"{prefix}.blocks.{i}"
            if variant == "qwen2_5":
                mlp = VisionSwiGLU(dim, config.intermediate_size, factory, f"{p}.mlp")
            else:
                mlp = VisionQuickGeluMLP(dim, int(dim * config.mlp_ratio), factory, f"{p}.mlp")
            blocks.append(VisionBlock(dim, config.num_heads, mlp, norm, factory, p))
        self.blocks = nn.ModuleList(blocks)
        self.merger = PatchMerger(out_dim, dim, self.merge_size, norm, factory, f"{prefix}.merger")

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]
    ) -> torch.Tensor:
        """pixel_values [N, C*T*P*P] (all images, back to back) -> [N / merge**2, out_dim]."""
        device = pixel_values.device
        x = self.patch_embed(pixel_values)  # [N, E]
        n = x.shape[0]
        cos, sin = self.rotary_pos_emb(_vision_positions(grid_thw, self.merge_size).to(device))
        full = _Segments.build(_full_cu_seqlens(grid_thw), device)
        windowed = full
        order = None
        if self.window_size is not None:
            # Reorder merge units so that every window is contiguous (the merger keeps units
            # together, so its output is put back in order at the end).
            unit = self.merge_size**2
            index, cu_window = _window_index(
                grid_thw, self.merge_size, self.window_size, self.patch_size
            )
            order = index.to(device)
            x = x.view(n // unit, unit, -1)[order].reshape(n, -1)
            cos = cos.view(n // unit, unit, -1)[order].reshape(n, -1)
            sin = sin.view(n // unit, unit, -1)[order].reshape(n, -1)
            windowed = _Segments.build(cu_window, device)
        for i, block in enumerate(self.blocks):
            x = block(x, full if i in self.fullatt_block_indexes else windowed, cos, sin)
        x = self.merger(x)
        if order is not None:
            x = x[torch.argsort(order)]
        return x


def _int(value: Any) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


# ---------------------------------------------------------------------- the VL model


class VLModel(nn.Module):
    """HF's `model.` submodule: the vision tower and the text decoder side by side."""

    def __init__(self, visual: nn.Module, language_model: DecoderModel) -> None:
        super().__init__()
        self.visual = visual
        self.language_model = language_model


class QwenVLBase(nn.Module):
    """What the Qwen-VL models share: `model.visual` beside `model.language_model` (built by
    `build_vision_tower` / `build_decoder`), the LM head, both checkpoint layouts, and the
    runner's interface. `forward` takes token ids or `inputs_embeds`, positions [T] or [3, T].

    For a sequential (layer-by-layer) quantization pipeline the decoder is
    `language_model` (`embed_tokens`, `layers`, `norm`, `rotary_emb`), exactly as for
    `LlamaForCausalLM.model`; text-only calibration may use [T] positions. Every vision linear
    is built through `linear_method_factory("model.visual....")`, so an ignore rule such as
    `re:.*visual.*` keeps the tower unquantized.
    """

    supports_video = True
    # The decoder's fusion tables and name mapping; gate/up also fuse in the vision MLP.
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    _stacked_params = LlamaForCausalLM._stacked_params
    _param_name_and_shard = LlamaForCausalLM._param_name_and_shard

    def __init__(
        self, hf_config: Any, linear_method_factory: LinearMethodFactory | None = None
    ) -> None:
        super().__init__()
        text_config = hf_config.text_config
        self.hf_config = hf_config
        self.config = text_config
        factory = linear_method_factory or default_linear_method_factory
        self.model = VLModel(self.build_vision_tower(factory), self.build_decoder(factory))
        self.image_token_id: int = hf_config.image_token_id
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = build_lm_head(
            text_config,
            factory,
            self.model.language_model.embed_tokens,
            self.tie_word_embeddings,
        )

    def build_vision_tower(self, linear_method_factory: LinearMethodFactory) -> nn.Module:
        """The vision tower of `self.hf_config` (module prefix `model.visual`)."""
        raise NotImplementedError

    def build_decoder(self, linear_method_factory: LinearMethodFactory) -> DecoderModel:
        """The text decoder of `self.hf_config` (module prefix `model.language_model`)."""
        raise NotImplementedError

    def new_vision_tower(self) -> nn.Module:
        """A separate, unquantized tower of this model's shape (on the current default device
        and dtype): what calibration runs images through."""
        return self.build_vision_tower(default_linear_method_factory)

    @property
    def language_model(self) -> DecoderModel:
        return self.model.language_model

    @property
    def visual(self) -> nn.Module:
        return self.model.visual

    def forward(
        self,
        input_ids: torch.Tensor | None,  # [T] int64
        positions: torch.Tensor,  # [T], or [3, T] M-RoPE positions when images are in the step
        attn_metadata: AttentionMetadata | None = None,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: token + image embeddings
    ) -> torch.Tensor:  # [T, hidden]
        return self.model.language_model(input_ids, positions, attn_metadata, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V] f32
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.language_model.layers]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self.model.language_model.embed_tokens(input_ids)

    def embed_images(
        self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]
    ) -> torch.Tensor:
        """[N patches, C*T*P*P] of all images -> [sum of image tokens, hidden] (model dtype).

        The tower runs on chunks of whole frames (`split_grids`): the same result, with its
        activations bounded by a chunk rather than by every image and video of the prompt."""
        visual = self.model.visual
        parts = []
        start = 0
        for grids in split_grids(grid_thw):
            n = sum(t * h * w for t, h, w in grids)
            parts.append(visual(pixel_values[start : start + n].to(visual.dtype), grids))
            start += n
        embeds = parts[0] if len(parts) == 1 else torch.cat(parts)
        return embeds.to(self.model.language_model.embed_tokens.weight.dtype)

    # ------------------------------------------------------------------ checkpoint names

    @staticmethod
    def checkpoint_to_module_name(name: str) -> str:
        """A tensor / module name of either checkpoint layout -> ours (transformers 5's)."""
        for pattern, replacement in _CHECKPOINT_RENAMES:
            name = pattern.sub(replacement, name, count=1)
        return name

    @staticmethod
    def module_to_original_name(name: str) -> str:
        """Ours -> the original release layout (what `save_pretrained` writes)."""
        if name.startswith("model.visual."):
            return name.removeprefix("model.")
        if name.startswith("model.language_model."):
            return "model." + name.removeprefix("model.language_model.")
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors of either layout; returns our fully loaded parameter names.

        Raises ValueError for tensors matching no parameter and for parameters left unloaded.
        """
        return load_hf_weights(
            self, weights, _VISION_SKIPPED_SUFFIXES, rename=self.checkpoint_to_module_name
        )


class Qwen2_5_VLForConditionalGeneration(QwenVLBase):
    """Qwen2.5-VL: the windowed vision tower in front of the Qwen2 decoder."""

    vision_variant = "qwen2_5"

    def build_vision_tower(self, linear_method_factory: LinearMethodFactory) -> VisionTransformer:
        return VisionTransformer(
            self.hf_config.vision_config, self.vision_variant, linear_method_factory
        )

    def build_decoder(self, linear_method_factory: LinearMethodFactory) -> DecoderModel:
        # Qwen2: q/k/v bias, no o_proj bias; `get_rope` builds M-RoPE from `mrope_section`.
        return DecoderModel(
            self.hf_config.text_config,
            DecoderOptions(qkv_bias=True),
            linear_method_factory,
            prefix="model.language_model",
        )


class Qwen2VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """Qwen2-VL: same decoder and M-RoPE; the vision tower has LayerNorm, quick-GELU MLPs and
    full attention in every block."""

    vision_variant = "qwen2"
