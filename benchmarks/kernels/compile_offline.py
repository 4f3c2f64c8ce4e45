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

from pagoda.kernels import triton_w4a16_mma as mm  # noqa: E402

_PTRS = ("x_ptr", "w_ptr", "sp_ptr", "b_ptr", "out_ptr", "ws_ptr", "wsi_ptr", "cnt_ptr")
_TYPES = {
    "x_ptr": "*i32",
    "w_ptr": "*i32",
    "sp_ptr": "*i8",
    "b_ptr": "*bf16",
    "out_ptr": "*bf16",
    "ws_ptr": "*fp32",
    "wsi_ptr": "*i32",
    "cnt_ptr": "*i32",
}


def gemv_variant(arch: int, **const) -> dict:
    fn = mm._w4_mma_gemv_kernel
    base = dict(
        GROUP_TILES=2, KT=2, NB=1, HAS_BIAS=False, ONE_SPLIT=True, GATED=False, INTERPRET=False,
        DRY=False, PF_FIRST=0, PF_LOOP=False, USE_PDL=arch >= 90,
    )  # fmt: skip
    base.update(const)
    sig = {}
    for name in fn.arg_names:
        if name in base:
            sig[name] = "constexpr"
        elif name in _TYPES:
            sig[name] = _TYPES[name]
        else:
            sig[name] = "i32"
    src = ASTSource(fn, sig, constexprs={k: v for k, v in base.items()})
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 1})
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
    variants = {
        "plain KT=2": {},
        "plain KT=4 split": dict(KT=4, ONE_SPLIT=False, HAS_BIAS=True),
        "gated KT=1": dict(KT=1, GATED=True),
        "gated KT=2 split bias": dict(KT=2, GATED=True, ONE_SPLIT=False, HAS_BIAS=True),
        "gated NB=1 per-channel": dict(KT=1, GATED=True, GROUP_TILES=0),
    }
    for name, const in variants.items():
        try:
            info = gemv_variant(ns.arch, **const)
            print(f"sm_{ns.arch} {name:28s} ok  {info}")
        except Exception as e:  # noqa: BLE001
            print(f"sm_{ns.arch} {name:28s} FAILED {type(e).__name__}: {str(e)[:2000]}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
