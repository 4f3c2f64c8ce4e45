"""The kernel registry of weight-only quantized linears (W4A16 / W8A16).

Each kernel is a class: `can_implement(KernelConfig) -> (ok, reason)` for a device, shape, bit
width, zero point, group size, activation dtype and M range; `prepare(layer, weight)` (its
weight layout, made once at load and shared by the kernels of that layout) and `apply`. At load
`choose_kernels` fixes one small dispatch table per layer: by M range, the first kernel of the
priority list that can, all of one layout (one copy of the weights). `PAGODA_DISABLED_KERNELS`
removes kernels by name for A/B runs. Triton modules are imported only inside prepare / apply.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from pagoda import envs, platform
from pagoda.kernels.wna16.reference import large_m_threshold
from pagoda.quant.dequant import dequantize_weight
from pagoda.quant.packing import pack_to_int32, unpack_from_int32
from pagoda.quant.weights import UnpackedWeight


@dataclass(frozen=True)
class KernelConfig:
    """What a kernel must handle for one layer: y[M, n] = x[M, k] @ W^T, M in [min_m, max_m]."""

    device_type: str  # "cuda" | "cpu"
    device_index: int  # CUDA device index (0 on the CPU)
    capability: tuple[int, int]  # (0, 0) on the CPU
    num_sms: int  # 0 on the CPU
    device_name: str  # the GPU's name (tuned-config tables are per GPU); "" on the CPU
    n: int  # out features
    k: int  # in features
    bits: int
    has_zero_point: bool
    group_size: int  # columns per group (k: one group per output channel)
    act_dtype: torch.dtype
    min_m: int = 1
    max_m: int | None = None  # None: unbounded

    def __post_init__(self) -> None:
        if self.min_m < 1 or (self.max_m is not None and self.max_m < self.min_m):
            raise ValueError(f"bad M range [{self.min_m}, {self.max_m}]")

    @property
    def per_channel(self) -> bool:
        return self.group_size >= self.k

    def rows(self, lo: int, hi: int | None) -> KernelConfig:
        return dataclasses.replace(self, min_m=lo, max_m=hi)


def kernel_config(layer: nn.Module, bits: int, has_zero_point: bool, device) -> KernelConfig:
    """The `KernelConfig` of a loaded layer on `device` (M range: every M)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    index = (
        (device.index if device.index is not None else torch.cuda.current_device()) if cuda else 0
    )
    return KernelConfig(
        device_type=device.type,
        device_index=index,
        capability=platform.capability(device),
        num_sms=platform.num_sms(device) if cuda else 0,
        device_name=torch.cuda.get_device_name(index) if cuda else "",
        n=layer.out_features,
        k=layer.in_features,
        bits=bits,
        has_zero_point=has_zero_point,
        group_size=layer.wna16_group_size,
        act_dtype=layer.params_dtype,
    )


def _within(cfg: KernelConfig, max_rows: int | None) -> bool:
    return max_rows is None or (cfg.max_m is not None and cfg.max_m <= max_rows)


# ---------------------------------------------------------------- layouts


class WNA16Kernel:
    """One kernel: hard limits (`can_implement`, `max_rows`), its measured best range
    (`best_min_m` .. `best_max_m`: where it beats the later kernels of its layout) and its
    layout."""

    name: ClassVar[str]
    layout: ClassVar[str]
    max_rows: ClassVar[int | None] = None  # largest M it can run (None: any)

    @classmethod
    def can_implement(cls, cfg: KernelConfig) -> tuple[bool, str]:
        if not _within(cfg, cls.max_rows):
            return False, f"M up to {cls.max_rows} only"
        return cls.supports(cfg)

    @classmethod
    def supports(cls, cfg: KernelConfig) -> tuple[bool, str]:
        """Everything but the M range: device, shape, bits, zero point, group, dtype."""
        raise NotImplementedError

    @classmethod
    def best_max_m(cls, cfg: KernelConfig) -> int | None:
        return cls.max_rows

    @classmethod
    def best_min_m(cls, cfg: KernelConfig) -> int:
        """The M from which it is the best of its layout (a kernel earlier in the priority
        list that starts later takes over from the ones after it)."""
        return 1

    @staticmethod
    def prepare(layer: nn.Module, w: UnpackedWeight) -> None:
        raise NotImplementedError

    @staticmethod
    def dequantize(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(signed codes [out, in], scale [out, groups], zero point [out, groups] or None)."""
        raise NotImplementedError

    @classmethod
    def apply(
        cls, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, bool]:
        """(x @ W^T [M, n], whether `bias` is already added)."""
        raise NotImplementedError


def _fusable(bias: torch.Tensor | None, x: torch.Tensor) -> bool:
    return bias is not None and bias.dtype == x.dtype and bias.is_contiguous()


def _param(layer: nn.Module, name: str, data: torch.Tensor) -> None:
    p = nn.Parameter(data, requires_grad=False)
    p.output_dim = None
    p.output_pack_factor = 1
    layer.register_parameter(name, p)


class _CodesLayout(WNA16Kernel):
    """int8 codes [out, in] + scales / zeros [out, groups] (1 byte per weight)."""

    layout = "dequant"

    @staticmethod
    def prepare(layer: nn.Module, w: UnpackedWeight) -> None:
        dtype = layer.params_dtype
        _param(layer, "codes", w.codes.contiguous())  # [out, in] int8
        _param(layer, "scales", w.scale.to(dtype).contiguous())  # [out, groups]
        if w.zero_point is not None:
            _param(layer, "zeros", w.zero_point.to(dtype).contiguous())  # [out, groups]
        else:
            layer.zeros = None

    @staticmethod
    def dequantize(layer):
        return layer.codes, layer.scales, layer.zeros


class TorchDequant(_CodesLayout):
    """Any device: dequantize per call (one broadcast multiply), then a dense matmul."""

    name = "torch_dequant"

    @classmethod
    def supports(cls, cfg):
        return True, ""

    @classmethod
    def apply(cls, layer, x, bias):
        return torch.nn.functional.linear(x, dense_weight(layer, x.dtype), bias), True


class _PackedLayout(WNA16Kernel):
    """`qweight_t` [in / f, out] int32 packed along the input (f = 32 / bits), `scales_t`
    [groups, out] and optional `zeros_t` [groups, out] (2^(bits-1) + zero point, as float)."""

    layout = "triton"

    @classmethod
    def supports(cls, cfg: KernelConfig) -> tuple[bool, str]:
        if cfg.device_type != "cuda":
            return False, "needs a CUDA device"
        if not platform.triton_available():
            return False, "triton not installed"
        if not cfg.per_channel and cfg.group_size % 16:
            return False, "tl.dot needs K tiles of >= 16 inside one group"
        if cfg.bits not in (4, 8):
            return False, f"bits={cfg.bits}"
        return True, ""

    @staticmethod
    def prepare(layer: nn.Module, w: UnpackedWeight) -> None:
        bits, dtype = layer.wna16_bits, layer.params_dtype
        offset = 1 << (bits - 1)
        _param(layer, "qweight_t", pack_to_int32(w.codes, bits, 1).t().contiguous())
        _param(layer, "scales_t", w.scale.t().to(dtype).contiguous())  # [groups, out]
        if w.zero_point is not None:
            # The kernels read unsigned codes u = q + offset: w = (u - (offset + zp)) * s.
            zeros_t = (w.zero_point.t().to(torch.float32) + offset).to(dtype).contiguous()
            _param(layer, "zeros_t", zeros_t)
        else:
            layer.zeros_t = None

    @staticmethod
    def dequantize(layer):
        bits = layer.wna16_bits
        q = unpack_from_int32(layer.qweight_t.data, bits, layer.in_features, 0).t()
        zp = None
        if layer.zeros_t is not None:
            zp = layer.zeros_t.t().to(torch.float32) - (1 << (bits - 1))
        return q, layer.scales_t.t(), zp

    @staticmethod
    def _weights(layer):
        """(qweight_t, scales_t, zeros_t, group_size, bits): what every packed kernel takes."""
        return (
            layer.qweight_t,
            layer.scales_t,
            layer.zeros_t,
            layer.wna16_group_size,
            layer.wna16_bits,
        )


class TritonGemv(_PackedLayout):
    """Split-K Triton GEMV (decode, M <= 16)."""

    name = "triton_gemv"
    max_rows = 16

    @classmethod
    def apply(cls, layer, x, bias):
        from pagoda.kernels.wna16.triton_w4a16 import wna16_gemv

        fused = _fusable(bias, x)
        workspace = getattr(layer, "split_k_workspace", None)  # bound by the model runner
        out = wna16_gemv(x, *cls._weights(layer), bias=bias if fused else None, workspace=workspace)
        return out, fused


def _large_m(cfg: KernelConfig) -> int:
    """The M from which dequant + cuBLAS beats the Triton GEMM (`large_m_threshold`)."""
    from pagoda.kernels.wna16.triton_w4a16 import _tuned_gemm_table

    key = (cfg.n, cfg.k, cfg.group_size, cfg.bits)
    tuned = key in _tuned_gemm_table(cfg.device_name)
    return large_m_threshold(cfg.n, cfg.k, cfg.bits, cfg.num_sms, gemm_tuned=tuned)


class TritonGemm(_PackedLayout):
    """Triton dequant-GEMM (tl.dot on exact integer codes), up to `large_m_threshold`."""

    name = "triton_gemm"

    @classmethod
    def best_max_m(cls, cfg):
        return _large_m(cfg) - 1

    @classmethod
    def apply(cls, layer, x, bias):
        from pagoda.kernels.wna16.triton_w4a16 import wna16_gemm

        return wna16_gemm(x, *cls._weights(layer)), False


class TritonDequantCublas(_PackedLayout):
    """One bandwidth-bound pass into a scratch weight, then cuBLAS (large M)."""

    name = "triton_dequant"

    @classmethod
    def apply(cls, layer, x, bias):
        from pagoda.kernels.wna16.triton_w4a16 import wna16_dequant_linear

        return wna16_dequant_linear(x, *cls._weights(layer)), False


_MMA_LARGE_LAYER = 64 << 20  # weights (7B gate_up, down): the MMA GEMM wins M = 33-128
_MMA_MEDIUM_LAYER = 12 << 20  # (7B qkv, o): M = 33-64


class _MmaLayout(WNA16Kernel):
    """The tensor-core layout of `triton_w4a16_mma` (`mma_words`, `mma_scales`): 4-bit, bf16,
    sm_80+ (`mma.sync`), where its self-test passed on this device."""

    layout = "mma"

    @classmethod
    def supports(cls, cfg: KernelConfig) -> tuple[bool, str]:
        if cfg.device_type != "cuda" or cfg.capability < (8, 0):
            return False, "needs CUDA sm_80+ (mma.sync bf16)"
        if not platform.triton_available():
            return False, "triton not installed"
        if cfg.act_dtype != torch.bfloat16:
            return False, f"activations are {cfg.act_dtype}, the MMA kernels take bf16"
        from pagoda.kernels.wna16.triton_w4a16_mma import mma_self_test, mma_supported

        if not mma_supported(cfg.n, cfg.k, cfg.group_size, cfg.bits, cfg.has_zero_point):
            return False, "shape, bits or zero point not supported by the MMA layout"
        if not mma_self_test(cfg.device_index):
            return False, "self-test failed on this device"
        return True, ""

    @staticmethod
    def prepare(layer: nn.Module, w: UnpackedWeight) -> None:
        from pagoda.kernels.wna16.triton_w4a16_mma import (
            repack_mma,
            repack_mma_scales,
            repack_mma_zeros,
        )

        scale_t = w.scale.t().to(layer.params_dtype).contiguous()  # [groups, out]
        _param(layer, "mma_words", repack_mma(w.codes.to(torch.int32) + 8))
        _param(layer, "mma_scales", repack_mma_scales(scale_t))
        if w.zero_point is not None:  # unsigned zero codes z = zero point + 8
            _param(layer, "mma_zeros", repack_mma_zeros(w.zero_point.t().to(torch.int32) + 8))
        else:
            layer.mma_zeros = None

    @staticmethod
    def dequantize(layer):
        from pagoda.kernels.wna16.triton_w4a16_mma import (
            unpack_mma,
            unpack_mma_scales,
            unpack_mma_zeros,
        )

        n, k = layer.out_features, layer.in_features
        q = (unpack_mma(layer.mma_words.data, n, k).to(torch.int16) - 8).to(torch.int8)
        zp = None
        if layer.mma_zeros is not None:
            zp = (unpack_mma_zeros(layer.mma_zeros.data) - 8).t()
        return q, unpack_mma_scales(layer.mma_scales.data).t(), zp


def _mma_apply(kernel, layer: nn.Module, x: torch.Tensor, bias, **kw):
    """(y, bias added) of an MMA-layout kernel taking (x, words, scales, n, group, bias, zeros)."""
    fused = _fusable(bias, x)
    out = kernel(
        x,
        layer.mma_words,
        layer.mma_scales,
        layer.out_features,
        layer.wna16_group_size,
        bias=bias if fused else None,
        zero_pairs=layer.mma_zeros,
        **kw,
    )
    return out, fused


class _HopperGemm(_MmaLayout):
    """A Gluon wgmma GEMM on the MMA layout (sm_90): `module` holds `entry` (the kernel's
    call, taking the runner's split-K workspace), `available()` (the Gluon features it needs)
    and `shape_ok(n, k, group)`; `needs` / `shapes` say what a refusal lacks."""

    module: ClassVar[str]
    entry: ClassVar[str]
    available: ClassVar[str]
    shape_ok: ClassVar[str]
    needs: ClassVar[str]
    shapes: ClassVar[str]

    @classmethod
    def supports(cls, cfg):
        if cfg.capability != (9, 0):
            return False, f"needs sm_90 ({cls.needs})"
        ok, why = super().supports(cfg)
        if not ok:
            return ok, why
        import importlib

        mod = importlib.import_module(cls.module)
        if not getattr(mod, cls.available)():
            return False, f"Triton without Gluon's {cls.needs}"
        if not getattr(mod, cls.shape_ok)(cfg.n, cfg.k, cfg.group_size):
            return False, f"{cls.shapes}, K % 64 and whole 64-K groups needed"
        return True, ""

    @classmethod
    def apply(cls, layer, x, bias):
        import importlib

        kernel = getattr(importlib.import_module(cls.module), cls.entry)
        workspace = getattr(layer, "split_k_workspace", None)
        return _mma_apply(kernel, layer, x, bias, workspace=workspace)


class MmaWgmmaTma(_HopperGemm):
    """Hopper `wgmma` GEMM fed by bulk tensor copies (TMA) from a producer warp, 128 weight rows
    a CTA (`gluon_wgmma_tma`). First in the priority list; its band, where it is the best
    kernel (BENCHMARKS.md, W4A16 kernels, H200): gate_up-sized layers (N >= 16 Ki) 17-512
    rows; down projections (K >= 4 N) 33-512 at N >= 3 Ki (7B), 65-256 below (3B, with the
    tuned table); other layers of N >= 4 Ki (7B qkv) 33-64. Elsewhere the cp.async wgmma
    GEMM (to 64 / 128 rows), then dequant + cuBLAS."""

    name = "mma_wgmma_tma"
    module = "pagoda.kernels.wna16.gluon_wgmma_tma"
    entry = "wna16_wgmma_tma"
    available = "gluon_tma_available"
    shape_ok = "tma_supported"
    needs = "wgmma, TMA and warp specialization"
    shapes = "N % 16"

    @classmethod
    def _band(cls, cfg) -> tuple[int, int]:
        if cfg.n >= 16384:
            return 17, 512
        if cfg.k >= 4 * cfg.n:
            return (33, 512) if cfg.n >= 3072 else (65, 256)
        return (33, 64) if cfg.n >= 4096 else (1, 0)

    @classmethod
    def best_min_m(cls, cfg):
        return cls._band(cfg)[0]

    @classmethod
    def best_max_m(cls, cfg):
        return cls._band(cfg)[1]


class MmaGemv(_MmaLayout):
    """Tensor-core GEMV (mma.sync, blocks of 8 rows): best up to 32 rows, runs up to 64."""

    name = "mma_gemv"
    max_rows = 64

    @classmethod
    def best_max_m(cls, cfg):
        return 32

    @classmethod
    def apply(cls, layer, x, bias):
        from pagoda.kernels.wna16.triton_w4a16_mma import wna16_mma_gemv

        workspace = getattr(layer, "split_k_workspace", None)
        return _mma_apply(wna16_mma_gemv, layer, x, bias, workspace=workspace)


class MmaWgmma(_HopperGemm):
    """Hopper `wgmma` GEMM on the MMA layout (the weight dequantized in registers as the
    register operand, cp.async into shared memory, `gluon_mma_wgmma`): best from 9 to 64 rows,
    to 128 on layers of >= 16 Ki output columns (gate_up) and on down projections (K >= 4 N)
    where the TMA GEMM, earlier in the priority list, is not there (BENCHMARKS.md, W4A16
    kernels). The GEMV keeps M <= 8."""

    name = "mma_wgmma"
    module = "pagoda.kernels.wna16.gluon_mma_wgmma"
    entry = "wna16_mma_wgmma"
    available = "gluon_available"
    shape_ok = "wgmma_supported"
    needs = "wgmma"
    shapes = "N % 64"

    @classmethod
    def best_min_m(cls, cfg):
        return 9

    @classmethod
    def best_max_m(cls, cfg):
        return 128 if cfg.n >= 16384 or cfg.k >= 4 * cfg.n else 64


class MmaGemm(_MmaLayout):
    """Tensor-core GEMM on the MMA layout (dequantization in registers, `tl.dot`): preferred
    past the GEMV's 32 rows up to 128 on layers of >= 64 Mi weights and up to 64 on layers of
    >= 12 Mi; dequant + cuBLAS beat it on the smaller layers and above (BENCHMARKS.md)."""

    name = "mma_gemm"

    @classmethod
    def best_max_m(cls, cfg):
        if cfg.n * cfg.k >= _MMA_LARGE_LAYER:
            return 128
        return 64 if cfg.n * cfg.k >= _MMA_MEDIUM_LAYER else 0

    @classmethod
    def apply(cls, layer, x, bias):
        from pagoda.kernels.wna16.triton_w4a16_mma import wna16_mma_gemm

        return _mma_apply(wna16_mma_gemm, layer, x, bias)


class MmaDequantCublas(_MmaLayout):
    """The exact dense weight from the MMA layout, then cuBLAS (its epilogue adds the bias)."""

    name = "mma_dequant"

    @classmethod
    def apply(cls, layer, x, bias):
        from pagoda.kernels.wna16.triton_w4a16_mma import wna16_mma_dequant

        n, k, group = layer.out_features, layer.in_features, layer.wna16_group_size
        w = wna16_mma_dequant(layer.mma_words, layer.mma_scales, n, k, group, layer.mma_zeros)
        fused = _fusable(bias, x)
        return torch.nn.functional.linear(x, w.to(x.dtype), bias if fused else None), fused


_INT4PACK_GROUPS = (32, 64, 128, 256)  # the group sizes `_weight_int4pack_mm` takes


def _int4pack_group(cfg_k: int, group_size: int) -> int | None:
    """The kernel's group size for a layer (a per-channel scale is repeated over groups of the
    largest size dividing K), or None if it takes none."""
    if group_size < cfg_k:
        return group_size if group_size in _INT4PACK_GROUPS and cfg_k % group_size == 0 else None
    return next((g for g in reversed(_INT4PACK_GROUPS) if cfg_k % g == 0), None)


def _inner_k_tiles(k: int) -> int:
    """The packing's K tiles per 32-bit word group (8, 4 or 2; K must hold whole tiles)."""
    return next(t for t in (8, 4, 2) if k % (t * 16) == 0)


def int4pack_weight(
    codes: torch.Tensor,  # [N, K] int8 signed 4-bit codes q in [-8, 7]
    scale: torch.Tensor,  # [N, groups]
    zero_point: torch.Tensor | None,  # [N, groups] integer (signed), None when symmetric
    group: int,  # the kernel's group size (a multiple of the checkpoint's groups, see above)
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, scales-and-zeros [K / group, N, 2]) of PyTorch's int4 matmul.

    `_weight_int4pack_mm` computes w = (u - 8) * scale + zero from unsigned codes u in [0, 15];
    compressed-tensors (and pagoda's `UnpackedWeight`, AutoAWQ's converted alike) mean
    w = (q - zp) * scale with signed q. So u = q + 8 (exact) and zero = -zp * scale, taken in
    float32 and rounded once to `dtype`: |error| <= 8 * scale * 2^-8 = scale / 32 in bf16, and
    0 exactly when symmetric. The CPU build packs int32 [N, K] codes, the CUDA one uint8
    [N, K / 2] pairs with the even column in the high nibble.
    """
    n, k = codes.shape
    per = k // scale.shape[1]  # checkpoint columns per scale
    reps = per // group  # kernel groups per checkpoint group (> 1 only per channel)
    s = scale.to(torch.float32).repeat_interleave(reps, dim=1)  # [N, K / group]
    zero = torch.zeros_like(s)
    if zero_point is not None:
        zero = -zero_point.to(torch.float32).repeat_interleave(reps, dim=1) * s
    scales_zeros = torch.stack([s.t(), zero.t()], dim=-1).to(dtype).contiguous()  # [G, N, 2]
    u = codes.to(torch.int32) + 8  # [N, K] in [0, 15]
    tiles = _inner_k_tiles(k)
    if codes.device.type == "cpu":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.contiguous(), tiles)
    else:
        pairs = ((u[:, ::2] << 4) | u[:, 1::2]).to(torch.uint8).contiguous()  # [N, K / 2]
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
    return packed, scales_zeros


def int4pack_mm(
    x: torch.Tensor,  # [M, K] bf16
    packed: torch.Tensor,
    group: int,
    scales_zeros: torch.Tensor,  # [K / group, N, 2]
) -> torch.Tensor:  # [M, N]
    """x @ W^T through PyTorch's int4 kernel of x's device."""
    if x.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)
    return torch.ops.aten._weight_int4pack_mm(x, packed, group, scales_zeros)


class TorchInt4pack(WNA16Kernel):
    """PyTorch's own int4 matmul (`_weight_int4pack_mm`, CUDA sm_80+, bf16, every M): 4-bit
    weights read once per step, no Triton needed (Jetson). After the Triton layouts: the
    registry picks it where they are absent or cannot run the layer. `int4pack` [packed],
    `int4pack_sz` [K / group, N, 2] (scale, zero)."""

    name = "torch_int4mm"
    layout = "int4pack"

    @classmethod
    def supports(cls, cfg):
        if cfg.device_type != "cuda" or cfg.capability < (8, 0):
            return False, "needs CUDA sm_80+ (PyTorch's int4 matmul)"
        if cfg.bits != 4:
            return False, f"bits={cfg.bits}, the int4 matmul takes 4"
        if cfg.act_dtype != torch.bfloat16:
            return False, f"activations are {cfg.act_dtype}, the int4 matmul takes bf16"
        if cfg.n % 8 or cfg.k % 32:
            return False, "needs N % 8 and K % 32"
        if _int4pack_group(cfg.k, cfg.group_size) is None:
            return False, f"group {cfg.group_size}: the int4 matmul takes 32, 64, 128 or 256"
        return True, ""

    @staticmethod
    def prepare(layer: nn.Module, w: UnpackedWeight) -> None:
        k = layer.in_features
        group = _int4pack_group(k, layer.wna16_group_size)
        assert group is not None, "supports() refused this layer"
        packed, sz = int4pack_weight(w.codes, w.scale, w.zero_point, group, layer.params_dtype)
        _param(layer, "int4pack", packed)
        _param(layer, "int4pack_sz", sz)
        layer.int4pack_group = group
        layer.int4pack_zero_point = w.zero_point is not None

    @staticmethod
    def dequantize(layer):
        """The codes back from the kernel itself (identity rows, 256 columns a call): exact,
        since each weight's bf16 error is below half a scale step."""
        n, k = layer.out_features, layer.in_features
        group, sz = layer.int4pack_group, layer.int4pack_sz
        s = sz[..., 0].t().to(torch.float32)  # [N, K / group]
        zero = sz[..., 1].t().to(torch.float32)
        rows = torch.arange(k, device=sz.device)
        cols = []  # [<=256, N] rows of W^T, one identity slice at a time
        for i in range(0, k, 256):
            eye = torch.nn.functional.one_hot(rows[i : i + 256], k).to(sz.dtype)
            cols.append(int4pack_mm(eye, layer.int4pack, group, sz))
        w = torch.cat(cols).t().to(torch.float32).view(n, k // group, group)
        q = torch.round((w - zero.unsqueeze(-1)) / s.unsqueeze(-1)).view(n, k).to(torch.int8)
        keep = 1 if layer.wna16_group_size >= k else k // group  # per channel: one column
        zp = torch.round(-zero / s)[:, :keep] if layer.int4pack_zero_point else None
        return q, s[:, :keep], zp

    @classmethod
    def apply(cls, layer, x, bias):
        out = int4pack_mm(x.contiguous(), layer.int4pack, layer.int4pack_group, layer.int4pack_sz)
        return out, False


# Priority order: layouts first to last, kernels within a layout first to last.
KERNELS: tuple[tuple[type[WNA16Kernel], ...], ...] = (
    (MmaWgmmaTma, MmaWgmma, MmaGemv, MmaGemm, MmaDequantCublas),
    (TritonGemv, TritonGemm, TritonDequantCublas),
    (TorchInt4pack,),
    (TorchDequant,),
)
KERNEL_NAMES = tuple(k.name for layout in KERNELS for k in layout)


# ---------------------------------------------------------------- choosing


@dataclass(frozen=True)
class KernelTable:
    """A layer's dispatch: `entries[i] = (max_m, kernel)` by increasing M (last max_m None)."""

    layout: str
    entries: tuple[tuple[int | None, type[WNA16Kernel]], ...]

    def pick(self, m: int) -> type[WNA16Kernel]:
        for max_m, kernel in self.entries:
            if max_m is None or m <= max_m:
                return kernel
        raise AssertionError("the last entry covers every M")

    def describe(self) -> str:
        lo, parts = 1, []
        for max_m, kernel in self.entries:
            parts.append(f"{kernel.name} M={lo}..{'' if max_m is None else max_m}")
            lo = (max_m or 0) + 1
        return ", ".join(parts)


def _cover(cfg: KernelConfig, kernels: list[type[WNA16Kernel]]) -> KernelTable | str:
    """The dispatch table of one layout's enabled kernels, or why they cannot cover every M:
    at each M the first kernel (priority order) whose best range holds M, else the first that
    runs there. Past every finite bound the choice no longer changes, so M = 1 .. that bound
    + 1 decides the table, the last entry open-ended."""
    # only kernels that can run here are asked for their ranges (a range may need Triton)
    # (asked once each: past `supports`, whether a kernel runs at M is its row limit alone)
    usable = [k for k in kernels if k.supports(cfg)[0]]
    ranges = {k: (k.max_rows, k.best_min_m(cfg), k.best_max_m(cfg)) for k in usable}
    bounds = [1] + [b for r in ranges.values() for b in r if b is not None]
    last = max(bounds) + 1
    choice = []
    for m in range(1, last + 1):
        runnable = [k for k, (rows, _, _) in ranges.items() if rows is None or m <= rows]
        if not runnable:
            why = "; ".join(f"{k.name}: {k.can_implement(cfg.rows(m, m))[1]}" for k in kernels)
            return f"nothing runs M={m} ({why or 'all disabled'})"
        best = [
            k for k in runnable
            if ranges[k][1] <= m and (ranges[k][2] is None or m <= ranges[k][2])
        ]  # fmt: skip
        choice.append(best[0] if best else runnable[0])
    entries: list[tuple[int | None, type[WNA16Kernel]]] = []
    lo = 1
    for m in range(1, last + 1):
        if m == last or choice[m] is not choice[m - 1]:
            hi = None if m == last else m
            ok, why = choice[m - 1].can_implement(cfg.rows(lo, hi))
            if not ok:
                return f"{choice[m - 1].name} cannot run M={lo}..: {why}"
            entries.append((hi, choice[m - 1]))
            lo = m + 1
    return KernelTable(kernels[0].layout, tuple(entries))


def choose_kernels(cfg: KernelConfig, disabled: frozenset[str] | None = None) -> KernelTable:
    """The first layout (in `KERNELS` order) whose enabled kernels cover every M for `cfg`."""
    disabled = envs.disabled_kernels() if disabled is None else disabled
    reasons = []
    for layout in KERNELS:
        enabled = [k for k in layout if k.name not in disabled]
        table = _cover(cfg, enabled) if enabled else "all disabled"
        if isinstance(table, KernelTable):
            return table
        reasons.append(f"{layout[0].layout}: {table}")
    raise ValueError(
        f"no quantized-linear kernel can run N={cfg.n} K={cfg.k} bits={cfg.bits} on "
        f"{cfg.device_type} with PAGODA_DISABLED_KERNELS={','.join(sorted(disabled))} "
        f"({' | '.join(reasons)})"
    )


def dense_weight(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """[out, in] weight in `dtype`, in the kernels' column order (act-order: sorted by group)."""
    q, scale, zp = layer.wna16_kernels.entries[0][1].dequantize(layer)
    out_features, in_features = q.shape
    group = layer.wna16_group_size
    if in_features % group == 0:
        # [out, groups, group] * [out, groups, 1]: one broadcast, no expanded scale copy.
        w = q.view(out_features, -1, group).to(torch.float32)
        if zp is not None:
            w = w - zp.to(torch.float32).unsqueeze(-1)
        w = (w * scale.to(torch.float32).unsqueeze(-1)).view(out_features, in_features)
        return w.to(dtype)
    return dequantize_weight(q, scale, zp, group, dtype=dtype)
