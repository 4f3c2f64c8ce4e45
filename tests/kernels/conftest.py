"""Without Triton (the CI venv that has no Triton package) the modules that test Triton kernels
are not collected: they import the kernels, or run them under the interpreter, throughout. The
torch references they compare against keep their own tests (test_paged_attention_ref.py)."""

from __future__ import annotations

from pagoda.platform import triton_available

TRITON_ONLY = [
    "test_triton_*.py",
    "test_wna16_gemv_bias_pdl.py",
    "test_fused_decode_attention.py",
    "test_fp8_kv_cache.py",
    "test_sliding_window_attention.py",  # compares the Triton kernels with the windowed ref
]

collect_ignore_glob = [] if triton_available() else TRITON_ONLY


def pytest_report_header(config):
    if not triton_available():
        return f"Triton is not installed: tests/kernels/{{{','.join(TRITON_ONLY)}}} not collected"
    return None
