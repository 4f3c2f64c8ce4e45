"""Attention over the paged KV cache, and the metadata that describes one step's batch.

`Attention` writes this step's K/V into its layer's cache (bound by the runner as
`module.kv_cache`, `[2, num_blocks, block_size, Hkv, D]`) and attends each sequence's queries to
its cached prefix + new tokens. CUDA tensors use the Triton kernels (without Triton: the
graph-safe torch decode and SDPA prefill of `torch_paged.py`), the CPU the torch references.
`attn_metadata=None` means no cache: causal attention over all tokens as one sequence.
A layer built with `sliding_window` W (Mistral) lets query i see keys i - W < j <= i only, on
every path; the window is the layer's, fixed for the model, so captured CUDA graphs keep it.

Decode-only CUDA batches can instead take `forward_fused_decode`, which also applies RoPE: one
kernel reads q/k/v from the QKV output, rotates, writes the cache and attends
(`triton_decode_attention.py`). `use_fused_decode` says when;
`PAGODA_DISABLED_KERNELS=fused_decode_attn` (read once per process) turns it off for A/B runs.
An FP8 cache (`kv_cache_dtype="fp8"`) stores K / k_scale and V / v_scale; every path above reads
and writes it (the fused decode uses the new token's key and value as stored). With
`k_center` set (a [Hkv, D] constant: the runner sets the mean of RoPE(k bias) on Qwen2-family
layers) an FP8 cache stores K - k_center instead: every score of a query then moves by the same
q . k_center, which softmax cancels, while the large near-constant bias channels no longer
dominate e4m3's rounding error (Qwen2.5-Coder-0.5B: +3.08 % perplexity -> +0.60 %).
That kernel also starts the L2 prefetch of its first cache blocks ("kv_prefetch").
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import envs
from pagoda.kernels.attention.reference import (
    FUSED_MAX_QUERY_ROWS,
    FUSED_MAX_VERIFY_SEQS,
    check_sliding_window,
    paged_attention_ref,
    write_kv_cache_ref,
)
from pagoda.kernels.attention.torch_paged import (
    decode_attention_static,
    prefill_attention_sdpa,
    write_kv_cache_static,
)
from pagoda.layers.rotary import MRotaryEmbedding, RotaryEmbedding
from pagoda.platform import triton_available


@dataclass
class AttentionMetadata:
    """Flat batch layout of one step, shared by every attention layer."""

    num_actual_tokens: int  # T; inputs may be padded beyond it (CUDA graphs)
    query_start_loc: torch.Tensor  # [B+1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 (the null block)
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding tokens (not written)
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]  # host copies: the reference path needs no device sync
    seq_lens_cpu: list[int]
    # Split-KV factor for the Triton kernel; None = chosen per call. CUDA graphs fix it at
    # capture time because the automatic choice depends on host values of the step.
    num_splits: int | None = None
    # Set where every sequence has exactly max_query_len new tokens by construction (the
    # speculative verify graphs: 1 + k each), so the fused decode attention may take the step.
    uniform_query_len: bool = False


# `kv_cache_dtype` names (vLLM's): "fp8" is e4m3 (3 mantissa bits, range +-448: needs the
# per-layer scales), e5m2 keeps range (+-57344) for precision and works with scales of 1.0.
KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_log = logging.getLogger("pagoda")


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for `kv_cache_dtype` ("auto": the model's)."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={name!r} is not supported; use auto, {', '.join(KV_CACHE_DTYPES)}"
        )
    return KV_CACHE_DTYPES[name]


def check_kv_cache_dtype(layers: list[Attention], dtype: torch.dtype, device: torch.device) -> None:
    """An FP8 cache on CUDA needs Triton (the no-Triton torch decode reads the cache's own
    dtype): a clear error. e4m3 runs on every CUDA GPU the kernels run on: below sm_89 (no
    Triton e4m3 conversion) they read and write the codes as uint8 (`soft_e4m3`). Without
    calibrated scales (a checkpoint's k_scale / v_scale) e4m3 uses 1.0, with a warning."""
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return
    if device.type == "cuda" and not triton_available():
        raise ValueError(
            "an FP8 KV cache on CUDA needs Triton (pip install triton); use kv_cache_dtype='auto'"
        )
    if dtype != torch.float8_e4m3fn:
        return
    missing = sum(not layer.kv_scales_loaded for layer in layers)
    if missing:
        _log.warning(
            "FP8 (e4m3) KV cache without calibrated scales in %d of %d attention layers: "
            "K and V are stored with scale 1.0 (values beyond +-448 saturate; small ones lose "
            "precision); calibrate them with `pagoda quantize --kv-cache-dtype fp8`",
            missing,
            len(layers),
        )


def decode_only(md: AttentionMetadata) -> bool:
    """One query per sequence and no rows beyond them (CUDA-graph padding rows come as
    1-token sequences): what the graph-safe torch decode path takes."""
    return md.max_query_len == 1 and md.num_actual_tokens == md.seq_lens.shape[0]


@functools.cache
def _triton_kernels() -> tuple[Callable, Callable] | None:
    """(write_kv_cache_triton, paged_attention_triton), or None when Triton is unusable.

    Cached so a failed import is not retried by every layer of every step.
    """
    if not triton_available():
        return None
    from pagoda.kernels.attention.triton_kv_cache_write import write_kv_cache_triton
    from pagoda.kernels.attention.triton_paged_attention import paged_attention_triton

    return write_kv_cache_triton, paged_attention_triton


@functools.cache
def _fused_decode_kernel() -> Callable | None:
    """`fused_decode_attention_triton`, or None when Triton is unusable or the env var is off."""
    if not envs.kernel_enabled("fused_decode_attn"):
        return None
    if not triton_available():
        return None
    from pagoda.kernels.attention.triton_decode_attention import fused_decode_attention_triton

    return fused_decode_attention_triton


@functools.cache
def _kv_prefetch() -> bool:
    """Whether the fused decode attention prefetches its first cache blocks before waiting for
    the QKV projection (sm_90; "kv_prefetch" in PAGODA_DISABLED_KERNELS: off; read once)."""
    return envs.kernel_enabled("kv_prefetch")


class Attention(nn.Module):
    """Multi-head / grouped-query attention of one layer; q, k, v come already projected."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,  # None: full causal attention
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        check_sliding_window(sliding_window)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        # Bound by the model runner once the cache is allocated; a plain attribute, not a
        # buffer, so it is never part of state_dict() nor moved by .to().
        self.kv_cache: torch.Tensor | None = None
        # FP8 cache: K / k_scale and V / v_scale are stored. Set from a checkpoint's
        # `self_attn.k_scale` / `v_scale` (compressed-tensors kv_cache_scheme) by the loader;
        # `kv_scales_loaded` tells the runner whether 1.0 is a default or calibrated.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.kv_scales_loaded = False
        # FP8 cache: [Hkv, D] float32 subtracted from every key before it is stored (module
        # docstring); values representable in the model dtype, so the torch path's
        # subtraction and the fused kernel's float32 one take the same constant. A plain
        # attribute like kv_cache; ignored with a model-dtype cache.
        self.k_center: torch.Tensor | None = None

    def forward(
        self,
        q: torch.Tensor,  # [T, H*D]
        k: torch.Tensor,  # [T, Hkv*D]
        v: torch.Tensor,  # [T, Hkv*D]
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:  # [T, H*D]
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if attn_metadata is None:
            return self._forward_no_cache(q, k, v).reshape(num_tokens, -1)
        if self.kv_cache is None:
            raise RuntimeError("Attention.kv_cache is not bound; the runner must set it first")

        n = attn_metadata.num_actual_tokens
        center = self._center()
        if center is not None:
            k = k - center.to(k.dtype)
        kernels = _triton_kernels() if q.is_cuda else None
        # Padding rows stay zero: their values are never read, but must not be garbage (NaN).
        out = torch.zeros_like(q)  # [T, H, D]
        if kernels is not None:
            write_kv_cache, paged_attention = kernels
            write_kv_cache(
                k[:n], v[:n], self.kv_cache, attn_metadata.slot_mapping[:n], *self._scales()
            )
            paged_attention(
                q[:n],
                self.kv_cache,
                attn_metadata.query_start_loc,
                attn_metadata.seq_lens,
                attn_metadata.block_tables,
                self.scale,
                attn_metadata.max_query_len,
                attn_metadata.max_seq_len,
                out=out[:n],
                num_splits=attn_metadata.num_splits,
                sliding_window=self.sliding_window,
                k_scale=self._scales()[0],
                v_scale=self._scales()[1],
            )
        elif q.is_cuda and decode_only(attn_metadata):
            # No host value of the step is read: the runner captures these steps in CUDA graphs.
            write_kv_cache_static(k[:n], v[:n], self.kv_cache, attn_metadata.slot_mapping[:n])
            out[:n] = decode_attention_static(
                q[:n],
                self.kv_cache,
                attn_metadata.seq_lens,
                attn_metadata.block_tables,
                self.scale,
                self.sliding_window,
            )
        elif q.is_cuda:
            write_kv_cache_ref(k[:n], v[:n], self.kv_cache, attn_metadata.slot_mapping[:n])
            prefill_attention_sdpa(
                q[:n],
                self.kv_cache,
                attn_metadata.query_start_loc_cpu,
                attn_metadata.seq_lens_cpu,
                attn_metadata.block_tables,
                self.scale,
                out=out[:n],
                sliding_window=self.sliding_window,
            )
        else:
            write_kv_cache_ref(
                k[:n], v[:n], self.kv_cache, attn_metadata.slot_mapping[:n], *self._scales()
            )
            paged_attention_ref(
                q[:n],
                self.kv_cache,
                attn_metadata.query_start_loc_cpu,
                attn_metadata.seq_lens_cpu,
                attn_metadata.block_tables,
                self.scale,
                out=out[:n],
                sliding_window=self.sliding_window,
                k_scale=self._scales()[0],
                v_scale=self._scales()[1],
            )
        return out.view(num_tokens, -1)

    def _scales(self) -> tuple[float, float]:
        """(k_scale, v_scale) of an FP8 cache; a model-dtype cache stores K / V as they are,
        whatever scales the checkpoint carries."""
        if self.kv_cache is not None and self.kv_cache.element_size() == 1:
            return self.k_scale, self.v_scale
        return 1.0, 1.0

    def _center(self) -> torch.Tensor | None:
        """`k_center` where the cache is FP8, else None (module docstring)."""
        cache = self.kv_cache
        fp8 = cache is not None and cache.element_size() == 1
        return self.k_center if fp8 else None

    def use_fused_decode(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        rotary_emb: nn.Module | None,
        attn_metadata: AttentionMetadata | None,
    ) -> bool:
        """Whether `forward_fused_decode` may replace RoPE + `forward` for this step.

        Needs a decode-only batch (one token per sequence, no padding rows beyond the
        sequences: CUDA-graph padding comes as 1-token sequences with slot -1) or a verify step
        (`uniform_query_len`: 1 + k tokens per sequence, no sliding window, at most
        `FUSED_MAX_QUERY_ROWS` query rows a KV head and `FUSED_MAX_VERIFY_SEQS` sequences, where
        it measured faster), CUDA tensors, a
        bound cache of q's dtype or FP8, Triton, and a cos/sin-table RoPE with [T] positions: plain
        RoPE, or M-RoPE (Qwen2-VL / Qwen2.5-VL) given [T] positions — the encoder runner's
        decode steps, where every axis holds the same position and M-RoPE is plain RoPE on the
        same table. [3, T] positions (image tokens in the step) never take this path.
        """
        if attn_metadata is None:
            return False
        q_len = attn_metadata.max_query_len
        if q_len > 1 and not (
            attn_metadata.uniform_query_len
            and self.sliding_window is None
            and self.num_heads // self.num_kv_heads * q_len <= FUSED_MAX_QUERY_ROWS
            and attn_metadata.seq_lens.shape[0] <= FUSED_MAX_VERIFY_SEQS
        ):
            return False
        return (
            q.is_cuda
            and self.kv_cache is not None
            and (self.kv_cache.dtype == q.dtype or self.kv_cache.element_size() == 1)
            and type(rotary_emb) in (RotaryEmbedding, MRotaryEmbedding)
            and positions.dim() == 1
            and q.shape[0]
            == attn_metadata.num_actual_tokens
            == attn_metadata.seq_lens.shape[0] * q_len
            and _fused_decode_kernel() is not None
        )

    def forward_fused_decode(
        self,
        positions: torch.Tensor,  # [T]
        q: torch.Tensor,  # [T, H*D], not rotated; a strided view of the QKV output is fine
        k: torch.Tensor,  # [T, Hkv*D], not rotated
        v: torch.Tensor,  # [T, Hkv*D]
        rotary_emb: RotaryEmbedding,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H*D]
        """RoPE + cache write + attention in one kernel; only where `use_fused_decode` holds.

        Same result as `rotary_emb(positions, q, k)` then `forward(q, k, v, attn_metadata)`,
        except that q and k are not rotated in place and rows of padding tokens hold their own
        (finite) attention output instead of zeros.
        """
        kernel = _fused_decode_kernel()
        assert kernel is not None and self.kv_cache is not None
        return kernel(
            positions,
            q,
            k,
            v,
            rotary_emb.cos_cache,
            rotary_emb.sin_cache,
            self.kv_cache,
            attn_metadata.slot_mapping,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            attn_metadata.block_tables,
            self.scale,
            attn_metadata.max_seq_len,
            # a verify step splits the keys by the fused kernel's own choice for its programs
            # (the metadata's factor is the paged attention's, 1 for multi-token queries)
            num_splits=attn_metadata.num_splits if attn_metadata.max_query_len == 1 else None,
            sliding_window=self.sliding_window,
            kv_prefetch=_kv_prefetch(),
            k_scale=self._scales()[0],
            v_scale=self._scales()[1],
            query_len=attn_metadata.max_query_len,
            k_center=self._center(),
        )

    def _forward_no_cache(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:  # [T, H, D]
        # SDPA picks a flash / memory-efficient kernel, so the profiling forward over a full
        # token budget never materialises a [H, T, T] score matrix. K/V are expanded to all
        # heads explicitly because not every fused backend accepts GQA shapes.
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=1)  # [T, H, D]
            v = v.repeat_interleave(group, dim=1)
        num_tokens, window = q.shape[0], self.sliding_window
        mask = None
        if window is not None and num_tokens > window:
            # An explicit [T, T] mask (True = visible) costs T^2 bytes; only built when the
            # window actually cuts something off.
            pos = torch.arange(num_tokens, device=q.device)
            diff = pos[:, None] - pos[None, :]  # query - key
            mask = (diff >= 0) & (diff < window)
        # 4-D [1, H, T, D]: the fused SDPA kernels take no other rank (3-D runs the math
        # fallback, which materializes the [H, T, T] scores)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
        )
        return out[0].transpose(0, 1)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, scale={self.scale:.4g}"
            + (f", sliding_window={self.sliding_window}" if self.sliding_window else "")
        )
