"""FP8 linear layers on the GPU: the registry's kernels against the torch references, layer by
layer on llmcompressor's fixtures (bf16 model).

On sm_89+ a loaded FP8 checkpoint runs the FP8-weight GEMV at one row and the FP8-weight GEMM to
the registry's band (W8A16 math: the rows are not rounded to e4m3), cuBLASLt's FP8 GEMM
(per-token or static activation scales) above. The references compute the same e4m3 products
in float32; the kernels accumulate in fp32 in another order and round once to bf16: rtol 2^-7
(one bf16 step).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.engine.args import EngineArgs
from pagoda.kernels.fp8.ops import fp8_gemv_ref
from pagoda.layers.fp8_linear import (
    Fp8DequantMM,
    Fp8LinearMethod,
    Fp8W8A8Reference,
)
from pagoda.layers.linear import LinearBase
from pagoda.models.loader import load_model
from pagoda.quant.fp8 import dequantize_weight_fp8
from tests.quant.test_fp8 import FP8_FIXTURES


def _gpu_model(name: str):
    _, config, *_ = EngineArgs(
        model=str(FP8_FIXTURES / name), dtype="bfloat16", device="cuda"
    ).create_configs()
    return load_model(config, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["dynamic", "static"])
def test_fp8_layers_on_gpu_match_references(name: str) -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores (sm_89+)")
    model = _gpu_model(name)
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [
        m
        for m in model.modules()
        if isinstance(m, LinearBase) and isinstance(m.linear_method, Fp8LinearMethod)
    ]
    assert len(layers) == 8
    for layer in layers:
        assert layer.fp8_backend == "fp8"
        names = layer.fp8_kernels.names
        assert names[:2] == ("fp8_gemv", "fp8_gemm") and names[-1] == "fp8_scaled_mm"
        assert names[2:-1] == ("fp8_gemm_a8",)
        gemm_end = layer.fp8_kernels.entries[2][0] - 1
        # each band's first and last rows: W8A16 math to gemm_end, W8A8 (ours, cuBLASLt) above
        a8_end = layer.fp8_kernels.entries[-1][0] - 1
        for m in (1, 5, gemm_end, gemm_end + 1, a8_end, a8_end + 1, 200):
            x = torch.randn(m, layer.in_features, device="cuda", generator=g).bfloat16()
            got = layer(x).float()
            if m <= gemm_end:  # FP8 weights x bf16 activations (no activation rounding)
                want = fp8_gemv_ref(x, layer.weight, layer.weight_scale, layer.bias).float()
            else:
                want = Fp8W8A8Reference.apply(layer, x, layer.bias).float()
            torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3)
        # sm_80 / 87's kernel above 128 rows: the weight dequantized per call into the model's
        # dtype (code x channel scale rounded to bf16, as the kernel defines it), then a bf16
        # GEMM; the reference multiplies the same bf16 weight in float32. Against the exact
        # FP8 products (fp8_gemv_ref) it differs by each weight's bf16 rounding (2^-9 relative),
        # which sums to ~2^-9 of the row's norm: above atol at outputs near zero.
        x = torch.randn(200, layer.in_features, device="cuda", generator=g).bfloat16()
        got = Fp8DequantMM.apply(layer, x, layer.bias).float()
        w16 = dequantize_weight_fp8(layer.weight, layer.weight_scale, x.dtype)
        want = F.linear(x.float(), w16.float(), None if layer.bias is None else layer.bias.float())
        torch.testing.assert_close(got, want.bfloat16().float(), rtol=2**-7, atol=1e-3)


@pytest.mark.gpu
def test_fp8_engine_graphs_match_eager() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores (sm_89+)")
    from pagoda import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3]}, {"prompt_token_ids": [250, 42]}]
    outs = []
    for eager in (False, True):  # one engine at a time: each sizes its cache from free memory
        llm = LLM(
            str(FP8_FIXTURES / "dynamic"),
            dtype="bfloat16",
            gpu_memory_utilization=0.2,
            enforce_eager=eager,
            print_memory_report=False,
        )
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        llm.shutdown()
    assert outs[0] == outs[1]
