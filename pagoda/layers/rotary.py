"""Rotary position embedding (RoPE), neox style (rotate halves) as Hugging Face applies it.

The cos/sin table is built once in float32 for all positions up to `max_position`, then rows are
gathered by position each step (no Python loop over tokens). Supported HF rope types: "default",
"linear" and "llama3" (Llama-3.1/3.2 configs); others raise NotImplementedError. Configs of
transformers >= 5 keep theta and scaling in `rope_parameters`, older ones in `rope_theta` /
`rope_scaling`; `get_rope` reads both. Configs with `mrope_section` (Qwen2-VL, Qwen2.5-VL) get
`MRotaryEmbedding`, which also takes 3-D (temporal, height, width) positions.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagoda.kernels.norm_act import ops as fused_ops

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:  # [D/2] float32
    # Same expression as HF so the float32 values are bit-identical.
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (theta**exponent)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency-dependent interpolation (HF `_compute_llama3_parameters`)."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by the factor, short ones kept, the middle band interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, H*D] and k [T, Hkv*D] at `positions` [T]."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        rope_theta: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        scaling = dict(rope_scaling or {})
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type not in _SUPPORTED_ROPE_TYPES:
            raise NotImplementedError(
                f"rope type {rope_type!r} is not supported; pagoda implements "
                f"{', '.join(_SUPPORTED_ROPE_TYPES)}"
            )
        if scaling.get("partial_rotary_factor", 1.0) != 1.0:
            raise NotImplementedError("partial rotary embeddings are not supported")
        self.head_dim = head_dim
        self.max_position = max_position
        self.rope_theta = rope_theta
        self.rope_type = rope_type

        inv_freq = _base_inv_freq(head_dim, rope_theta)
        if rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.to(positions.device))  # [P, D/2]
        # float32 whatever the model dtype: rows are cast to q's dtype when applied (as HF does).
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [T, heads, D]; cos/sin [T, 1, D/2]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def mean_rotated(self, x: torch.Tensor, num_positions: int) -> torch.Tensor:
        """The mean over positions 0 .. num_positions - 1 of `x` [..., D] rotated as a key at
        that position, in float32: x1 mean(cos) - x2 mean(sin), x2 mean(cos) + x1 mean(sin)."""
        if not 1 <= num_positions <= self.cos_cache.shape[0]:
            raise ValueError(
                f"num_positions must be in 1..{self.cos_cache.shape[0]}, got {num_positions}"
            )
        cos = self.cos_cache[:num_positions].float().mean(0)  # [D/2]
        sin = self.sin_cache[:num_positions].float().mean(0)
        return self._rotate(x.float(), cos, sin)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.is_cuda:  # one Triton kernel rotates q and k in place
            return fused_ops.apply_rotary(
                positions, q, k, self.cos_cache, self.sin_cache, self.head_dim
            )
        num_tokens = positions.shape[0]
        cos = self.cos_cache[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin_cache[positions].to(q.dtype).unsqueeze(1)
        q_rot = self._rotate(q.view(num_tokens, -1, self.head_dim), cos, sin)
        k_rot = self._rotate(k.view(num_tokens, -1, self.head_dim), cos, sin)
        return q_rot.view_as(q), k_rot.view_as(k)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, max_position={self.max_position}, "
            f"theta={self.rope_theta}, type={self.rope_type}"
        )


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (Qwen2-VL): positions [T] as plain RoPE, or [3, T] per axis.

    The D/2 frequencies are split into `mrope_section` = (temporal, height, width) bands; band
    i rotates by the token's position on axis i. Text tokens have equal positions on all axes,
    which is plain RoPE, so decode steps (and CUDA graphs) keep using [T] positions.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        rope_theta: float,
        mrope_section: list[int],
        interleaved: bool = False,
    ) -> None:
        super().__init__(head_dim, max_position, rope_theta)
        if len(mrope_section) != 3 or sum(mrope_section) != head_dim // 2:
            raise ValueError(
                f"mrope_section {list(mrope_section)} must be 3 numbers summing to "
                f"head_dim / 2 = {head_dim // 2}"
            )
        self.mrope_section = [int(n) for n in mrope_section]
        self.interleaved = interleaved
        half = head_dim // 2
        if interleaved:
            # Qwen3-VL: frequency j follows height when j % 3 == 1 and width when j % 3 == 2,
            # within the first 3 * section bands of each; time everywhere else.
            axis = [0] * half
            for j in range(half):
                for a in (1, 2):
                    if j % 3 == a and j < 3 * self.mrope_section[a]:
                        axis[j] = a
        else:  # Qwen2-VL: contiguous bands (time, height, width)
            axis = [a for a, n in enumerate(self.mrope_section) for _ in range(n)]
        self.register_buffer("freq_axis", torch.tensor(axis), persistent=False)  # [D/2]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        num_tokens = positions.shape[1]
        cos, sin = self.token_cos_sin(positions)
        if q.is_cuda:  # the fused kernel gathers rows by position: row t holds token t's angles
            rows = torch.arange(num_tokens, device=positions.device)
            return fused_ops.apply_rotary(rows, q, k, cos, sin, self.head_dim)
        cos = cos.to(q.dtype).unsqueeze(1)  # [T, 1, D/2]
        sin = sin.to(q.dtype).unsqueeze(1)
        q_rot = self._rotate(q.view(num_tokens, -1, self.head_dim), cos, sin)
        k_rot = self._rotate(k.view(num_tokens, -1, self.head_dim), cos, sin)
        return q_rot.view_as(q), k_rot.view_as(k)

    def token_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] -> per-token cos, sin [T, D/2] float32."""
        cos_axes = self.cos_cache[positions]  # [3, T, D/2]
        sin_axes = self.sin_cache[positions]
        # Each frequency takes the angle of its own axis (HF's mrope_section split).
        half = cos_axes.shape[-1]
        index = self.freq_axis.to(positions.device).view(1, 1, half)
        index = index.expand(1, cos_axes.shape[1], half)
        cos = torch.gather(cos_axes, 0, index)[0]  # [T, D/2]
        sin = torch.gather(sin_axes, 0, index)[0]
        return cos, sin

    def extra_repr(self) -> str:
        return (
            super().extra_repr()
            + f", mrope_section={self.mrope_section}, interleaved={self.interleaved}"
        )


def rope_params_from_config(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from an HF config of transformers 4.x or 5.x."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params) if params else {}
    theta = params.pop("rope_theta", None) or getattr(config, "rope_theta", None) or 10000.0
    rope_type = params.get("rope_type") or params.get("type") or "default"
    return float(theta), (params if rope_type != "default" else None)


def get_rope(config: Any, head_dim: int) -> RotaryEmbedding:
    """The RotaryEmbedding an HF decoder config describes."""
    theta, scaling = rope_params_from_config(config)
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    mrope_section = (params or {}).get("mrope_section")
    if mrope_section:  # Qwen2-VL configs say rope_type "default" (5.x) or "mrope" (4.x)
        interleaved = bool((params or {}).get("mrope_interleaved", False))
        return MRotaryEmbedding(
            head_dim, config.max_position_embeddings, theta, mrope_section, interleaved
        )
    return RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling)
