"""Every `PAGODA_*` environment variable pagoda reads, in one place.

Each variable has one accessor here; no other module reads `os.environ` for a `PAGODA_*` name.
Values are parsed strictly: an unknown value raises a ValueError that names the variable and
what it accepts, instead of being silently taken as the default.
"""

from __future__ import annotations

import os

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def _flag(name: str, default: bool) -> bool:
    """An on/off switch: 1/true/on/yes or 0/false/off/no (unset or empty: `default`)."""
    env = os.environ.get(name, "").strip().lower()
    if not env:
        return default
    if env in _TRUE:
        return True
    if env in _FALSE:
        return False
    raise ValueError(f"{name}={env!r}: use 1 / on or 0 / off")


# Every kernel a registry may pick, by name: the quantized linears' (`layers/wna16_kernels.py`,
# in priority order), the dense bf16 GEMV at M = 1 (`layers/linear.py`), the fused decode
# attention (`layers/attention.py`) and its L2 prefetch of its first cache blocks.
KERNEL_NAMES = (
    "mma_wgmma_tma",
    "mma_gemv",
    "mma_wgmma",
    "mma_gemm",
    "mma_dequant",
    "triton_gemv",
    "triton_gemm",
    "triton_dequant",
    "torch_int4mm",
    "torch_dequant",
    "dense_gemv",
    "fp8_gemv",
    "fp8_gemm",
    "fp8_gemm_a8",
    "fp8_dequant_mm",
    "fp8_scaled_mm",
    "fused_decode_attn",
    "kv_prefetch",
)


def disabled_kernels() -> frozenset[str]:
    """`PAGODA_DISABLED_KERNELS`: comma-separated kernel names the registries must skip (A/B
    runs; e.g. "mma_gemv,dense_gemv"); an unknown name is a ValueError listing the known ones."""
    env = os.environ.get("PAGODA_DISABLED_KERNELS", "")
    names = frozenset(n.strip().lower() for n in env.split(",") if n.strip())
    unknown = sorted(names - set(KERNEL_NAMES))
    if unknown:
        raise ValueError(
            f"PAGODA_DISABLED_KERNELS names unknown kernel(s) {', '.join(unknown)}; "
            f"known: {', '.join(KERNEL_NAMES)}"
        )
    return names


def kernel_enabled(name: str) -> bool:
    """Whether kernel `name` (one of KERNEL_NAMES) is not listed in PAGODA_DISABLED_KERNELS."""
    assert name in KERNEL_NAMES, name
    return name not in disabled_kernels()


def pdl() -> bool:
    """`PAGODA_PDL` (default on): programmatic dependent launch on sm_90+ (off for A/B runs)."""
    return _flag("PAGODA_PDL", True)


def pdl_early() -> bool:
    """`PAGODA_PDL_EARLY` (default on): short kernels between two GEMVs trigger their
    dependents first thing (off: after their inputs are read)."""
    return _flag("PAGODA_PDL_EARLY", True)


def api_key() -> str | None:
    """`PAGODA_API_KEY`: the server's bearer token when `--api-key` is not given."""
    return os.environ.get("PAGODA_API_KEY") or None


def triton_interpret() -> bool:
    """Whether Triton kernels run in its CPU interpreter (`TRITON_INTERPRET`, Triton's own)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_cache_dir() -> str:
    """Where Triton keeps compiled kernels (`TRITON_CACHE_DIR`, Triton's own; default
    ~/.triton/cache): start-up counts new entries there to tell a cold start from a warm one."""
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".triton", "cache"
    )


def emulated_capability() -> tuple[int, int] | None:
    """`PAGODA_EMULATE_CAPABILITY` ("8.9"): the compute capability `platform.capability` reports
    instead of the device's, so the kernel registries pick what a smaller GPU would run
    (`pagoda bench edge --emulate-capability`); only lower than the real one makes sense."""
    env = os.environ.get("PAGODA_EMULATE_CAPABILITY", "").strip()
    if not env:
        return None
    try:
        major, minor = (int(v) for v in env.split("."))
    except ValueError:
        raise ValueError(
            f"PAGODA_EMULATE_CAPABILITY={env!r}: use MAJOR.MINOR, e.g. 8.9 or 8.7"
        ) from None
    return (major, minor)
