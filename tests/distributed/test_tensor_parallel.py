"""Tensor parallelism on the CPU (gloo, several processes): greedy tokens equal to one rank's and
log-probs within 1e-4, for dense, W4A16, AWQ, GGUF (the embedded model), LoRA and Qwen2.5-VL
with an image; clear errors for sizes a model cannot split and for a rank that dies. Each
scenario runs in a child process bounded by a timeout (tp_child.py), so a hang fails the test
instead of stalling the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagoda.distributed.sharding import check_tensor_parallel_size, shard_tensor
from tests.helpers import save_tiny_model, tiny_config

FIXTURES = Path(__file__).parents[1] / "fixtures"
CHILD = Path(__file__).with_name("tp_child.py")
ROOT = Path(__file__).parents[2]


def _run(*args: str, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(CHILD), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def _assert_same_as_one_rank(result: dict) -> None:
    base = result["1"]
    for size, runs in result.items():
        for ref, got in zip(base, runs, strict=True):
            assert got["tokens"] == ref["tokens"], f"tp={size}"
            for ref_lp, got_lp in zip(ref["logprobs"], got["logprobs"], strict=True):
                assert ref_lp.keys() == got_lp.keys(), f"tp={size}"
                for token, lp in ref_lp.items():
                    assert abs(got_lp[token] - lp) < 1e-4, f"tp={size} token {token}"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    # 4 query heads, 2 KV heads (tp=4 replicates each KV head on 2 ranks); a vocabulary of 250
    # does not divide by 4, so the last rank's vocabulary slice is padded.
    path = tmp_path_factory.mktemp("tiny") / "llama"
    return save_tiny_model("llama", path, vocab_size=250)


# ---------------------------------------------------------------------- no processes


def test_sizes_a_model_cannot_split_are_clear_errors() -> None:
    smollm2 = tiny_config(
        "llama", num_attention_heads=9, num_key_value_heads=3, hidden_size=72, intermediate_size=576
    )
    with pytest.raises(ValueError, match="does not divide the model's 9 attention heads.*1, 3, 9"):
        check_tensor_parallel_size(smollm2, 2)
    check_tensor_parallel_size(smollm2, 3)
    with pytest.raises(ValueError, match="cannot split or replicate the model's 3 KV heads"):
        check_tensor_parallel_size(
            tiny_config("llama", num_key_value_heads=3, num_attention_heads=6, hidden_size=96), 2
        )
    with pytest.raises(ValueError, match="MLP width 130"):
        check_tensor_parallel_size(tiny_config("llama", intermediate_size=130), 4)
    with pytest.raises(ValueError, match="integer >= 1"):
        check_tensor_parallel_size(tiny_config("llama"), 0)


def test_llm_rejects_tp2_on_the_embedded_model_before_starting_ranks() -> None:
    from pagoda import LLM

    with pytest.raises(ValueError, match="9 attention heads; sizes this model supports: 1, 3$"):
        LLM(tensor_parallel_size=2, print_memory_report=False)


def test_shard_tensor_splits_and_replicates() -> None:
    full = torch.arange(8 * 3).reshape(8, 3)
    assert torch.equal(shard_tensor(full, (4, 3), 1, 2, "w"), full[4:])
    assert torch.equal(shard_tensor(full, (8, 1), 2, 3, "w"), full[:, 2:])
    # 2 KV heads over 4 ranks: ranks 0-1 hold head 0, ranks 2-3 head 1.
    heads = [shard_tensor(full, (4, 3), r, 4, "k") for r in range(4)]
    assert torch.equal(heads[1], full[:4]) and torch.equal(heads[2], full[4:])
    with pytest.raises(ValueError, match="cannot be split into parts of 3 over 2"):
        shard_tensor(full, (3, 3), 0, 2, "w")


# ---------------------------------------------------------------------- several processes


@pytest.mark.slow
def test_dense_tp2_tp4_match_one_rank(tiny_llama: Path) -> None:
    _assert_same_as_one_rank(_run("compare", str(tiny_llama), "1", "2", "4", timeout=900))


@pytest.mark.slow
@pytest.mark.parametrize(
    "fixture",
    ["llmcompressor-tiny-w4a16/sym", "llmcompressor-tiny-w4a16/asym", "autoawq-tiny/llama"],
)
def test_w4a16_tp2_matches_one_rank(fixture: str) -> None:
    # compressed-tensors (group 32) and AutoAWQ (group 128, codes packed along the output):
    # row-parallel slices hold whole groups.
    _assert_same_as_one_rank(_run("compare", str(FIXTURES / fixture), "1", "2", timeout=600))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["compressed-tensors", "autoawq"])
def test_w4a16_tp4_matches_one_rank(fmt: str, tmp_path: Path) -> None:
    # The fixtures above have layers whose input splits four ways into less than one group;
    # here every row-parallel input (hidden 128, intermediate 256) splits into whole groups of
    # 32 at tp=4, in both layouts pagoda writes (AutoAWQ packs its codes along the output).
    from pagoda.quantizer.api import quantize

    dense = save_tiny_model("llama", tmp_path / "dense", hidden_size=128, intermediate_size=256)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the quantizer copies a tokenizer
        (dense / name).write_bytes((FIXTURES / "llmcompressor-tiny-w4a16/sym" / name).read_bytes())
    out = tmp_path / fmt
    quantize(str(dense), str(out), scheme="W4A16_ASYM", method="rtn", group_size=32,
             format=fmt, dtype="float32", progress=False)  # fmt: skip
    _assert_same_as_one_rank(_run("compare", str(out), "1", "2", "4", timeout=900))


@pytest.mark.slow
def test_lora_tp2_matches_one_rank(tiny_llama: Path, tmp_path: Path) -> None:
    from tests.lora.adapters import make_adapter

    make_adapter(tiny_llama, tmp_path / "adapter", r=4)
    result = _run(
        "compare", str(tiny_llama), "1", "2", f"--lora={tmp_path / 'adapter'}", timeout=600
    )
    _assert_same_as_one_rank(result)


@pytest.mark.slow
def test_embedded_gguf_model_tp3_matches_one_rank() -> None:
    # SmolLM2-135M: 9 query heads, 3 KV heads: 3 ranks of 3 + 1 heads each.
    _assert_same_as_one_rank(_run("compare", "default", "1", "3", timeout=900))


@pytest.mark.slow
def test_vision_language_tp2_matches_one_rank(tmp_path: Path) -> None:
    from tests.models.test_qwen2_5_vl import save_tiny_vl

    save_tiny_vl(tmp_path / "vl")
    _assert_same_as_one_rank(_run("vl", str(tmp_path / "vl"), "1", "2", timeout=900))


@pytest.mark.slow
def test_killed_rank_is_a_clear_error_within_seconds(tiny_llama: Path) -> None:
    result = _run("kill", str(tiny_llama), "2", timeout=300)
    assert len(result["first"]) == 4
    assert result["error"] == "RankFailure: tensor-parallel rank 1 was killed by signal SIGKILL"
    assert result["seconds"] < 30, result  # a gloo peer's closed connection, not the timeout
    assert result["alive"] == [False]


def test_engine_args_and_flags() -> None:
    from pagoda.engine.args import EngineArgs
    from pagoda.entrypoints.cli_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--model", "m", "--tensor-parallel-size", "2"])
    assert engine_kwargs(ns)["tensor_parallel_size"] == 2
    args = EngineArgs(tensor_parallel_size=2, async_scheduling=True)
    with pytest.raises(ValueError, match="async_scheduling=True cannot be combined"):
        args._async_scheduling(torch.device("cpu"))
    assert EngineArgs(tensor_parallel_size=2)._async_scheduling(torch.device("cuda")) is False
    from pagoda.config import RunnerConfig

    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        RunnerConfig(tensor_parallel_size=0)


def test_speculation_with_tensor_parallelism_is_a_clear_error():
    from pagoda.engine.args import EngineArgs

    args = EngineArgs(
        model=None,
        tensor_parallel_size=2,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2, "adaptive": False},
    )
    with pytest.raises(ValueError, match="speculative_config cannot be combined"):
        args.create_configs()
