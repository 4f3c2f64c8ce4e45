"""FP8 W8A8 linear layers (compressed-tensors `float-quantized`, or a bf16 model quantized at load).

`Fp8LinearMethod` registers the checkpoint's tensors (e4m3 `weight`, `weight_scale`, static
`input_scale`), folds them after loading into one layout (weight [N, K] e4m3, per-output-channel
float32 scale [N], one input scale or none) and asks the kernel registry below for the layer's
kernels by M band. Kernels, in priority order (`PAGODA_DISABLED_KERNELS` removes them by name):
- `fp8_gemv` (CUDA sm_80+, Triton): M = 1, FP8 weights x bf16 activation (no activation
  rounding), the batch-1 decode's weight bytes halved;
- `fp8_gemm` (CUDA sm_80+, Triton): 2-32 rows (2-16 for layers >= 16384 wide), the same
  FP8-weight x bf16-activation math through `tl.dot` (split-K over the SMs): there a linear is
  bound by its weight bytes, so FP8 tensor cores buy nothing and the activations' quantization
  launch is saved (`Fp8Gemm.best_max_m`: measured band);
- `fp8_gemm_a8` (CUDA sm_89+, Triton, FP8 activations in the checkpoint): to 64 rows (128 on
  layers >= 8192 deep), the activations quantized per token (or with the static scale) by one
  Triton launch, then the same kernel's FP8 x FP8 `tl.dot` (sm_90's MMA results promoted to
  fp32 every 32 products): cuBLASLt's FP8 GEMM is slower than bf16 at these skinny shapes;
- `fp8_scaled_mm` (CUDA sm_89+, FP8 activations in the checkpoint): activations quantized per
  token (or with the static scale) by one Triton launch, cuBLASLt's FP8 GEMM (`torch._scaled_mm`);
- `fp8_dequant_mm` (where no FP8 GEMM runs: sm_80 / 87, which have no FP8 tensor cores, and
  weight-only FP8 checkpoints): above 128 rows, the weight dequantized per call, then a dense
  GEMM; below, `fp8_gemv` / `fp8_gemm` (W8A16 math; sm_80 / 87 decode the e4m3 codes with
  integer operations): the FP8 memory is kept and a decode step reads half the bytes;
- `fp8_w8a16` (everything else: the CPU, no Triton): the weight is dequantized once at load to
  the model dtype and runs as a dense layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import envs, platform
from pagoda.kernels.fp8.ops import (
    per_token_quant_ref,
    scaled_mm,
    scaled_mm_available,
    scaled_mm_ref,
    static_quant_ref,
)
from pagoda.layers.linear import LinearMethod
from pagoda.quant.fp8 import (
    FP8_DTYPE,
    Fp8Args,
    dequantize_weight_fp8,
    param_shapes,
    quantize_weight_fp8,
)


@dataclass(frozen=True)
class Fp8KernelConfig:
    """What a kernel must handle for one layer: y[M, n] = x[M, k] @ W^T, M in [min_m, max_m]."""

    device_type: str  # "cuda" | "cpu"
    capability: tuple[int, int]  # (0, 0) on the CPU
    n: int
    k: int
    act_dtype: torch.dtype
    activations: str | None  # "dynamic" | "static" | None (weight-only FP8)
    min_m: int = 1
    max_m: int | None = None

    def __post_init__(self) -> None:
        if self.min_m < 1 or (self.max_m is not None and self.max_m < self.min_m):
            raise ValueError(f"bad M range [{self.min_m}, {self.max_m}]")


class Fp8Kernel:
    name: ClassVar[str]
    layout: ClassVar[str]  # "fp8" (e4m3 weight + scales) or "dense" (dequantized weight)
    max_rows: ClassVar[int | None] = None

    @classmethod
    def can_implement(cls, cfg: Fp8KernelConfig) -> tuple[bool, str]:
        if cls.max_rows is not None and (cfg.max_m is None or cfg.max_m > cls.max_rows):
            return False, f"M up to {cls.max_rows} only"
        return cls.supports(cfg)

    @classmethod
    def supports(cls, cfg: Fp8KernelConfig) -> tuple[bool, str]:
        raise NotImplementedError

    @classmethod
    def apply(
        cls, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:  # [M, n]
        raise NotImplementedError


def _fp8_operands(
    cfg: Fp8KernelConfig, min_capability: tuple[int, int], why: str
) -> tuple[bool, str]:
    """The checks every CUDA FP8 kernel shares: device, capability, shape, activation dtype."""
    if cfg.device_type != "cuda":
        return False, "not a CUDA device"
    if cfg.capability < min_capability:
        return False, f"sm_{cfg.capability[0]}{cfg.capability[1]} {why}"
    if cfg.n % 16 or cfg.k % 16:
        return False, f"N={cfg.n}, K={cfg.k}: the FP8 kernels need multiples of 16"
    if cfg.act_dtype not in (torch.bfloat16, torch.float16):
        return False, f"activations in {cfg.act_dtype}: bf16 or fp16 only"
    return True, ""


def _fp8_tensor_cores(cfg: Fp8KernelConfig) -> tuple[bool, str]:
    return _fp8_operands(cfg, (8, 9), "has no FP8 tensor cores")


def _fp8_weight_kernels(cfg: Fp8KernelConfig) -> tuple[bool, str]:
    """FP8 weights x bf16 / fp16 activations in Triton: sm_89+ converts e4m3 in hardware,
    sm_80 / 87 (Ampere, the Jetson Orin) decode the codes with integer operations
    (`kernels/fp8/triton_e4m3.py`)."""
    ok, why = _fp8_operands(cfg, (8, 0), "has no mma.sync bf16 (the kernels need sm_80+)")
    if ok and not platform.triton_available():
        return False, "triton not installed"
    return ok, why


class Fp8Gemv(Fp8Kernel):
    name = "fp8_gemv"
    layout = "fp8"
    max_rows = 1

    @classmethod
    def supports(cls, cfg: Fp8KernelConfig) -> tuple[bool, str]:
        # the band was measured on sm_90 and under sm_89 / 8.7 emulation (`pagoda bench
        # edge`), not on an Ada card or an Orin
        return _fp8_weight_kernels(cfg)

    @classmethod
    def apply(cls, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from pagoda.kernels.fp8.triton_gemv import fp8_gemv

        return fp8_gemv(x, layer.weight, layer.weight_scale, bias)


class Fp8Gemm(Fp8Kernel):
    name = "fp8_gemm"
    layout = "fp8"
    max_rows = 128  # what the kernel handles; the registry takes it up to `best_max_m`

    @staticmethod
    def best_max_m(cfg: Fp8KernelConfig) -> int:
        """Up to where it beats the W8A8 path (H200, 2026-12-06, `bench_fp8_gemm.py`, Qwen2.5
        3B / 7B layers): every layer at 2-16 rows; the narrow ones (qkv, o, down) at 32 too
        (0.48-0.84x W8A8's time) but not the 22016- / 37888-wide gate_up (1.02-1.12x); from 64
        rows the W8A8 path wins on most layers (gate_up 2.3-3.8x faster)."""
        return 16 if cfg.n >= 16384 else 32

    @classmethod
    def supports(cls, cfg: Fp8KernelConfig) -> tuple[bool, str]:
        return Fp8Gemv.supports(cfg)

    @classmethod
    def apply(cls, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from pagoda.kernels.fp8.triton_gemm import fp8_gemm

        workspace = getattr(layer, "split_k_workspace", None)  # bound by the model runner
        return fp8_gemm(x, layer.weight, layer.weight_scale, bias, workspace=workspace)


class Fp8GemmA8(Fp8Kernel):
    """33-128 rows of a W8A8 checkpoint: the activations quantized as for cuBLASLt (one Triton
    launch), then `fp8_gemm`'s FP8 x FP8 `tl.dot` with split-K. cuBLASLt's FP8 GEMM at these
    skinny shapes runs below bf16 (H200, 2026-12-06: 3B down_proj at 64 rows 31.7 us against
    bf16's 17.2; `bench_fp8_gemm.py`), while the layer is still bound by its weight bytes."""

    name = "fp8_gemm_a8"
    layout = "fp8"
    max_rows = 128

    @staticmethod
    def best_max_m(cfg: Fp8KernelConfig) -> int:
        """Up to where it beats cuBLASLt's FP8 GEMM end to end (H100, 2026-12-07, d8eb2f7,
        `pagoda compare` bf16 vs FP8 with it and without it, one call; promotion every 32
        products included): at 64 rows the 3B decode 1.19x, the 7B 1.08x; to 128 rows on
        the long layers (down_proj, K >= 8192: 45.1 us against 55.9 at 128 rows on the 7B),
        to 64 elsewhere (the 7B gate_up at 128 rows: 71.4 us against 66.8; taken to 128 rows
        there, the 7B decode at 128 rows ran 0.97x the speed without it)."""
        return 128 if cfg.k >= 8192 else 64

    @classmethod
    def supports(cls, cfg: Fp8KernelConfig) -> tuple[bool, str]:
        ok, why = _fp8_tensor_cores(cfg)
        if not ok:
            return ok, why
        if not platform.triton_available():
            return False, "triton not installed"
        if cfg.activations is None:
            return False, "weight-only FP8 checkpoint (activations stay in the model dtype)"
        return True, ""

    @classmethod
    def apply(cls, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from pagoda.kernels.fp8.triton_gemm import fp8_gemm
        from pagoda.kernels.fp8.triton_quant import quant_fp8_triton

        x_q, x_scale = quant_fp8_triton(x, layer.input_scale)
        workspace = getattr(layer, "split_k_workspace", None)
        return fp8_gemm(
            x_q, layer.weight, layer.weight_scale, bias, workspace=workspace,
            x_scale=x_scale, out_dtype=x.dtype,
        )  # fmt: skip


class Fp8DequantMM(Fp8Kernel):
    """Above 128 rows where no FP8 GEMM runs (sm_80 / 87, weight-only FP8 checkpoints): the
    weight dequantized per call into a temporary, then a dense GEMM. The layer keeps its FP8
    bytes; prefill-sized M are bound by the GEMM's FLOPs, which the extra pass over the weight
    does not change much."""

    name = "fp8_dequant_mm"
    layout = "fp8"

    @classmethod
    def supports(cls, cfg: Fp8KernelConfig) -> tuple[bool, str]:
        return (True, "") if cfg.device_type == "cuda" else (False, "not a CUDA device")

    @classmethod
    def apply(cls, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = dequantize_weight_fp8(layer.weight, layer.weight_scale, x.dtype)
        return F.linear(x, w, bias)


class Fp8ScaledMM(Fp8Kernel):
    name = "fp8_scaled_mm"
    layout = "fp8"

    @classmethod
    def supports(cls, cfg: Fp8KernelConfig) -> tuple[bool, str]:
        ok, why = _fp8_tensor_cores(cfg)
        if not ok:
            return ok, why
        if cfg.activations is None:
            return False, "weight-only FP8 checkpoint (activations stay in the model dtype)"
        if not scaled_mm_available():
            return False, "this torch has no torch._scaled_mm"
        return True, ""

    @classmethod
    def apply(cls, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        static = layer.input_scale
        if platform.triton_available():
            from pagoda.kernels.fp8.triton_quant import quant_fp8_triton

            x_q, x_scale = quant_fp8_triton(x, static)
        elif static is None:
            x_q, x_scale = per_token_quant_ref(x)
        else:
            x_q = static_quant_ref(x, static)
            x_scale = static.reshape(1, 1).expand(x.shape[0], 1).contiguous()
        return scaled_mm(x_q, x_scale, layer.weight, layer.weight_scale_row, bias, x.dtype)


class Fp8W8A16(Fp8Kernel):
    name = "fp8_w8a16"
    layout = "dense"

    @classmethod
    def supports(cls, cfg: Fp8KernelConfig) -> tuple[bool, str]:
        return True, ""

    @classmethod
    def apply(cls, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class Fp8W8A8Reference(Fp8Kernel):
    """The W8A8 math in torch on any device (FP8 layout): activations quantized per token or
    with the static scale, exact e4m3 products accumulated in fp32. Never picked by the
    registry (the CPU runs W8A16); tests and the CPU quality measurement install it
    (`use_w8a8_reference`) to see what FP8 tensor cores compute."""

    name = "fp8_w8a8_reference"
    layout = "fp8"

    @classmethod
    def supports(cls, cfg: Fp8KernelConfig) -> tuple[bool, str]:
        return True, ""

    @classmethod
    def apply(cls, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        static = layer.input_scale
        if static is None:
            x_q, x_scale = per_token_quant_ref(x)
        else:
            x_q, x_scale = static_quant_ref(x, static), static
        codes = getattr(layer, "fp8_codes", None)
        if codes is None:  # the FP8 layout (GPU): the layer's own codes and scales
            return scaled_mm_ref(x_q, x_scale, layer.weight, layer.weight_scale, bias, x.dtype)
        return scaled_mm_ref(x_q, x_scale, codes, layer.fp8_scale, bias, x.dtype)


FP8_KERNELS: tuple[type[Fp8Kernel], ...] = (
    Fp8Gemv, Fp8Gemm, Fp8GemmA8, Fp8ScaledMM, Fp8DequantMM, Fp8W8A16,
)  # fmt: skip


def _enabled(kernel: type[Fp8Kernel]) -> bool:
    return kernel is Fp8W8A16 or envs.kernel_enabled(kernel.name)


@dataclass(frozen=True)
class Fp8KernelTable:
    """(first M, kernel) bands, ascending; `pick(M)` is the last band starting at or below M."""

    layout: str
    entries: tuple[tuple[int, type[Fp8Kernel]], ...]
    reasons: tuple[str, ...] = ()  # why faster kernels were not taken (shown by the report)

    def pick(self, m: int) -> type[Fp8Kernel]:
        chosen = self.entries[0][1]
        for start, kernel in self.entries:
            if m >= start:
                chosen = kernel
        return chosen

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(k.name for _, k in self.entries)


def choose_fp8_kernels(cfg: Fp8KernelConfig) -> Fp8KernelTable:
    """The layer's kernels: the FP8 layout where a kernel of it covers every M, else dense."""
    reasons = []
    gemm_ok, why = Fp8ScaledMM.supports(cfg) if _enabled(Fp8ScaledMM) else (False, "disabled")
    if not gemm_ok:
        reasons.append(f"fp8_scaled_mm: {why}")
    one = dataclasses.replace(cfg, min_m=1, max_m=1)
    gemv_ok, why = Fp8Gemv.can_implement(one) if _enabled(Fp8Gemv) else (False, "disabled")
    if not gemv_ok:
        reasons.append(f"fp8_gemv: {why}")
    # with an FP8 GEMM above, to where `fp8_gemm` beats it; without, as far as it goes
    gemm_end = Fp8Gemm.best_max_m(cfg) if gemm_ok else Fp8Gemm.max_rows
    band = dataclasses.replace(cfg, min_m=2, max_m=gemm_end)
    small_ok, why = Fp8Gemm.can_implement(band) if _enabled(Fp8Gemm) else (False, "disabled")
    if not small_ok:
        reasons.append(f"fp8_gemm: {why}")
    if gemm_ok:
        entries: list[tuple[int, type[Fp8Kernel]]] = []  # (first M, kernel)
        if gemv_ok:
            entries.append((1, Fp8Gemv))
        if small_ok:
            entries.append((2 if gemv_ok else 1, Fp8Gemm))
        start = gemm_end + 1 if small_ok else 2 if gemv_ok else 1
        a8_end = Fp8GemmA8.best_max_m(cfg)
        a8_band = dataclasses.replace(cfg, min_m=start, max_m=a8_end)
        a8_ok, why = (
            Fp8GemmA8.can_implement(a8_band) if _enabled(Fp8GemmA8) else (False, "disabled")
        )
        if a8_ok:
            entries.append((start, Fp8GemmA8))
            start = a8_end + 1
        else:
            reasons.append(f"fp8_gemm_a8: {why}")
        entries.append((start, Fp8ScaledMM))
        return Fp8KernelTable("fp8", tuple(entries), tuple(reasons))
    if gemv_ok and small_ok and _enabled(Fp8DequantMM):
        # W8A16 with the weight kept in FP8 (sm_80 / 87, weight-only checkpoints): half the
        # bytes of the dense layer at decode, the FP8 memory kept
        return Fp8KernelTable(
            "fp8",
            ((1, Fp8Gemv), (2, Fp8Gemm), (gemm_end + 1, Fp8DequantMM)),
            tuple(reasons),
        )
    return Fp8KernelTable("dense", ((1, Fp8W8A16),), tuple(reasons))


# ---------------------------------------------------------------- the linear method


def _param(layer: nn.Module, name: str, data: torch.Tensor, output_dim: int | None) -> None:
    p = nn.Parameter(data, requires_grad=False)
    p.output_dim = output_dim
    p.output_pack_factor = 1
    layer.register_parameter(name, p)


class Fp8LinearMethod(LinearMethod):
    """FP8 e4m3 weights, FP8 activations where the GPU has FP8 tensor cores.

    `quantize_at_load`: the layer holds the model's dense weight while loading and quantizes it
    per output channel afterwards (`LLM(..., quantization="fp8")` on a bf16 checkpoint; dynamic
    per-token activations, as llmcompressor's FP8_DYNAMIC).
    After loading: `layer.weight` [N, K] e4m3, `layer.weight_scale` [N] float32 (per-tensor and
    per-shard scales expanded), `layer.weight_scale_row` its [1, N] view, `layer.input_scale`
    [1] float32 or None, `layer.fp8_kernels` the dispatch table; on the dense layout
    `layer.weight` is the dequantized [N, K] weight in the model dtype.
    """

    def __init__(self, args: Fp8Args, quantize_at_load: bool = False) -> None:
        if quantize_at_load and args != Fp8Args("channel", "dynamic"):
            raise ValueError("quantization at load makes FP8_DYNAMIC (channel, dynamic) only")
        self.args = args
        self.quantize_at_load = quantize_at_load

    def create_weights(
        self,
        layer: nn.Module,
        in_features: int,
        out_features_per_shard: list[int],
        dtype: torch.dtype,
    ) -> None:
        if self.quantize_at_load:
            w = torch.empty(sum(out_features_per_shard), in_features, dtype=dtype)
            _param(layer, "weight", w, 0)
            return
        for name, shape, pdtype, output_dim in param_shapes(
            self.args, in_features, out_features_per_shard
        ):
            data = torch.zeros(shape, dtype=pdtype or dtype)
            _param(layer, name, data, output_dim)
            if output_dim is None and len(shape) == 1 and shape[0] > 1:
                # one scalar per fused shard (q / k / v each calibrated): shard i -> entry i
                layer.get_parameter(name).shard_indexed = True

    def init_dummy_weights(self, layer: nn.Module, generator: torch.Generator) -> None:
        """Random e4m3 codes with per-channel scales of the dense dummy's size (0.05)."""
        if self.quantize_at_load:
            return  # the loader's dense dummy weight is quantized after loading
        w = layer.weight.data
        codes = torch.randn(w.shape, generator=generator, device=w.device) * 64
        w.copy_(codes.clamp(-448, 448).to(FP8_DTYPE))
        layer.weight_scale.data.fill_(0.05 / 64)
        if self.args.static_input:
            layer.input_scale.data.fill_(4.0 / 448)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        n, k = layer.out_features, layer.in_features
        if self.quantize_at_load:
            q, scale = quantize_weight_fp8(layer.weight.data, "channel", torch.float32)
            input_scale = None
        else:
            q = layer.weight.data
            scale = layer.weight_scale.data.float()
            if scale.numel() != n:  # per-tensor: one scale per fused shard, over its rows
                sizes = torch.tensor(layer.out_features_per_shard, device=scale.device)
                scale = scale.reshape(-1).repeat_interleave(sizes)
            input_scale = None
            if self.args.static_input:
                # Fused projections read one input: quantize it once, with the largest of
                # their calibrated scales (no clipping for any of them).
                input_scale = layer.input_scale.data.float().amax().reshape(1)
            if self.args.static_input:
                del layer.input_scale
        scale = scale.reshape(n).contiguous()
        del layer.weight
        device = q.device
        cfg = Fp8KernelConfig(
            device_type=device.type,
            capability=platform.capability(device),
            n=n,
            k=k,
            act_dtype=layer.params_dtype,
            activations=self.args.activations,
        )
        table = choose_fp8_kernels(cfg)
        layer.fp8_kernels = table
        layer.fp8_backend = table.layout
        if table.layout == "fp8":
            _param(layer, "weight", q.contiguous(), 0)
            _param(layer, "weight_scale", scale, 0)
            layer.weight_scale_row = layer.weight_scale.data.view(1, n)
            layer.input_scale = input_scale
        else:
            w = dequantize_weight_fp8(q, scale, layer.params_dtype)
            _param(layer, "weight", w, 0)
            layer.input_scale = input_scale
            if device.type == "cpu":
                # The codes (a quarter of an fp32 weight) stay beside it, so that the W8A8
                # reference can run here (`use_w8a8_reference`: tests, quality runs).
                layer.fp8_codes, layer.fp8_scale = q.contiguous(), scale

    def use_w8a8_reference(self, layer: nn.Module) -> None:
        """Run this loaded CPU layer with `Fp8W8A8Reference` (tests, CPU quality runs)."""
        if not hasattr(layer, "fp8_codes"):
            raise ValueError(f"{layer.prefix}: the W8A8 reference runs on CPU layers only")
        layer.fp8_kernels = Fp8KernelTable("fp8", ((1, Fp8W8A8Reference),))

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """[out, in] weight in the layer dtype."""
        if layer.fp8_backend == "dense":
            return layer.weight.data
        return dequantize_weight_fp8(layer.weight, layer.weight_scale, layer.params_dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [M, in]
        out = layer.fp8_kernels.pick(x2.shape[0]).apply(layer, x2, bias)
        return out.reshape(*shape[:-1], out.shape[-1])
