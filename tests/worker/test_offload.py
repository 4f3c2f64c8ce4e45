"""cpu_offload_gb: which layers stay on the host for a given size, and outputs identical with
and without offload (on the CPU the "device" is the CPU too, so this checks the bookkeeping:
host copies, staging buffers, rebinding before every layer, prefetch order)."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.cli import main as cli_main
from pagoda.worker.offload import decoder_layers, plan_offload
from tests.helpers import save_tiny_model

GiB = 1 << 30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model("qwen2", tmp_path_factory.mktemp("off") / "m", num_hidden_layers=6)


def _llm(path, **kw):
    return LLM(
        str(path), skip_tokenizer_init=True, max_model_len=64, print_memory_report=False, **kw
    )


def test_plan_takes_the_fewest_layers_evenly_spaced(tiny):
    with _llm(tiny) as llm:
        layers = decoder_layers(llm.llm_engine.core.runner.model)
        per_layer = plan_offload(layers, 0).layer_bytes[0]
        assert plan_offload(layers, 0).layer_indices == ()
        plan = plan_offload(layers, 1.5 * per_layer / GiB)  # 1.5 layers -> 2 whole layers
        assert plan.layer_indices == (1, 4) and plan.offload_bytes == 2 * per_layer
        assert plan_offload(layers, 3 * per_layer / GiB).layer_indices == (1, 3, 5)
        assert plan_offload(layers, 6 * per_layer / GiB).layer_indices == tuple(range(6))
        with pytest.raises(ValueError, match=r"cpu_offload_gb=.* is more than the decoder"):
            plan_offload(layers, 7 * per_layer / GiB)


@pytest.mark.parametrize("num_offloaded", [1, 2, 3, 6])
def test_outputs_identical_with_and_without_offload(tiny, num_offloaded):
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(20, 40))]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    with _llm(tiny, max_num_batched_tokens=16) as llm:  # chunked prefill in both
        ref = llm.generate(prompts, greedy, use_tqdm=False)
        per_layer = plan_offload(decoder_layers(llm.llm_engine.core.runner.model), 0).layer_bytes
    gb = (num_offloaded - 0.5) * per_layer[0] / GiB
    with _llm(tiny, cpu_offload_gb=gb, max_num_batched_tokens=16) as llm:
        out = llm.generate(prompts, greedy, use_tqdm=False)
        runner = llm.llm_engine.core.runner
        off = runner.offloader
        assert len(off.entries) == num_offloaded
        # every step copies each offloaded layer once (+ the next step's first one ahead)
        assert off.copies >= runner_steps(llm) * num_offloaded
        report = llm.memory_report()
        assert report.offloaded_layers == num_offloaded
        assert report.cpu_offload_bytes == num_offloaded * per_layer[0]
        assert "CPU offload" in str(report)
    for a, b in zip(ref, out, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert {k: v.logprob for k, v in la.items()} == {k: v.logprob for k, v in lb.items()}


def runner_steps(llm) -> int:
    return llm.llm_engine.core.num_steps


def test_bad_offload_options_are_clear_errors(tiny, capsys):
    with pytest.raises(ValueError, match=r"cpu_offload_gb must be a number of GiB >= 0"):
        _llm(tiny, cpu_offload_gb=-1)
    with pytest.raises(ValueError, match="cannot be combined with enable_lora"):
        _llm(tiny, cpu_offload_gb=0.0001, enable_lora=True)
    assert cli_main(["generate", "x", "--model", str(tiny), "--cpu-offload-gb", "-2"]) == 2
    assert "cpu_offload_gb must be" in capsys.readouterr().err


def test_quantized_checkpoint_with_offload_is_a_clear_error():
    from pathlib import Path

    w4 = Path(__file__).resolve().parents[1] / "fixtures/llmcompressor-tiny-w4a16/sym"
    with pytest.raises(ValueError, match="cpu_offload_gb works with unquantized checkpoints"):
        LLM(str(w4), cpu_offload_gb=0.001, print_memory_report=False)
