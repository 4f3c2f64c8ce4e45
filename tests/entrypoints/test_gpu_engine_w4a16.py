"""GPU acceptance for 4-bit serving: an AutoAWQ checkpoint (zero points, group 128) of Qwen2.5-3B's
shapes (two layers, random weights) through the full engine, greedy tokens against transformers
on the same dequantized weights. 80 sequences and 512-token prefill chunks put every band of the
kernel registry to work: the tensor-core GEMV, both wgmma GEMMs, dequant + cuBLAS."""

from __future__ import annotations

import random

import pytest
import torch

from pagoda import SamplingParams
from tests.entrypoints.test_gpu_engine import _save, assert_greedy_matches, engine, hf_greedy
from tests.quant.test_autoawq_load import _awq_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("eager", [True, False])
def test_awq_engine_greedy_equals_transformers_gpu(tmp_path, eager):
    from pagoda.layers import wna16_kernels as wk

    hf, awq = _awq_pair(tmp_path)
    rng = random.Random(1)
    prompts = [[rng.randrange(0, 150000) for _ in range(n)] for n in (300, 700, 100, 33)]
    prompts += [[rng.randrange(0, 150000) for _ in range(rng.randrange(4, 24))] for _ in range(76)]
    ref, ref_logits = hf_greedy(hf, prompts, 8)
    del hf
    torch.cuda.empty_cache()
    llm = engine(awq, eager, quantization="AWQ", max_num_seqs=128, max_num_batched_tokens=512)
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, ref_logits)
    # on an H200 the gate_up table holds the TMA GEMM for 17-512 rows (3B down: 65-256): the
    # 80 decodes and the 512-token chunks ran it
    if torch.cuda.get_device_capability() == (9, 0):
        gate_up = torch.nn.Linear(2048, 22016, device="meta")
        gate_up.wna16_group_size, gate_up.params_dtype = 128, torch.bfloat16
        cfg = wk.kernel_config(gate_up, 4, True, "cuda")
        names = {k.name for _, k in wk.choose_kernels(cfg).entries}
        assert "mma_wgmma_tma" in names, names


def _awq_pair(tmp_path):
    """(transformers on the dequantized weights, the AutoAWQ checkpoint's directory) of
    Qwen2.5-3B's shapes with two layers."""
    from transformers import AutoModelForCausalLM

    (tmp_path / "dense").mkdir()
    src = _save(tmp_path / "dense", "qwen2.5-3b.json", layers=2)
    dense = _awq_checkpoint(src, tmp_path / "awq", group=128, bf16_scales=True)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).cuda().eval()
    _, unexpected = hf.load_state_dict(dense, strict=False)
    assert not unexpected
    hf.generation_config.eos_token_id = None
    return hf, tmp_path / "awq"
