"""CUDA without Triton: the runner captures decode graphs (the torch attention reads no host
length) and W4A16 layers run PyTorch's int4 matmul; greedy tokens are those of eager runs.
Triton is hidden in a subprocess, as `tests/test_no_triton.py` does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
sys.modules["triton"] = None
from pathlib import Path
from pagoda import LLM, SamplingParams
from pagoda.platform import triton_available
from tests.helpers import save_tiny_model

greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
prompts = [[5, 6, 7], [9, 3, 4, 11, 2], [8] * 20]
out = {"triton_available": triton_available()}
bf16 = save_tiny_model("qwen2", Path(sys.argv[1]) / "qwen2", max_position_embeddings=4096)
w4 = Path(sys.argv[2]) / "tests/fixtures/llmcompressor-tiny-w4a16/sym"
# bf16: graphs of 1 Ki and 2 Ki tokens' block tables, the long prompt alone in the second
for name, path, max_len in (("bf16", bf16, 2048), ("w4a16", w4, 256)):
    for eager in (False, True):
        with LLM(str(path), skip_tokenizer_init=True, device="cuda", dtype="bfloat16",
                 max_model_len=max_len, enforce_eager=eager, print_memory_report=False,
                 gpu_memory_utilization=0.3) as llm:
            res = llm.generate(prompts, greedy, use_tqdm=False)
            if max_len > 1024:
                res += llm.generate([[7] * 1500], greedy, use_tqdm=False)
            key = f"{name}_{'eager' if eager else 'graphs'}"
            out[key] = [r.outputs[0].token_ids for r in res]
            out[key + "_sizes"] = llm.memory_report().cuda_graph_sizes
            model = llm.llm_engine.core.runner.model
            out[key + "_backends"] = sorted({
                m.wna16_backend for m in model.modules() if hasattr(m, "wna16_backend")
            })
print("@@" + json.dumps(out))
"""


@pytest.mark.gpu
def test_graphs_and_int4_matmul_without_triton_gpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), str(ROOT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("@@"))[2:])
    assert out["triton_available"] is False
    for name in ("bf16", "w4a16"):
        assert out[f"{name}_graphs_sizes"], name  # graphs captured without Triton
        assert not out[f"{name}_eager_sizes"]
        assert out[f"{name}_graphs"] == out[f"{name}_eager"], name
    assert out["w4a16_graphs_backends"] == ["int4pack"]
    assert out["bf16_graphs_backends"] == []


def test_context_buckets_of_the_torch_graphs():
    """Without Triton a size gets a graph per block-table width: 1, 2, 4 Ki tokens, ... and
    max_model_len; with Triton one graph of max_model_len's width serves every length."""
    import torch

    from pagoda.worker.cuda_graphs import CudaGraphRunner

    def widths(max_model_len, buckets):
        runner = CudaGraphRunner(
            None, 4, max_model_len, 16, 8, torch.bfloat16, torch.device("cpu"),
            context_buckets=buckets,
        )  # fmt: skip
        return runner.widths

    assert widths(8192, True) == [64, 128, 256, 512]
    assert widths(5000, True) == [64, 128, 256, 313]
    assert widths(256, True) == widths(256, False) == [16]
    assert widths(8192, False) == [512]
