"""Every benchmark script imports: a name a kernel module dropped (session 19 found
`bench_dense_gemv.py` importing a helper deleted sessions earlier) fails here, not on the GPU.
Scripts run their work under `if __name__ == "__main__"`, so importing one does no work."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("triton")  # most scripts import the Triton kernels at the top

ROOT = Path(__file__).resolve().parents[2]
# no_triton_vl.py blocks `import triton` for its whole process on purpose (sys.modules)
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").rglob("*.py") if p.name != "no_triton_vl.py")


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_benchmark_script_imports(path):
    spec = importlib.util.spec_from_file_location(f"_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
