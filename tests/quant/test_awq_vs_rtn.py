"""AWQ never loses to round-to-nearest, layer by layer, on its calibration data.

Tiny Qwen2 models (q/k/v biases, grouped or full KV heads, outlier channels) are quantized both
ways and read by transformers + compressed-tensors (an oracle independent of pagoda's loader);
each decoder layer is fed the float model's inputs to it, and its output error is compared.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda.quantizer import quantize
from pagoda.quantizer.awq_guard import GuardChoice, choose, evaluation_samples
from tests.helpers import save_tiny_model
from tests.quant.conftest import FIXTURES

NUM_SAMPLES, SEQ_LEN, SEED = 16, 64, 0


def _qwen2(root: Path, seed: int, kv_heads: int, bias_std: float, outlier: float) -> Path:
    """A 4-layer tiny Qwen2 (4 heads) with random q/k/v biases and outlier norm channels."""
    path = save_tiny_model(
        "qwen2", root, seed=seed, num_hidden_layers=4, num_key_value_heads=kv_heads
    )
    state = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(seed + 1)
    outliers = torch.randperm(64, generator=g)[:4]
    for name, t in state.items():
        if name.endswith("_proj.bias"):
            t.normal_(0.0, bias_std, generator=g)
        if name.endswith("layernorm.weight"):
            # Real checkpoints' norms lift a few channels far above the rest.
            t.copy_(1.0 + 0.2 * torch.rand(t.shape, generator=g))
            t[outliers] *= outlier
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "sym" / name, path / name)
    return path


def _layer_calls(model, ids: torch.Tensor) -> list[tuple[tuple, dict, torch.Tensor]]:
    """(args, kwargs, output) of every decoder layer of a transformers model on `ids`."""
    calls: list[tuple[tuple, dict, torch.Tensor]] = []

    def hook(_module, args, kwargs, output):
        out = output[0] if isinstance(output, tuple) else output
        calls.append((args, kwargs, out.detach()))

    handles = [layer.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    with torch.no_grad():
        # No KV cache: a cache in the captured kwargs would let another model's layer attend
        # to this model's keys and values.
        model(ids[None], use_cache=False)
    for h in handles:
        h.remove()
    return calls


def _per_layer_errors(dense, quantized, samples: list[torch.Tensor]) -> list[float]:
    """Mean squared error of each quantized layer's output, fed the float layer's inputs."""
    errors = [0.0] * len(dense.model.layers)
    for ids in samples:
        for i, (args, kwargs, reference) in enumerate(_layer_calls(dense, ids)):
            with torch.no_grad():
                out = quantized.model.layers[i](*args, **kwargs)
            out = out[0] if isinstance(out, tuple) else out
            errors[i] += float((out - reference).pow(2).mean()) / len(samples)
    return errors


# gqa: 2 KV heads (v_proj -> o_proj not smoothed), biases, 12x outlier channels: AWQ's home
# ground. mha: 4 KV heads (v_proj -> o_proj smoothed), no outliers, zero biases: where AWQ's
# local searches alone left layers 0-2 above RTN (output error 1.02-1.09x RTN's).
@pytest.mark.parametrize(
    "seed,kv_heads,bias_std,outlier", [(11, 2, 0.5, 12.0), (13, 4, 0.0, 1.0)], ids=["gqa", "mha"]
)
def test_awq_per_layer_error_is_at_most_rtns(seed, kv_heads, bias_std, outlier, tmp_path) -> None:
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    src = _qwen2(tmp_path / "qwen2", seed, kv_heads, bias_std, outlier)
    common = dict(scheme="W4A16_ASYM", group_size=32, num_samples=NUM_SAMPLES,
                  max_seq_len=SEQ_LEN, seed=SEED, progress=False, device="cpu",
                  dtype="float32")  # fmt: skip
    report = quantize(str(src), tmp_path / "awq", method="awq", dataset="random",
                      **common)  # fmt: skip
    quantize(str(src), tmp_path / "rtn", method="rtn", **common)
    # The smoothing did act (a no-op AWQ would pass trivially).
    assert any(s.ratio is not None for layer in report.layers for s in layer.smoothing)

    # The calibration samples `quantize(dataset="random")` drew.
    g = torch.Generator().manual_seed(SEED)
    samples = [torch.randint(0, 384, (SEQ_LEN,), generator=g) for _ in range(NUM_SAMPLES)]

    def load(path: Path, **kwargs):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()

    # Decompressed on load: dense float weights equal to the checkpoint's dequantized codes.
    decompress = dict(quantization_config=CompressedTensorsConfig(run_compressed=False))

    dense = load(src)
    awq = _per_layer_errors(dense, load(tmp_path / "awq", **decompress), samples)
    rtn = _per_layer_errors(dense, load(tmp_path / "rtn", **decompress), samples)
    for i, (a, r) in enumerate(zip(awq, rtn)):
        assert a <= r, f"layer {i}: AWQ output error {a:.4g} > RTN's {r:.4g} (AWQ {awq}, RTN {rtn})"


def test_guard_scores_evenly_spread_whole_samples() -> None:
    assert evaluation_samples([256] * 64, 4096) == list(range(0, 64, 4))
    assert evaluation_samples([256] * 8, 4096) == list(range(8))  # fewer tokens: all
    assert evaluation_samples([5000, 5000], 100) == [0]  # at least one sample
    with pytest.raises(ValueError, match="max_tokens"):
        evaluation_samples([10], 0)


def test_guard_prefers_awq_on_a_tie_and_rtn_when_it_is_better() -> None:
    assert choose({"rtn": 1.0, "scales": 1.0, "scales+clip": 2.0}).name == "scales"
    assert choose({"rtn": 0.5, "scales": 1.0, "scales+clip": 0.7}).name == "rtn"
    with pytest.raises(ValueError, match="unknown AWQ candidate"):
        GuardChoice("clip", {})
