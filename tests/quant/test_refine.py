"""Block-output refinement of GPTQ's rounding (`--refine-steps`): it lowers each layer's output
error on the calibration data, and a refinement that raises it is thrown away."""

from __future__ import annotations

import pytest
import torch

import pagoda.quantizer.pipeline as pipeline
from pagoda.quantizer import quantize
from tests.quant.test_awq_vs_rtn import _per_layer_errors, _qwen2

NUM_SAMPLES, SEQ_LEN, SEED = 16, 64, 0
COMMON = dict(method="gptq", scheme="W4A16", group_size=32, dataset="random",
              num_samples=NUM_SAMPLES, max_seq_len=SEQ_LEN, seed=SEED, progress=False,
              device="cpu", dtype="float32")  # fmt: skip


def _spy_refine(mp: pytest.MonkeyPatch, calls: list, **override) -> None:
    real = pipeline.refine_layer

    def spy(layer, targets, *args, **kwargs):
        kwargs.update(override)
        result, report = real(layer, targets, *args, **kwargs)
        calls.append((targets, result, report))
        return result, report

    mp.setattr(pipeline, "refine_layer", spy)


def test_refine_lowers_the_layer_output_error(tmp_path) -> None:
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    src = _qwen2(tmp_path / "qwen2", 11, kv_heads=2, bias_std=0.5, outlier=12.0)  # biases, GQA
    quantize(str(src), tmp_path / "gptq", **COMMON)
    calls: list = []
    with pytest.MonkeyPatch.context() as mp:
        _spy_refine(mp, calls)
        report = quantize(str(src), tmp_path / "refined", refine_steps=16, **COMMON)
    assert len(calls) == len(report.layers) == 4
    for layer in report.layers:
        r = layer.refine
        assert r is not None and r.kept == (r.after < r.before)
    # A kept refinement lowered the layer's calibration error and moved some codes; the codes
    # returned are the kept ones. (Signed steps move many codes at once, and on this model
    # they lower layers 0-2 and raise layer 3, whose GPTQ codes then stay.)
    assert calls[0][2].kept and calls[0][2].after < 0.99 * calls[0][2].before
    for targets, result, r in calls:
        moved = [not torch.equal(result[t.attr].qweight, t.quantized.qweight) for t in targets]
        if r.kept:
            assert r.after < r.before and 0 < r.changed < 0.5 and any(moved)
        else:
            assert not any(moved)

    # Read back by transformers (an oracle independent of pagoda's loader), layer 0 on the
    # calibration samples: its input is the embeddings in both models, so its output error
    # must be the lower one refine reported.
    g = torch.Generator().manual_seed(SEED)
    samples = [torch.randint(0, 384, (SEQ_LEN,), generator=g) for _ in range(NUM_SAMPLES)]
    decompress = dict(quantization_config=CompressedTensorsConfig(run_compressed=False))

    def load(path, **kwargs):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()

    dense = load(src)
    gptq = _per_layer_errors(dense, load(tmp_path / "gptq", **decompress), samples)
    refined = _per_layer_errors(dense, load(tmp_path / "refined", **decompress), samples)
    assert refined[0] < 0.99 * gptq[0], (gptq, refined)


def test_a_refinement_that_raises_the_error_is_discarded(tmp_path) -> None:
    src = _qwen2(tmp_path / "qwen2", 13, kv_heads=2, bias_std=0.5, outlier=12.0)
    calls: list = []
    with pytest.MonkeyPatch.context() as mp:
        # Steps so large that every offset swings to a bound: most codes flip at random
        _spy_refine(mp, calls, lr=20.0)
        quantize(str(src), tmp_path / "refined", refine_steps=4, **COMMON)
    assert any(not r.kept for _, _, r in calls)
    for targets, result, r in calls:
        if not r.kept:
            assert r.after >= r.before
            for t in targets:
                assert torch.equal(result[t.attr].qweight, t.quantized.qweight)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(refine_steps=-1), "refine_steps must be >= 0"),
        (dict(refine_steps=4, method="awq"), "refine_steps applies to"),
        (dict(refine_steps=4, dataset=None, method="rtn"), "refine_steps applies to"),
    ],
)
def test_refine_steps_checked(kwargs, match, tmp_path) -> None:
    args = {**COMMON, **kwargs}
    with pytest.raises(ValueError, match=match):
        quantize(None, tmp_path / "out", **args)
