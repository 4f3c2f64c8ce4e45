"""W4A16 tensor-core GEMV (`triton_w4a16_mma`) vs the FMA GEMV vs bf16, Qwen2.5-7B shapes.

Each call is timed inside one CUDA graph that cycles over enough weight copies to stream 4x the
L2 from HBM per replay (decode reads every layer from HBM), so launch overhead is the graph's.
Correctness first: every config is checked against the fp32 matmul of the dequantized weight.
The copy bandwidth is measured in the same process: `bw_frac` = bytes read / time / copy BW.

    python benchmarks/quant/bench_w4a16_mma.py --out benchmarks/results/w4a16_mma_h200.json

Modes: `--shared-only` (M = 9-64: shared dequantization vs per-block vs dequant + cuBLAS vs
bf16); `--stream-only` (the read floor: a loads-and-sum Triton kernel and torch's sum over each
layer's int4 bytes, in the same CUDA-graph timing). M = 1-256 against every kernel, with zero
points: `bench_w4a16_tc.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagoda.bench.common import copy_bandwidth  # noqa: E402
from pagoda.bench.common import graph_time_per_call as time_graph  # noqa: E402
from pagoda.kernels.dense.triton_gemv import gemv_bf16  # noqa: E402
from pagoda.kernels.wna16 import triton_w4a16_mma as mma  # noqa: E402
from pagoda.kernels.wna16.triton_w4a16 import wna16_gemv  # noqa: E402
from pagoda.kernels.workspace import SplitKWorkspace  # noqa: E402
from pagoda.quant.packing import pack_to_int32  # noqa: E402

MODEL_SHAPES = {  # model: {layer: (N, K)}
    "7b": {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)},
    "3b": {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (22016, 2048), "down": (2048, 11008)},
}

WS = SplitKWorkspace()  # split-K scratch, as the model runner owns one


def configs(m: int, n: int, k: int, num_sms: int):
    """(K tiles per step, split-K, warps): the default first."""
    out = [mma.default_mma_config(m, n, k, num_sms)]
    for kt, warps in ((1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (8, 2), (8, 4)):
        for split in (1, 2, 4, 8, 16, 32):
            if (kt, split, warps) not in out:
                out.append((kt, split, warps))
    return out


def bench_shape(name, n, k, ms, sweep_ms, bw, l2, num_sms) -> list[dict]:
    """Every kernel at every M for one layer shape (weights rotated over enough copies)."""
    from pagoda.kernels.wna16.triton_w4a16 import wna16_dequant_linear, wna16_gemm

    dev, G = torch.device("cuda"), 128
    u = torch.randint(0, 16, (n, k), device=dev, dtype=torch.int32)
    scales = (torch.rand(n, k // G, device=dev) * 0.02 + 0.001).to(torch.bfloat16)
    w_deq = ((u - 8).float() * scales.float().repeat_interleave(G, 1)).to(torch.bfloat16)
    words = mma.repack_mma(u)
    scales_t = scales.t().contiguous()
    pairs = mma.repack_mma_scales(scales_t)
    qweight_t = pack_to_int32((u - 8).to(torch.int8), 4, 1).t().contiguous()
    int4_bytes = n * k // 2 + scales_t.numel() * 2
    copies = max(2, -(-4 * l2 // int4_bytes))
    copies_bf16 = max(2, -(-4 * l2 // (n * k * 2)))
    ws = [words] + [words.clone() for _ in range(copies - 1)]
    ps = [pairs] + [pairs.clone() for _ in range(copies - 1)]
    ss = [scales_t] + [scales_t.clone() for _ in range(copies - 1)]
    qs = [qweight_t] + [qweight_t.clone() for _ in range(copies - 1)]
    wb = [w_deq] + [w_deq.clone() for _ in range(copies_bf16 - 1)]

    def mma_call(x, cfg=None):
        return lambda i: mma.wna16_mma_gemv(x, ws[i], ps[i], n, G, config=cfg, workspace=WS)

    rows = []
    for m in ms:
        x = (torch.randn(m, k, device=dev) * 0.5).to(torch.bfloat16)
        ref = x.float() @ w_deq.float().t()
        tol = 2e-2 * ref.abs().max().item()
        row = {"layer": name, "n": n, "k": k, "m": m, "int4_bytes": int4_bytes}
        row["bf16_cublas_us"] = 1e6 * time_graph(
            lambda i, x=x: torch.nn.functional.linear(x, wb[i]), copies_bf16
        )
        if m == 1:
            row["bf16_gemv_us"] = 1e6 * time_graph(
                lambda i, x=x: gemv_bf16(x, wb[i], None), copies_bf16
            )
        if m <= 16:
            row["fma_gemv_us"] = 1e6 * time_graph(
                lambda i, x=x: wna16_gemv(x, qs[i], ss[i], None, G), copies
            )
        else:
            row["triton_gemm_us"] = 1e6 * time_graph(
                lambda i, x=x: wna16_gemm(x, qs[i], ss[i], None, G, 4), copies
            )
            row["old_dequant_cublas_us"] = 1e6 * time_graph(
                lambda i, x=x: wna16_dequant_linear(x, qs[i], ss[i], None, G, 4), copies
            )
        row["mma_dequant_cublas_us"] = 1e6 * time_graph(
            lambda i, x=x: torch.nn.functional.linear(
                x, mma.wna16_mma_dequant(ws[i], ps[i], n, k, G)
            ),
            copies,
        )
        row["mma_dequant_exact"] = bool(
            torch.equal(mma.wna16_mma_dequant(words, pairs, n, k, G), w_deq)
        )
        sweep, best = [], None
        cfgs = configs(m, n, k, num_sms)
        if m not in sweep_ms:
            cfgs = cfgs[:1]
        for cfg in cfgs if m <= mma.MAX_ROWS else ():
            try:
                y = mma.wna16_mma_gemv(x, words, pairs, n, G, config=cfg, workspace=WS)
                err = (y.float() - ref).abs().max().item()
                if not err <= tol:
                    sweep.append({"config": cfg, "error": f"max err {err:.3g} > {tol:.3g}"})
                    print(f"  {name} M={m} {cfg} WRONG err {err:.3g} (tol {tol:.3g})", flush=True)
                    continue
                t = time_graph(mma_call(x, cfg), copies)
            except Exception as e:  # noqa: BLE001 - report and go on
                sweep.append({"config": cfg, "error": repr(e)[:300]})
                print(f"  {name} M={m} {cfg} FAILED {e!r}"[:400], flush=True)
                continue
            rec = {"config": cfg, "us": t * 1e6, "max_err": err, "bw_frac": int4_bytes / t / bw}
            sweep.append(rec)
            if best is None or rec["us"] < best["us"]:
                best = rec
        row["mma_default_us"] = sweep[0].get("us") if sweep else None
        row["mma_best"], row["sweep"] = best, sweep
        rows.append(row)
        b = best or {}
        old = row.get("fma_gemv_us") or min(row["triton_gemm_us"], row["old_dequant_cublas_us"])
        print(
            f"{name:8s} M={m:3d}: bf16 {row['bf16_cublas_us']:6.1f}"
            + (f" (gemv {row['bf16_gemv_us']:5.1f})" if m == 1 else "")
            + f" | old W4A16 {old:6.1f} | MMA default {row['mma_default_us'] or 0:6.1f}"
            + f" best {b.get('us', 0):6.1f} {b.get('config')} ({100 * b.get('bw_frac', 0):.0f}% BW)"
            + f" | MMA dequant+cuBLAS {row['mma_dequant_cublas_us']:6.1f}",
            flush=True,
        )
    return rows


class _Layer:
    """One layer shape's random int4 weight (group 128) in the MMA layout, its dequantized bf16
    weight, and enough copies of each that a CUDA graph cycling over them reads HBM."""

    def __init__(self, n: int, k: int, l2: int, group: int = 128):
        dev = torch.device("cuda")
        u = torch.randint(0, 16, (n, k), device=dev, dtype=torch.int32)
        scales = (torch.rand(n, k // group, device=dev) * 0.02 + 0.001).to(torch.bfloat16)
        self.w_deq = ((u - 8).float() * scales.float().repeat_interleave(group, 1)).to(
            torch.bfloat16
        )
        self.words = mma.repack_mma(u)
        self.pairs = mma.repack_mma_scales(scales.t().contiguous())
        self.int4_bytes = n * k // 2 + scales.numel() * 2
        self.copies = max(2, -(-4 * l2 // self.int4_bytes))
        self.copies_bf16 = max(2, -(-4 * l2 // (n * k * 2)))
        self.ws = [self.words] + [self.words.clone() for _ in range(self.copies - 1)]
        self.ps = [self.pairs] + [self.pairs.clone() for _ in range(self.copies - 1)]
        self.wb = [self.w_deq] + [self.w_deq.clone() for _ in range(self.copies_bf16 - 1)]


PREFETCHES = [(0, False), (2, True), (4, True), (8, True), (16, True), (4, False), (1 << 20, False)]


def _sweep(label, cfgs, call, layer, expect, nbytes, bw) -> list[dict]:
    """Each config of `call(words, pairs, c=config)`: checked against `expect` (2 % of its
    largest value), then timed over the layer's weight copies; a failure is reported, not
    fatal. Returns one record per config (the first is the default)."""
    tol = 2e-2 * expect.abs().max().item()
    sweep = []
    for cfg in cfgs:
        rec = {"config": cfg}
        try:
            err = (call(layer.words, layer.pairs, c=cfg).float() - expect).abs().max().item()
            if not err <= tol:
                raise RuntimeError(f"max err {err:.3g} > {tol:.3g}")
            t = time_graph(lambda i, c=cfg: call(layer.ws[i], layer.ps[i], c=c), layer.copies)
            rec.update(us=t * 1e6, bw_frac=nbytes / t / bw)
        except Exception as e:  # noqa: BLE001 - report and go on
            rec["error"] = repr(e)[:300]
            print(f"  {label} {cfg} FAILED {rec['error']}", flush=True)
        sweep.append(rec)
    return sweep


def _default_and_best(sweep: list[dict]) -> tuple[float | None, dict | None]:
    ok = [r for r in sweep if "us" in r]
    return sweep[0].get("us"), (min(ok, key=lambda r: r["us"]) if ok else None)


SHARED_CONFIGS = [(2, 1, 1), (2, 1, 2), (4, 1, 2), (2, 2, 2), (4, 2, 2), (4, 4, 2), (8, 2, 4),
                  (4, 3, 2)]  # fmt: skip


def bench_shared(name, n, k, bw, l2, num_sms, ms=(9, 16, 32, 64)) -> list[dict]:
    """M = 9-64: the shared-dequantization kernel (config sweep) vs the per-block kernel, the
    exact dequant + cuBLAS and bf16 cuBLAS, each result checked first."""
    dev, G = torch.device("cuda"), 128
    L = _Layer(n, k, l2, G)
    w_deq, int4_bytes = L.w_deq, L.int4_bytes
    copies, ws, ps = L.copies, L.ws, L.ps
    copies_bf16, wb = L.copies_bf16, L.wb
    rows = []
    for m in ms:
        x = (torch.randn(m, k, device=dev) * 0.5).to(torch.bfloat16)
        ref = x.float() @ w_deq.float().t()
        row = {"layer": name, "n": n, "k": k, "m": m, "int4_bytes": int4_bytes}
        row["bf16_cublas_us"] = 1e6 * time_graph(
            lambda i, x=x: torch.nn.functional.linear(x, wb[i]), copies_bf16
        )
        row["mma_dequant_cublas_us"] = 1e6 * time_graph(
            lambda i, x=x: torch.nn.functional.linear(
                x, mma.wna16_mma_dequant(ws[i], ps[i], n, k, G)
            ),
            copies,
        )
        row["per_block_us"] = 1e6 * time_graph(
            lambda i, x=x: mma.wna16_mma_gemv(x, ws[i], ps[i], n, G, shared=False, workspace=WS),
            copies,
        )
        row["sweep"] = _sweep(
            f"{name} M={m}",
            [mma.default_mma_config(m, n, k, num_sms)] + SHARED_CONFIGS,
            lambda w, p, x=x, c=None: mma.wna16_mma_gemv(
                x, w, p, n, G, config=c, shared=True, workspace=WS
            ),
            L, ref, int4_bytes * -(-m // 32), bw,
        )  # fmt: skip
        row["shared_default_us"], row["shared_best"] = _default_and_best(row["sweep"])
        rows.append(row)
        b = row["shared_best"] or {}
        print(
            f"{name:8s} M={m:2d}: bf16 {row['bf16_cublas_us']:6.1f} | dequant+cuBLAS "
            f"{row['mma_dequant_cublas_us']:6.1f} | per-block {row['per_block_us']:6.1f} | shared "
            f"default {row['shared_default_us'] or 0:6.1f} best {b.get('us', 0):6.1f} "
            f"{b.get('config')}",
            flush=True,
        )
    return rows


@triton.jit
def _stream_kernel(src, out, n_words, PER: tl.constexpr, BLOCK: tl.constexpr):
    """Read PER blocks of BLOCK int32 words and keep one word: the bytes, no math."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(PER):
        offs = (pid * PER + i) * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(src + offs, mask=offs < n_words, other=0)
    tl.store(out + pid, tl.sum(acc, axis=0))


# (BLOCK words, blocks per program, warps)
STREAM_CONFIGS = [(1024, 1, 1), (1024, 4, 1), (2048, 2, 4), (4096, 1, 4), (4096, 4, 4),
                  (8192, 1, 8), (8192, 2, 8)]  # fmt: skip


def bench_stream(name, n, k, bw, l2) -> list[dict]:
    """The read floor of one layer's int4 weights + scales (group 128): the fastest of a few
    loads-only Triton configs and torch's int32 sum, each over `copies` buffers in one graph."""
    dev = torch.device("cuda")
    nbytes = n * k // 2 + n * (k // 128) * 2
    n_words = nbytes // 4
    copies = max(2, -(-4 * l2 // nbytes))
    bufs = [torch.randint(0, 1 << 30, (n_words,), device=dev, dtype=torch.int32)]
    bufs += [b.clone() for b in bufs * (copies - 1)]
    row = {"layer": name, "n": n, "k": k, "bytes": nbytes, "sweep": []}
    for block, per, warps in STREAM_CONFIGS:
        grid = -(-n_words // (block * per))
        outs = torch.empty(grid, device=dev, dtype=torch.int32)

        def call(i, block=block, per=per, warps=warps, grid=grid, outs=outs):
            _stream_kernel[(grid,)](bufs[i], outs, n_words, PER=per, BLOCK=block, num_warps=warps)

        t = time_graph(call, copies)
        row["sweep"].append(
            {"config": (block, per, warps), "us": t * 1e6, "bw_frac": nbytes / t / bw}
        )
    t = time_graph(lambda i: bufs[i].sum(dtype=torch.int64), copies)
    row["torch_sum_us"] = t * 1e6
    best = min(row["sweep"], key=lambda r: r["us"])
    row["best"] = best
    print(
        f"{name:8s} {nbytes / 1e6:6.1f} MB: triton best {best['us']:6.1f} us "
        f"({100 * best['bw_frac']:.0f}% BW) {best['config']} | torch sum "
        f"{row['torch_sum_us']:6.1f}",
        flush=True,
    )
    return [row]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="w4a16_mma.json")
    ap.add_argument("--ms", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--sweep-ms", default="1,16,64", help="M values with a config sweep")
    ap.add_argument("--shared-only", action="store_true", help="only M = 9-64, shared dequant")
    ap.add_argument("--stream-only", action="store_true", help="only the read floor per layer")
    ap.add_argument("--models", default="7b", help="comma-separated: 7b, 3b (Qwen2.5 shapes)")
    args = ap.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"{props.name}: {num_sms} SMs, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    results = {"gpu": props.name, "copy_bw": bw, "rows": []}
    ms = [int(v) for v in args.ms.split(",")]
    sweep_ms = {int(v) for v in args.sweep_ms.split(",")}
    shapes = [
        (f"{model} {layer}" if "," in args.models else layer, nk)
        for model in args.models.split(",")
        for layer, nk in MODEL_SHAPES[model].items()
    ]
    for name, (n, k) in shapes:
        if args.stream_only:
            results["rows"] += bench_stream(name, n, k, bw, l2)
        elif args.shared_only:
            results["rows"] += bench_shared(name, n, k, bw, l2, num_sms)
        else:
            results["rows"] += bench_shape(name, n, k, ms, sweep_ms, bw, l2, num_sms)
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
