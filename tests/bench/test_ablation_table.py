"""benchmarks/ablation_table.py: the decode-graph ablations as a table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ablation_table  # noqa: E402

RESULT = {
    "model": "config:qwen2.5-3b.json",
    "gpu": "test",
    "logits_argmax_s": 100e-6,
    "graph_runs": [["none", 1.0e-3], ["nokv", 1.2e-3], ["none", 1.1e-3], ["none", 1.05e-3]],
}


def test_rows_median_spread_per_layer_and_mbu():
    none, nokv = ablation_table.rows(RESULT, 10, weights_gb=2.2, copy_tbs=2.0)
    assert none["ablation"] == "none" and none["captures"] == 3
    assert none["graph_us"] == pytest.approx(1050.0) and none["spread_us"] == pytest.approx(100.0)
    assert none["step_tok_s"] == pytest.approx(1 / 1.15e-3)
    assert none["mbu"] == pytest.approx(2.2e9 / 1.15e-3 / 2e12)
    assert nokv["vs_none_per_layer_us"] == pytest.approx((1200 - 1050) / 10)
    table = ablation_table.markdown("t", [none, nokv])
    assert "| nokv | 1 | 1,200.0 (0.0) | 769.2 | +15.00 | 84.6 % |" in table


def test_a_batch_graph_counts_a_token_per_sequence():
    """`ablate_decode.py --batch 8`: a step of the graph yields 8 tokens."""
    none, nokv = ablation_table.rows({**RESULT, "batch": 8, "graph_runs": [["none", 1.9e-3],
                                      ["nokv", 1.8e-3]]}, 10, None, None)  # fmt: skip
    assert none["step_tok_s"] == pytest.approx(8 / 2.0e-3)
    assert nokv["vs_none_per_layer_us"] == pytest.approx(-10.0)


def test_cli_rejects_results_without_the_real_graph(tmp_path):
    path = tmp_path / "ablate.json"
    path.write_text(json.dumps({**RESULT, "graph_runs": [["nokv", 1e-3]]}))
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/ablation_table.py"), str(path)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2 and "no 'none' capture" in done.stderr
    path.write_text("[1, 2]")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/ablation_table.py"), str(path)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2 and "not an ablate_decode.py result" in done.stderr
