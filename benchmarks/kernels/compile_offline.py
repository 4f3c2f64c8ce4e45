"""Compile the tensor-core W4A16 GEMV for sm_90 / sm_80 without a GPU (Triton's PTX backend runs
on the CPU): catches compile errors before a device call is spent, and reports registers,
spills and shared memory per variant.

    python benchmarks/kernels/compile_offline.py [--arch 90]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pagoda.kernels.wna16 import triton_w4a16_mma as mm  # noqa: E402

_TYPES = {
    "x_ptr": "*i32",
    "w_ptr": "*i32",
    "sp_ptr": "*i8",
    "zp_ptr": "*i8",
    "b_ptr": "*bf16",
    "out_ptr": "*bf16",
    "ws_ptr": "*fp32",
    "wsi_ptr": "*i32",
    "cnt_ptr": "*i32",
}
_CONSTEXPRS = (
    "GROUP_TILES", "KT", "NB", "HAS_BIAS", "HAS_ZP", "ONE_SPLIT", "INTERPRET", "USE_PDL",
)  # fmt: skip


def gemv_variant(arch: int, warps: int = 1, shared: bool = False, **const) -> dict:
    """`_w4_mma_gemv_kernel` (or, `shared`, `_w4_mma_gemv_shared_kernel`) with `const`."""
    fn = mm._w4_mma_gemv_shared_kernel if shared else mm._w4_mma_gemv_kernel
    base = dict(
        GROUP_TILES=2, KT=2, NB=1, HAS_BIAS=False, HAS_ZP=False, ONE_SPLIT=True, INTERPRET=False,
        USE_PDL=arch >= 90,
    )  # fmt: skip
    base.update(const)
    base = {k: v for k, v in base.items() if k in fn.arg_names}
    sig = {name: "constexpr" if name in _CONSTEXPRS else _TYPES.get(name, "i32")
           for name in fn.arg_names}  # fmt: skip
    src = ASTSource(fn, sig, constexprs=base)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    return {"shared": k.metadata.shared, **_ptxas_usage(k.asm["ptx"], arch)}


def _ptxas_usage(ptx: str, arch: int) -> dict:
    """Registers / spills as ptxas -v reports them (Triton ships ptxas)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        ptxas = get_ptxas(arch).path
        sm = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        res = subprocess.run(
            [ptxas, "-v", f"--gpu-name={sm}", str(src), "-o", str(Path(d) / "k.cubin")],
            capture_output=True,
            text=True,
        )
    text = res.stderr + res.stdout
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    return {
        "regs": int(regs.group(1)) if regs else None,
        "spill_stores": int(spill.group(1)) if spill else None,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", type=int, default=90)
    ns = p.parse_args()
    # The M = 1 configs of the Qwen2.5-3B / 7B layers (`default_mma_config`).
    variants = {
        "qkv/o/down (4, 16, 1)": dict(KT=4, ONE_SPLIT=False, HAS_BIAS=True),
        "gate_up (2, 1, 1)": {},
        "3B gate_up (2, 2, 1)": dict(ONE_SPLIT=False),
        "7B down (4, 16, 2)": dict(KT=4, ONE_SPLIT=False, warps=2),
        "zp (4, 16, 1)": dict(KT=4, ONE_SPLIT=False, HAS_ZP=True),
        # M = 9-32 (sm_80-89: the Hopper GEMMs take these rows on sm_90)
        "shared 2 blocks split": dict(shared=True, NB=2, KT=2, ONE_SPLIT=False, warps=2),
        "shared 4 blocks split bias": dict(
            shared=True, NB=4, KT=4, ONE_SPLIT=False, HAS_BIAS=True, warps=2
        ),
    }
    for name, const in variants.items():
        try:
            info = gemv_variant(ns.arch, **const)
            print(f"sm_{ns.arch} {name:28s} ok  {info}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"sm_{ns.arch} {name:28s} FAILED {type(e).__name__}: {str(e)[:2000]}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
