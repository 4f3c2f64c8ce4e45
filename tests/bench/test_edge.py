"""`pagoda bench edge` end to end on the CPU with a tiny random Qwen2.5-VL config (bf16-shaped
and W4A16 dummy weights, each in its own process): the JSON and the Markdown table."""

from __future__ import annotations

import json

import pytest

from pagoda.cli import main as cli_main

TINY_VL = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_act": "silu",
    "hidden_size": 128,
    "intermediate_size": 256,
    "max_position_embeddings": 4096,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
    "tie_word_embeddings": True,
    "vocab_size": 151936,
    "vision_config": {
        "depth": 2,
        "hidden_act": "silu",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_chans": 3,
        "out_hidden_size": 128,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [1],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
}


@pytest.mark.slow
def test_edge_bench_runs_both_models_and_writes_the_table(tmp_path, capsys):
    cfg = tmp_path / "tiny-vl.json"
    cfg.write_text(json.dumps(TINY_VL))
    out = tmp_path / "out"
    rc = cli_main(
        ["bench", "edge", f"config:{cfg}", f"config:{cfg}:w4a16", "--out", str(out)]
        + ["--device", "cpu", "--dtype", "float32", "--max-model-len", "512"]
        + ["--image-size", "112x84", "--concurrent", "2", "--concurrent-image-size", "168x112"]
        + ["--batch-sizes", "1,2", "--output-len", "4", "--iters", "1"]
        + ["--kv-cache-dtype", "auto,fp8"]  # the W4A16 + FP8-KV row
    )
    assert rc == 0
    results = json.loads((out / "edge.json").read_text())
    assert [r["model"].endswith(":w4a16") for r in results] == [False, True]
    assert [r["kv_cache_dtype"] for r in results] == ["auto", "fp8"]
    bf16, w4 = results
    assert w4["weights_gib"] < bf16["weights_gib"]  # packed int4 decoder linears
    # one byte a K / V value against float32's four: 4x the tokens per byte of cache
    per_byte = [r["kv_tokens"] / r["memory_report"]["kv_cache_bytes"] for r in results]
    assert per_byte[1] == pytest.approx(4 * per_byte[0], rel=1e-6)
    for r in results:
        assert r["concurrent_images"] == {**r["concurrent_images"], "ok": True, "answered": 2}
        assert r["ttft_image_s"] > 0 and set(r["decode_tok_s"]) == {"1", "2"}
        assert r["kv_cache_gib"] > 0 and r["memory_report"]["num_blocks"] > 0
    table = (out / "edge.md").read_text()
    assert "tiny-vl.json:w4a16 + fp8 KV |" in table
    assert (
        "| decode tok/s, batch 2 |" in table and "| concurrent images | ok (2) | ok (2) |" in table
    )


def test_edge_bench_bad_size_is_a_clear_error(tmp_path, capsys):
    rc = cli_main(["bench", "edge", "--out", str(tmp_path), "--image-size", "big"])
    assert rc == 2
    assert "image size 'big': use WIDTHxHEIGHT" in capsys.readouterr().err


def test_edge_bench_bad_kv_cache_dtype_is_a_clear_error(tmp_path, capsys):
    assert cli_main(["bench", "edge", "--out", str(tmp_path), "--kv-cache-dtype", "int4"]) == 2
    assert "--kv-cache-dtype 'int4' is not supported" in capsys.readouterr().err
    args = ["bench", "edge", "--out", str(tmp_path), "--kv-cache-dtype", "auto,fp8,fp8"]
    assert cli_main(args) == 2
    assert "3 values for 2 configurations" in capsys.readouterr().err
