"""FP8 quality on the CPU with real weights: perplexity of full precision, FP8_DYNAMIC W8A8 and
FP8 KV caches (calibrated e4m3, uncalibrated e5m2) on held-out text, W8A8's loss split into
its activations' share (per kind of linear) and its weights'.

W8A8: the dense checkpoint quantized at load (`quantization="fp8"`: per-channel e4m3 weights)
and every FP8 layer switched to `Fp8W8A8Reference`, which rounds activations per token as the
FP8 tensor cores' path does (the CPU's default kernel would not round them). FP8 KV: each
attention layer's K and V go through exactly the cache's round trip (stored as
clamp(x / scale) in the FP8 type, read back as stored * scale) before attention, via a pre-hook
on `Attention` (the no-cache scoring path has no cache to store into). Calibrated scales:
max |k| / 448 and max |v| / 448 per layer over `--calib-windows` windows of the calibration
text (a different file than the held-out text). Keys are centered as the engine centers them
with an FP8 cache (`bind_key_centers`: K minus the mean of RoPE(k bias) over the window's
positions, Qwen2-family layers; softmax cancels the shift) before the round trip; one e4m3
row leaves them uncentered. One process, the same token windows for every row.
`--kv-only` stops after the KV rows. Usage:
python benchmarks/quant/fp8_quality.py MODEL --heldout F --calib F --out R.json [--kv-only]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from pagoda.bench.perplexity import perplexity_of_model
from pagoda.engine.args import EngineArgs
from pagoda.kernels.attention.reference import to_cache_dtype
from pagoda.kernels.fp8.ops import per_token_quant_ref
from pagoda.layers.attention import Attention
from pagoda.layers.fp8_linear import Fp8LinearMethod
from pagoda.layers.linear import LinearBase
from pagoda.model_files import load_tokenizer
from pagoda.models.llama import bind_key_centers
from pagoda.models.loader import load_model
from pagoda.quantizer.fp8 import KVScaleObserver


def _load(model: str, quantization: str | None):
    source, config, *_ = EngineArgs(
        model=model, device="cpu", dtype="float32", quantization=quantization
    ).create_configs()
    return load_model(config, "cpu"), source


def _kv_round_trip(
    model, dtype: torch.dtype, scales: dict[str, tuple[float, float]] | None, center: bool
):
    handles = []
    for name, m in model.named_modules():
        if not isinstance(m, Attention):
            continue
        ks, vs = scales[name] if scales else (1.0, 1.0)
        c = m.k_center if center else None

        def hook(_m, args, ks=ks, vs=vs, c=c):
            q, k, v, meta = args
            if c is not None:  # stored K - c (every score moves by q . c: softmax cancels it)
                k = (k.view(k.shape[0], -1, c.shape[-1]) - c.to(k.dtype)).view(k.shape)
            k = to_cache_dtype(k, dtype, ks).to(k.dtype) * ks
            v = to_cache_dtype(v, dtype, vs).to(v.dtype) * vs
            return q, k, v, meta

        handles.append(m.register_forward_pre_hook(hook))
    return handles


def _activation_round_trip(model, names: list[str]):
    """Pre-hooks rounding the input of each linear `names` per token to e4m3 and back (what
    W8A8 does to activations), the weights left in float."""

    def hook(_m, args):
        x = args[0]
        x_q, scale = per_token_quant_ref(x.reshape(-1, x.shape[-1]))
        return ((x_q.float() * scale).reshape(x.shape).to(x.dtype), *args[1:])

    return [model.get_submodule(n).register_forward_pre_hook(hook) for n in names]


def _calibrate_kv(model, ids: list[int], window: int, n: int) -> dict[str, tuple[float, float]]:
    obs = KVScaleObserver()
    names = [name for name, m in model.named_modules() if isinstance(m, Attention)]
    for name in names:
        obs.watch(model.get_submodule(name), name)
    with torch.no_grad():
        for i in range(n):
            chunk = torch.tensor(ids[i * window : (i + 1) * window])
            if len(chunk) < 2:
                break
            model(chunk, torch.arange(len(chunk)))
    obs.remove()
    out = {}
    for name in names:
        s = obs.scales(name, torch.float32)
        out[name] = (s["k_scale"].item(), s["v_scale"].item())
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--heldout", required=True)
    p.add_argument("--calib", required=True)
    p.add_argument("--max-tokens", type=int, default=20480)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--calib-windows", type=int, default=16)
    p.add_argument("--out", required=True)
    p.add_argument("--kv-only", action="store_true", help="skip the W8A8 rows")
    ns = p.parse_args()
    # one thread: on a shared CPU, OpenMP workers spin-waiting for each other slow every op
    torch.set_num_threads(1)

    dense, source = _load(ns.model, None)
    tokenizer = load_tokenizer(source)
    heldout = Path(ns.heldout).read_text(encoding="utf-8")
    ids = list(tokenizer(heldout, add_special_tokens=False)["input_ids"])[: ns.max_tokens]
    calib = Path(ns.calib).read_text(encoding="utf-8")[:400_000]
    calib_ids = list(tokenizer(calib, add_special_tokens=False)["input_ids"])
    rows = {}

    def score(label: str, model) -> None:
        t0 = time.perf_counter()
        nll, count = perplexity_of_model(model, ids, ns.window, ns.window, torch.device("cpu"))
        rows[label] = {"perplexity": math.exp(nll), "nll": nll, "scored": count}
        rows[label]["seconds"] = time.perf_counter() - t0
        print(label, json.dumps(rows[label]), flush=True)

    score("full precision (float32)", dense)
    scales = _calibrate_kv(dense, calib_ids, ns.window, ns.calib_windows)
    centered = bind_key_centers(dense, ns.window)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    for label, dtype, sc, center in (
        ("FP8 KV e4m3, calibrated scales", e4m3, scales, True),
        ("FP8 KV e4m3, calibrated scales, keys not centered", e4m3, scales, False),
        ("FP8 KV e5m2, scales 1.0", e5m2, None, True),
    ):
        if not center and not centered:
            continue  # no layer has a key center: the same as the row above
        handles = _kv_round_trip(dense, dtype, sc, center)
        score(label, dense)
        for h in handles:
            h.remove()
    if ns.kv_only:
        _write(ns, ids, scales, rows, centered)
        return
    fp8, _ = _load(ns.model, "fp8")
    fp8_linears = [
        name
        for name, layer in fp8.named_modules()
        if isinstance(layer, LinearBase) and isinstance(layer.linear_method, Fp8LinearMethod)
    ]
    # W8A8's loss, decomposed: the activations' per-token rounding alone (float weights), per
    # kind of linear and all together, then the weights' alone (the CPU's W8A16 kernel)
    kinds = sorted({name.rpartition(".")[2] for name in fp8_linears})
    for kind in [*kinds, None]:
        handles = _activation_round_trip(
            dense, [n for n in fp8_linears if kind is None or n.endswith("." + kind)]
        )
        score(f"FP8 activations only ({kind or 'every FP8 linear'}, per token)", dense)
        for h in handles:
            h.remove()
    del dense
    score("FP8 weights only (per channel; activations unrounded)", fp8)
    for name in fp8_linears:
        layer = fp8.get_submodule(name)
        layer.linear_method.use_w8a8_reference(layer)
    score("FP8_DYNAMIC W8A8 (weights per channel, activations per token)", fp8)
    _write(ns, ids, scales, rows, centered)


def _write(ns, ids, scales, rows, centered: int) -> None:
    base = rows["full precision (float32)"]["perplexity"]
    for r in rows.values():
        r["ratio"] = r["perplexity"] / base
    result = {
        "model": ns.model,
        "heldout": ns.heldout,
        "tokens": len(ids),
        "window": ns.window,
        "kv_scales": {k: list(v) for k, v in scales.items()},
        "layers_with_key_center": centered,
        "rows": rows,
    }
    with open(ns.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
