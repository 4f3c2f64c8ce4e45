"""Small-M GEMM over FP8 weights: y = x @ (w_q * s_w)^T (+ bias), x in bf16 / fp16, 2 <= M <= 128.

Below ~150 rows a decode step's linears are bound by the weight bytes, not by the tensor cores
(bf16 MMA on e4m3 weights: 2M FLOP per weight byte against the H100's ~295 FLOP/B balance). So
in that band an FP8 checkpoint needs no FP8 tensor cores and no activation quantization: the
kernel reads e4m3 weight tiles, converts them to the activation dtype in registers (exact: every
e4m3 value is a bf16 / fp16 value), runs `tl.dot` against the unrounded activations with fp32
accumulation and applies the per-output-channel scale once in the epilogue. The W8A8 path
(per-token quantization launch + cuBLASLt FP8) pays one more launch and pass over the
activations per linear and rounds them to 3 mantissa bits; this path reads the same weight bytes.

Tiling: one program owns all M rows (BLOCK_M = M padded to 16..128) and BLOCK_N output channels
over a K-slice; split-K spreads the weight over the SMs with the "serial" reduction of the
W4A16 GEMV (the last program of a column tile sums the fp32 partials and leaves the workspace
zero; `kernels/workspace.py`), or atomics into a fresh buffer without a workspace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagoda import envs
from pagoda.kernels.fp8.triton_e4m3 import e4m3_bits_to_f32, needs_soft_e4m3
from pagoda.kernels.pdl import pdl_launch_args
from pagoda.kernels.triton_split_k import store_split_k
from pagoda.kernels.workspace import SplitKWorkspace

MAX_M = 128


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, wsi_ptr, cnt_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    SERIAL: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
    A8: tl.constexpr,  # x is e4m3 with a per-row scale (xs_ptr): an FP8 x FP8 dot
    SOFT_E4M3: tl.constexpr,  # w_ptr holds the codes as uint8 (no e4m3 conversion: sm_80 / 87)
    UPCAST_DOT: tl.constexpr,  # the interpreter multiplies bf16 / fp8 dot operands as raw bits
):  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    # [BLOCK_K, BLOCK_N] tiles of the row-major [N, K] weight: contiguous along K (axis 0)
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + offs_k
        if EVEN_K:
            x = tl.load(x_rows + k[None, :], mask=mask_m[:, None], other=0.0)
        else:
            x = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & (k < K)[None, :], other=0.0)
        if EVEN_N and EVEN_K:
            w = tl.load(w_cols + k[:, None])
        elif EVEN_K:
            w = tl.load(w_cols + k[:, None], mask=mask_n[None, :], other=0.0)
        else:
            w = tl.load(w_cols + k[:, None], mask=(k < K)[:, None] & mask_n[None, :], other=0.0)
        if SOFT_E4M3:
            wf = e4m3_bits_to_f32(w)
        else:
            wf = w.to(tl.float32)
        if UPCAST_DOT:  # exact either way: the products fit fp32
            acc = tl.dot(x.to(tl.float32), wf, acc, input_precision="ieee")
        elif A8:
            # sm_90's FP8 MMA accumulates with ~14-bit precision ("fast accumulation", Triton's
            # default there, up to 2^30 products): a promotion into the fp32 accumulator after
            # each 32-deep MMA keeps the sums fp32 (the GPU test failed without it at K 18,944)
            acc = tl.dot(x, w, acc, max_num_imprecise_acc=32)
        elif SOFT_E4M3:
            acc = tl.dot(x, wf.to(x.dtype), acc)
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    if USE_PDL:  # every weight tile is read: the next kernel may launch (it waits for us)
        tl.extra.cuda.gdc_launch_dependents()
    acc = acc * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if A8:
        acc = acc * tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)[:, None]

    store_split_k(
        acc, out_ptr, ws_ptr, wsi_ptr, cnt_ptr, b_ptr, offs_m, offs_n, mask_m, mask_n, N,
        stride_om, pid_n, ONE_SPLIT, SERIAL, HAS_BIAS,
    )  # fmt: skip


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Tiles of the small-M FP8-weight GEMM; split_k is a target (rounded to whole K-tiles)."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


def block_m_for(m: int) -> int:
    """The padded row count of the one M tile: a power of two, at least 16 (the MMA's M)."""
    return max(16, triton.next_power_of_2(m))


def default_config(m: int, n: int, k: int, num_sms: int) -> Fp8GemmConfig:
    """~4 waves of programs: BLOCK_N 64 (128 for wide layers), K-slices of >= 4 tiles."""
    block_n = 128 if n >= 8192 else 64
    block_k = 128
    n_tiles = triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    split = max(1, min(round(4 * num_sms / n_tiles), k_tiles // 4))
    warps = 8 if block_m_for(m) >= 128 else 4
    stages = 3 if block_m_for(m) >= 128 else 4
    return Fp8GemmConfig(block_n, block_k, split, warps, stages)


def a8_config(m: int, n: int, k: int, num_sms: int) -> Fp8GemmConfig:
    """e4m3 activations (33-128 rows): ~2 waves of programs, BLOCK_N 32 (64 for wide layers),
    no split where the column tiles alone fill them. The sweep's best on the H100 for every
    Qwen2.5 3B / 7B layer at 48-128 rows but the down_proj's BLOCK_K 256 at <= 64 rows and the
    7B gate_up's BLOCK_N 32 at <= 64 (2026-12-07, `bench_fp8_gemm.py --sweep`)."""
    block_n = 64 if n >= 8192 else 32
    n_tiles = triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, 128)
    split = max(1, min(round(2 * num_sms / n_tiles), k_tiles // 2))
    return Fp8GemmConfig(block_n, 128, split, 8 if block_m_for(m) >= 128 else 4, 4)


def candidate_configs(m: int, n: int, k: int, num_sms: int) -> list[Fp8GemmConfig]:
    """The benchmark's sweep around the default (benchmarks/quant/bench_fp8_gemm.py)."""
    out = []
    for block_n in (32, 64, 128):
        for block_k in (128, 256):
            n_tiles = triton.cdiv(n, block_n)
            k_tiles = triton.cdiv(k, block_k)
            for waves in (2, 4, 8):
                split = max(1, min(round(waves * num_sms / n_tiles), k_tiles // 2))
                for warps in (4, 8):
                    cfg = Fp8GemmConfig(block_n, block_k, split, warps, 3 if block_k > 128 else 4)
                    if cfg not in out:
                        out.append(cfg)
    return out


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def fp8_gemm(
    x: torch.Tensor,  # [M, K] bf16 / fp16, 1 <= M <= 128
    w_q: torch.Tensor,  # [N, K] float8_e4m3fn, unit stride along K
    w_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N], added in fp32
    config: Fp8GemmConfig | None = None,
    workspace: SplitKWorkspace | None = None,  # the "serial" reduction's (None: atomics + copy)
    x_scale: torch.Tensor | None = None,  # [M] float32 when x is e4m3 (per-token or static)
    out_dtype: torch.dtype | None = None,  # with e4m3 x: bf16 / fp16 (x's dtype otherwise)
    soft_e4m3: bool | None = None,  # None: where the GPU is below sm_89 (see triton_e4m3.py)
) -> torch.Tensor:  # [M, N] in x's dtype (out_dtype for e4m3 x)
    m, k = x.shape
    n = w_q.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"fp8_gemm handles 1 <= M <= {MAX_M}, got M={m}")
    a8 = x.dtype == torch.float8_e4m3fn
    if soft_e4m3 is None:
        soft_e4m3 = needs_soft_e4m3(x.device)
    if a8 and soft_e4m3:
        raise ValueError("e4m3 activations need FP8 tensor cores (sm_89+)")
    if a8:
        if x_scale is None or x_scale.numel() != m or x_scale.dtype != torch.float32:
            raise ValueError(f"e4m3 activations need a float32 x_scale of {m} values (per row)")
        if out_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"e4m3 activations need out_dtype bf16 / fp16, got {out_dtype}")
        x_scale = x_scale.reshape(m).contiguous()
    elif x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fp8_gemm takes bf16 / fp16 or e4m3 activations, got {x.dtype}")
    elif x_scale is not None:
        raise ValueError("x_scale goes with e4m3 activations only")
    else:
        out_dtype = x.dtype
    if w_q.shape[1] != k or w_q.stride(1) != 1 or w_q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"w_q must be [N, {k}] e4m3 with unit stride along K")
    if w_scale.shape != (n,) or w_scale.dtype != torch.float32:
        raise ValueError(f"w_scale must be a float32 [{n}] tensor, got {list(w_scale.shape)}")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}] tensor, got {list(bias.shape)}")
    cfg = config or (a8_config if a8 else default_config)(m, n, k, _num_sms(x.device))
    x = x if x.stride(1) == 1 else x.contiguous()
    n_tiles = triton.cdiv(n, cfg.block_n)
    k_tiles = triton.cdiv(k, cfg.block_k)
    split = max(1, min(cfg.split_k, k_tiles))
    k_per_split = triton.cdiv(k_tiles, split) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # no program without a K-tile
    out = torch.empty((m, n), device=x.device, dtype=out_dtype)
    serial = workspace is not None
    ws = cnt = None
    if split > 1 and serial:
        bufs = workspace.buffers(x.device, m * n, n_tiles)
        if bufs is None:  # capturing with a workspace too small: atomics into a fresh buffer
            serial = False
        else:
            ws, cnt = bufs
    if split > 1 and not serial:
        ws = torch.zeros(m * n, device=x.device, dtype=torch.float32)
    if ws is None:  # one split: stored directly, the workspace arguments unused
        ws = torch.empty(0, device=x.device, dtype=torch.float32)
    if cnt is None:
        cnt = w_scale
    _fp8_gemm_kernel[(n_tiles, split)](
        x, x_scale if a8 else w_scale, w_q.view(torch.uint8) if soft_e4m3 else w_q, w_scale,
        bias if bias is not None else w_scale, out,
        ws, ws.view(torch.int32), cnt,
        m, n, k, k_per_split,
        x.stride(0), w_q.stride(0), out.stride(0),
        BLOCK_M=block_m_for(m),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EVEN_N=n % cfg.block_n == 0,
        EVEN_K=k % cfg.block_k == 0,
        ONE_SPLIT=split == 1,
        SERIAL=serial,
        NUM_STAGES=cfg.num_stages,
        HAS_BIAS=bias is not None and (split == 1 or serial),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        A8=a8,
        SOFT_E4M3=soft_e4m3,
        UPCAST_DOT=envs.triton_interpret() and x.dtype in (torch.bfloat16, torch.float8_e4m3fn),
        **pdl_launch_args(x),
    )  # fmt: skip
    if split > 1 and not serial:
        y = ws.view(m, n) if bias is None else ws.view(m, n) + bias.float()
        out.copy_(y)
    return out
