"""GPTQ / RTN on one layer: GPTQ lowers the Hessian-weighted error; codes and groups are right."""

from __future__ import annotations

import pytest
import torch

from pagoda.quant.schemes import scheme_args
from pagoda.quantizer.gptq import HessianAccumulator, gptq_quantize
from pagoda.quantizer.rtn import (
    compute_qparams,
    fake_quantize,
    hessian_weighted_error,
    rtn_quantize,
    search_qparams,
)


def _layer(seed: int = 0, out: int = 48, inp: int = 128):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.05
    # Correlated inputs with a few large channels: where GPTQ's error feedback pays off.
    x = torch.randn(1024, inp, generator=g) @ (
        torch.randn(inp, inp, generator=g) * 0.3 + torch.eye(inp)
    )
    x[:, :4] *= 6
    x[:, 7] = 0  # a dead input column
    acc = HessianAccumulator(inp, "cpu")
    acc.add(x[:300])
    acc.add(x[300:])
    return w, x, acc.hessian


@pytest.mark.parametrize("chunk_tokens", [100, 4096])  # several chunks / one at the end
def test_hessian_is_running_mean_of_2xxt(chunk_tokens: int) -> None:
    _, x, _ = _layer()
    acc = HessianAccumulator(x.shape[1], "cpu", chunk_tokens=chunk_tokens)
    for part in x.split(256):
        acc.add(part)
    torch.testing.assert_close(acc.hessian, 2 * x.t() @ x / x.shape[0], rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_input_hessian_error_is_far_below_sampling_noise_gpu(dtype: torch.dtype) -> None:
    # bf16 / fp16 inputs take a half-precision GEMM with a float32 result: exact products, but
    # Hopper's tensor cores do not accumulate float32 as IEEE does (H200: 13x / 43x the float32
    # GEMM's error). What GPTQ needs: the error far below what H already carries from being a
    # sample. Two halves of the data give two estimates of H; their difference is that noise.
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(20000, 512, generator=g) * torch.rand(512, generator=g) * 4).to(dtype)
    truth = 2 * x.double().t() @ x.double() / x.shape[0]
    halves = [2 * p.double().t() @ p.double() / p.shape[0] for p in x.split(10000)]
    noise = (halves[0] - halves[1]).abs().max().item()
    errors = {}
    for half in (True, False):
        acc = HessianAccumulator(512, "cuda")
        xs = x.cuda() if half else x.cuda().float()
        for part in xs.split(1000):
            acc.add(part)
        errors[half] = (acc.hessian.double().cpu() - truth).abs().max().item()
    assert errors[False] < noise / 1000  # float32 accumulation: rounding only
    # the GEMM's error is below 1 % of the sampling noise: no GPTQ decision can depend on it
    assert errors[True] < noise / 100


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM"])
def test_scale_search_equals_scaling_every_candidate(scheme: str) -> None:
    # search_qparams derives each shrunk candidate's scale from the row's range; the direct
    # way scales every weight and takes min-max of each candidate: the same scales, bit for bit.
    g = torch.Generator().manual_seed(11)
    w = torch.randn(300, 128, generator=g) * 0.05
    w[:5] *= 20  # rows with outliers, where the search shrinks the range most
    w[7] = 0  # an all-zero row
    importance = torch.rand(128, generator=g) + 0.1
    args = scheme_args(scheme, 128)
    shrink = 1 - torch.arange(21) / 100
    candidates = (w[None] * shrink[:, None, None]).reshape(-1, 128)
    scale, zero = compute_qparams(candidates, args, torch.bfloat16)
    original = w.repeat(21, 1)
    err = ((original - fake_quantize(original, scale, zero, args)).pow(2) * importance).sum(1)
    pick = err.reshape(21, 300).argmin(0) * 300 + torch.arange(300)
    got_scale, got_zero = search_qparams(w, args, torch.bfloat16, importance)
    assert torch.equal(got_scale, scale[pick])
    assert (got_zero is None) == (zero is None)
    if zero is not None:
        assert torch.equal(got_zero, zero[pick])
    assert int((pick // 300 > 0).sum()) > 50  # the search did shrink many rows


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM"])
def test_scale_search_never_rounds_worse_than_min_max(scheme: str) -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 32, generator=g) * 0.05
    importance = torch.rand(32, generator=g) + 0.1
    args = scheme_args(scheme, 32)

    def row_error(scale, zero):
        return ((w - fake_quantize(w, scale, zero, args)).pow(2) * importance).sum(dim=1)

    plain = row_error(*compute_qparams(w, args, torch.bfloat16))
    searched = row_error(*search_qparams(w, args, torch.bfloat16, importance))
    assert torch.all(searched <= plain)
    # Gaussian rows: min-max spends the grid on the tails; a tighter range rounds better.
    assert float(searched.sum()) < 0.95 * float(plain.sum())


@pytest.mark.parametrize(
    "scheme,group,actorder",
    [
        ("W4A16", 32, "static"),
        ("W4A16", 32, None),
        ("W4A16_ASYM", 64, "static"),
        ("W8A16", -1, None),
    ],
)
@pytest.mark.parametrize("scales", ["first_touch", "upfront"])
def test_gptq_beats_rtn_on_hessian_weighted_error(scheme: str, group: int, actorder, scales):
    w, _, h = _layer()
    args = scheme_args(scheme, group, actorder)
    rtn = rtn_quantize(w, args, torch.float32)
    gptq = gptq_quantize(
        w, h, args, block_size=32, scale_dtype=torch.float32, scales=scales, keep_unrounded=True
    )
    rtn_err = hessian_weighted_error(w, rtn.dequantize(), h)
    gptq_err = hessian_weighted_error(w, gptq.dequantized, h)
    assert gptq_err < 0.6 * rtn_err
    assert not gptq.used_rtn_fallback
    # Stored codes and scales reproduce exactly what GPTQ fed forward.
    torch.testing.assert_close(gptq.quantized.dequantize(), gptq.dequantized, rtol=0, atol=1e-6)
    q = gptq.quantized.qweight
    assert q.dtype == torch.int8 and int(q.min()) >= args.q_min and int(q.max()) <= args.q_max
    # The values GPTQ rounded give its codes back (what refine.py's offsets start from), and
    # they are not the original weights: the error updates moved them.
    qw = gptq.quantized
    g = qw.group_size
    s = qw.scale.float().repeat_interleave(g, dim=1)
    z = None if qw.zero_point is None else qw.zero_point.float().repeat_interleave(g, dim=1)
    torch.testing.assert_close(fake_quantize(gptq.unrounded, s, z, args), gptq.dequantized)
    assert not torch.allclose(gptq.unrounded, w)


def test_static_actorder_keeps_groups_in_original_column_order() -> None:
    w, _, h = _layer(seed=3)
    args = scheme_args("W4A16", 32, "static")
    result = gptq_quantize(w, h, args, block_size=16, scale_dtype=torch.float32)
    qw = result.quantized
    assert qw.scale.shape == (48, 4)
    # Column c uses the scale of group c // 32 (no g_idx needed): the trivial dequantization
    # must give GPTQ's weights.
    expanded = qw.scale.repeat_interleave(32, dim=1)
    torch.testing.assert_close(qw.qweight.float() * expanded, result.dequantized, rtol=0, atol=1e-6)
    assert torch.all(result.dequantized[:, 7] == 0)  # the dead column
    assert result.unrounded is None  # kept only when asked (refine.py)


def test_scale_rounded_to_storage_dtype_and_rtn_sym_rule() -> None:
    w = torch.tensor([[0.75, -1.5, 0.0, 0.3]])
    args = scheme_args("W4A16", -1)
    qw = rtn_quantize(w, args, torch.bfloat16)
    assert qw.scale.dtype == torch.bfloat16
    assert float(qw.scale[0, 0]) == pytest.approx(1.5 / 7.5, rel=1e-2)  # compressed-tensors rule
    assert qw.qweight.tolist() == [[4, -7, 0, 1]]  # 1.5 / bf16(0.2) = 7.49 rounds to 7


def _recorded_hessians(tiny_llama, calib_text, tmp_path, round_weights, **kwargs):
    """quantize() on the tiny Llama; each linear's Hessian as GPTQ receives it, by name.
    `round_weights=False` hands the float weights back as the 'quantized' ones."""
    import pagoda.quantizer.pipeline as pipeline
    from pagoda.quantizer import quantize

    seen: dict[str, torch.Tensor] = {}
    real = pipeline._quantize_matrix

    def spy(w, hessian, args, options, report, name):
        seen[name] = hessian.clone()
        qw, deq, loss, unrounded = real(w, hessian, args, options, report, name)
        return qw, deq if round_weights else w.clone(), loss, unrounded

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "_quantize_matrix", spy)
        quantize(str(tiny_llama), tmp_path, group_size=32, dataset=str(calib_text),
                 num_samples=4, max_seq_len=16, device="cpu", dtype="float32", progress=False,
                 **kwargs)  # fmt: skip
    return seen


def test_weighted_hessian_is_2_sum_w_xxt_over_n() -> None:
    _, x, _ = _layer()
    w = torch.rand(x.shape[0], generator=torch.Generator().manual_seed(5)) * 3
    acc = HessianAccumulator(x.shape[1], "cpu", chunk_tokens=100)
    for part, wp in zip(x.split(256), w.split(256)):
        acc.add(part, wp)
    expected = 2 * (x * w[:, None]).t() @ x / x.shape[0]
    torch.testing.assert_close(acc.hessian, expected, rtol=1e-4, atol=1e-3)


def test_loss_weighted_hessian_of_layer0_qkv(tiny_llama, calib_text, tmp_path) -> None:
    """loss_weighted_hessians: layer 0's q/k/v Hessian is 2 Σ_t w_t x_t x_tᵀ / N with
    w_t = ||dL/dq_t||² + ||dL/dk_t||² + ||dL/dv_t||² (mean 1), computed here with autograd
    on the transformers model; without the option the weights are 1."""
    from transformers import AutoModelForCausalLM

    import pagoda.quantizer.api as api

    captured = {}
    real = api.quantize_layers

    def spy(*args, **kwargs):
        captured["samples"] = args[2]
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(api, "quantize_layers", spy)
        plain = _recorded_hessians(tiny_llama, calib_text, tmp_path / "a", True)
        guided = _recorded_hessians(
            tiny_llama, calib_text, tmp_path / "b", True, loss_weighted_hessians=True
        )
    samples = captured["samples"]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    attn = model.model.layers[0].self_attn
    xs, ws = [], []
    for ids in samples:
        outs = {}
        hooks = [
            getattr(attn, n).register_forward_hook(
                lambda m, i, o, n=n, outs=outs: outs.update({n: (i, o)})
            )
            for n in ("q_proj", "k_proj", "v_proj")
        ]
        logits = model(ids[None]).logits[0, :-1]
        for h in hooks:
            h.remove()
        loss = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum")
        grads = torch.autograd.grad(loss, [outs[n][1] for n in ("q_proj", "k_proj", "v_proj")])
        xs.append(outs["q_proj"][0][0][0].detach())
        ws.append(sum(g[0].pow(2).sum(-1) for g in grads))
    x, w = torch.cat(xs), torch.cat(ws)
    w = w / w.mean()
    name = "model.layers.0.self_attn.qkv_proj"
    n = x.shape[0]
    torch.testing.assert_close(plain[name], 2 * x.t() @ x / n, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(guided[name], 2 * (x * w[:, None]).t() @ x / n, rtol=1e-3,
                               atol=1e-4)  # fmt: skip
    assert (guided[name] - plain[name]).abs().max() > 1e-2 * plain[name].abs().max()
