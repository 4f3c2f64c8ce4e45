"""W4A16 Qwen3-VL: `pagoda quantize` (RTN, text calibration) keeps the vision tower dense, and
pagoda serves the compressed-tensors checkpoint as transformers + compressed-tensors load it.

Oracle: transformers' Qwen3VLForConditionalGeneration on the written directory (its text
linears decompressed by compressed-tensors): logits, and greedy tokens through the engine, for
text only and with an image.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from pagoda import LLM, SamplingParams
from pagoda.quantizer.api import quantize
from tests.models.test_qwen2_5_vl import _conversation
from tests.models.test_qwen3_vl import CASES, MAX_NEW, _hf_inputs, save_tiny_qwen3_vl


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_vl_w4a16")
    save_tiny_qwen3_vl(root / "src")
    quantize(
        str(root / "src"), root / "out", method="rtn", group_size=32,
        ignore=["lm_head", "re:.*visual.*"], progress=False,
    )  # fmt: skip
    return root


def test_vision_tower_is_copied_unquantized(w4a16):
    before = load_file(w4a16 / "src" / "model.safetensors")
    after = load_file(w4a16 / "out" / "model.safetensors")
    vision = [k for k in before if ".visual." in f".{k}"]
    assert any("deepstack_merger_list" in k for k in vision) and any(
        "pos_embed" in k for k in vision
    )
    for name in vision:
        assert torch.equal(before[name], after[name]), name
    assert any(k.endswith("q_proj.weight_packed") for k in after)
    config = json.loads((w4a16 / "out" / "config.json").read_text())
    ignored = config["quantization_config"]["ignore"]
    assert "model.visual.deepstack_merger_list.0.linear_fc1" in ignored


def test_served_like_transformers_loads_it(w4a16):
    pytest.importorskip("compressed_tensors")
    from transformers import Qwen3VLForConditionalGeneration

    out = w4a16 / "out"
    hf = Qwen3VLForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    assert hasattr(hf.model.language_model.layers[0].self_attn.q_proj, "quantization_scheme")
    assert not hasattr(hf.model.visual.blocks[0].attn.qkv, "quantization_scheme")
    llm = LLM(
        str(out), dtype="float32", device="cpu", max_model_len=512, block_size=8,
        limit_mm_per_prompt={"image": 2}, print_memory_report=False,
    )  # fmt: skip
    assert llm.llm_engine.model_config.quantization is not None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.chat([_conversation(keys) for keys in CASES.values()], params, use_tqdm=False)
    for got, (name, keys) in zip(outs, CASES.items(), strict=True):
        ids = got.prompt_token_ids
        with torch.no_grad():
            ref = hf.generate(
                **_hf_inputs(ids, keys), max_new_tokens=MAX_NEW, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        assert got.outputs[0].token_ids == ref[0, len(ids) :].tolist(), name
    llm.shutdown()
