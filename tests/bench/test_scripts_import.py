"""Every benchmark script imports: a name a kernel module dropped (e.g. a script importing a helper
that a kernel module no longer has) fails here, not on the GPU.
Scripts run their work under `if __name__ == "__main__"`, so importing one does no work. They
are imported in one child process: the offline compilers drop TRITON_INTERPRET at import (on
purpose), which would leave kernels imported after them unable to run in this process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")  # most scripts import the Triton kernels at the top

ROOT = Path(__file__).resolve().parents[2]
# the no-Triton benchmarks block `import triton` for their whole process on purpose
# (sys.modules), which would break every script imported after them in the child process
_BLOCKS_TRITON = ("no_triton_vl.py", "no_triton_decode.py")
SCRIPTS = sorted(
    str(p.relative_to(ROOT))
    for p in (ROOT / "benchmarks").rglob("*.py")
    if p.name not in _BLOCKS_TRITON
)

_CHILD = """
import importlib.util, json, sys, traceback
failed = {}
for path in json.loads(sys.argv[1]):
    # as `python path` does: the script's own folder first on sys.path (sibling imports)
    sys.path.insert(0, path.rsplit("/", 1)[0])
    spec = importlib.util.spec_from_file_location("_bench_" + path.replace("/", "_")[:-3], path)
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except BaseException:
        failed[path] = traceback.format_exc(limit=3)
    sys.path.pop(0)
print(json.dumps(failed))
"""


def test_every_benchmark_script_imports():
    assert len(SCRIPTS) > 20, SCRIPTS
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(SCRIPTS)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    failed = json.loads(out.stdout.strip().splitlines()[-1])
    assert not failed, "\n".join(f"{k}:\n{v}" for k, v in failed.items())
