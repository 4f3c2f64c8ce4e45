"""FP8 linear layers on the GPU: the registry's kernels against the W8A8 reference.

On sm_90 a loaded FP8 checkpoint runs the FP8-weight GEMV at one row and cuBLASLt's FP8 GEMM
(per-token activation scales) above; on sm_89 only the GEMM. Oracle: the same checkpoint on the
CPU with `Fp8W8A8Reference` (float32). The GPU model runs in bf16, so the two differ by bf16
rounding of activations between layers (2^-9 relative each, a few tens per token through two
layers) and by the e4m3 rounding of activations those flips move (2^-4 relative of one element);
0.15 on logits of magnitude <= 5 bounds that, while the W8A16 model (activations not rounded to
e4m3) is 0.87 away from the W8A8 logits on this checkpoint: the test tells them apart.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.engine.args import EngineArgs
from pagoda.layers.fp8_linear import Fp8LinearMethod
from pagoda.layers.linear import LinearBase
from pagoda.models.loader import load_model
from tests.quant.test_fp8 import FP8_FIXTURES

IDS = torch.tensor([5, 17, 99, 3, 250, 42, 7, 301, 11, 64, 128, 2, 77, 190, 33, 8])


def _logits(model_dir, device: str, dtype: str, reference: bool = False) -> torch.Tensor:
    _, config, *_ = EngineArgs(model=str(model_dir), dtype=dtype, device=device).create_configs()
    model = load_model(config, device)
    if reference:
        for m in model.modules():
            if isinstance(m, LinearBase) and isinstance(m.linear_method, Fp8LinearMethod):
                m.linear_method.use_w8a8_reference(m)
    ids = IDS.to(device)
    with torch.no_grad():
        rows = [model.compute_logits(model(ids, torch.arange(len(ids), device=device)))]
        # one row at a time: the batch-1 GEMV path
        rows.append(model.compute_logits(model(ids[:1], torch.arange(1, device=device))))
    return model, [r.float().cpu() for r in rows]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["dynamic", "static"])
def test_fp8_checkpoint_on_gpu_matches_w8a8_reference(name: str) -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores (sm_89+)")
    model, gpu = _logits(FP8_FIXTURES / name, "cuda", "bfloat16")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.fp8_backend == "fp8"
    want = (
        ("fp8_gemv", "fp8_scaled_mm")
        if torch.cuda.get_device_capability() >= (9, 0)
        else ("fp8_scaled_mm",)
    )
    assert qkv.fp8_kernels.names == want
    _, ref = _logits(FP8_FIXTURES / name, "cpu", "float32", reference=True)
    for got, exp in zip(gpu, ref):
        torch.testing.assert_close(got, exp, rtol=0, atol=0.15)


@pytest.mark.gpu
def test_fp8_layers_capture_in_cuda_graphs() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores (sm_89+)")
    from pagoda import LLM, SamplingParams

    llm = LLM(str(FP8_FIXTURES / "dynamic"), dtype="bfloat16", gpu_memory_utilization=0.2)
    eager = LLM(
        str(FP8_FIXTURES / "dynamic"),
        dtype="bfloat16",
        gpu_memory_utilization=0.2,
        enforce_eager=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3]}, {"prompt_token_ids": [250, 42]}]
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert a == b
