"""Triton is optional: with it hidden from the process, every kind of model runs on the torch
paths and no pagoda module imports it.

The subprocess sets `sys.modules["triton"] = None` before anything is imported, which makes
both `import triton` fail and `importlib.util.find_spec("triton")` return None, as a missing
package does. CI also runs the whole suite in a venv without the package (`.ci/run`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, sys
sys.modules["triton"] = None  # as if the package were not installed
from pathlib import Path
import logging
records = []
class Grab(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("pagoda").addHandler(Grab())
logging.getLogger("pagoda").setLevel(logging.INFO)

from pagoda import LLM, SamplingParams
from pagoda.platform import triton_available
from tests.helpers import save_tiny_model

root = Path(sys.argv[1])
greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
out = {"triton_available": triton_available()}
opts = dict(device="cpu", max_model_len=256, print_memory_report=False)

base = save_tiny_model("qwen2", root / "qwen2")
with LLM(str(base), skip_tokenizer_init=True, **opts) as llm:
    out["bf16"] = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids

w4 = Path(sys.argv[2]) / "tests/fixtures/llmcompressor-tiny-w4a16/sym"
with LLM(str(w4), **opts) as llm:
    out["w4a16"] = llm.generate(["w1 w2 w3"], greedy, use_tqdm=False)[0].outputs[0].token_ids

from pagoda.lora.request import LoRARequest
from tests.lora.adapters import make_adapter
make_adapter(base, root / "adapter", seed=3)
with LLM(str(base), skip_tokenizer_init=True, enable_lora=True, **opts) as llm:
    lora = LoRARequest("a", 1, str(root / "adapter"))
    res = llm.generate([[5, 6, 7]], greedy, use_tqdm=False, lora_request=lora)
    out["lora"] = res[0].outputs[0].token_ids

from tests.models.test_qwen2_5_vl import _conversation, save_tiny_vl
save_tiny_vl(root / "vl")
with LLM(str(root / "vl"), dtype="float32", limit_mm_per_prompt={"image": 1}, **opts) as llm:
    res = llm.chat(_conversation(["a"]), greedy, use_tqdm=False)
    out["vl"] = res[0].outputs[0].token_ids

out["modules"] = sorted(
    m for m in sys.modules
    if sys.modules[m] is not None and (m.split(".")[0] == "triton" or "kernels.triton" in m)
)
out["logs"] = [r for r in records if "Triton" in r]
print("@@" + json.dumps(out))
"""


@pytest.mark.slow
def test_every_model_kind_runs_without_triton(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), str(ROOT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("@@"))
    out = json.loads(line[2:])
    assert out["triton_available"] is False
    for kind in ("bf16", "w4a16", "lora", "vl"):
        assert len(out[kind]) == 4, kind
    assert out["modules"] == []  # no pagoda.kernels.triton_* module, no triton
    # one line per engine (four engines) says which paths run
    assert len(out["logs"]) == 4 and "torch paths" in out["logs"][0]


def test_python_dash_m_pagoda_is_the_cli():
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda", "generate", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    assert "--cpu-offload-gb" in proc.stdout


SWEEP = r"""
import importlib, json, pkgutil, sys
sys.modules["triton"] = None  # as if the package were not installed
import pagoda

failed = {}
for info in pkgutil.walk_packages(pagoda.__path__, "pagoda."):
    leaf = info.name.rsplit(".", 1)[-1]
    if leaf.startswith(("triton_", "gluon_")) or leaf == "__main__":
        continue  # the Triton kernels themselves, imported only where Triton is installed
    try:
        importlib.import_module(info.name)
    except Exception as e:  # noqa: BLE001 - every failure is reported below
        failed[info.name] = f"{type(e).__name__}: {e}"
print("@@" + json.dumps(failed))
"""


def test_every_module_imports_without_triton():
    # Modules only fail for an optional extra that is not installed (a clear ModuleNotFoundError
    # naming it), never because Triton is absent.
    proc = subprocess.run(
        [sys.executable, "-c", SWEEP],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("@@"))
    failed = json.loads(line[2:])
    assert not [m for m, err in failed.items() if "triton" in err.lower()], failed
    assert all(err.startswith("ModuleNotFoundError") for err in failed.values()), failed
