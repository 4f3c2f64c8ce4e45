"""The TMA W4A16 GEMM's main loop in SASS, per config, without a GPU: instructions a loop trip
by opcode, the wgmma they feed, registers and spills (Triton's ptxas and cuobjdump on the CPU).

A static count, not a timing: it says what a variant saves in issue slots (e.g. the
dequantization per MMA of a 256-row tile), which the H200 sweep then has to confirm.

    python benchmarks/kernels/sass_loop.py [--out benchmarks/results/sass_loop.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402

from pagoda.kernels.wna16 import gluon_wgmma_tma as tk  # noqa: E402

# (label, (BLOCK_M, warpgroups, stages, zero points, one split, slabs))
VARIANTS = (
    ("128 rows, 2 slabs (default)", (128, 1, 4, False, True, 2)),
    ("256 rows, 1 slab x 2 wg", (256, 2, 4, False, True, 1)),
    ("128 rows, 1 slab x 2 wg", (128, 2, 4, False, True, 1)),
    ("128 rows, 2 slabs, zp + split", (128, 1, 4, True, False, 2)),
    ("256 rows, 1 slab x 2 wg, zp + split", (256, 2, 4, True, False, 1)),
)
_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/")


def _tool(name: str) -> str:
    path = Path(triton.__file__).parent / "backends/nvidia/bin" / name
    if not path.exists():
        raise SystemExit(f"{path}: not found (Triton's bundled CUDA tools)")
    return str(path)


def _ptxas() -> str:
    """The ptxas Triton itself uses for sm_90 (3.9 ships a newer one for its newer PTX)."""
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        return get_ptxas(90).path
    except TypeError:  # Triton 3.6: no argument
        return get_ptxas().path


def main_loop(sass: str) -> dict:
    """The loop holding the wgmma (HGMMA): the backward branch after the last one and its
    target; instructions a trip by opcode."""
    ins = []
    for line in sass.splitlines():
        m = _ADDR.search(line)
        if m and "*/" in line:
            ins.append((int(m.group(1), 16), line.split("*/", 1)[1].split(";")[0].strip()))
    hgmma = [a for a, i in ins if "HGMMA" in i]
    if not hgmma:
        raise ValueError("no HGMMA in the SASS")
    end, branch = next((a, i) for a, i in ins if a > max(hgmma) and "BRA" in i)
    start = int(re.search(r"0x([0-9a-f]+)", branch).group(1), 16)
    body = [i for a, i in ins if start <= a <= end]
    ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0] for i in body)
    return {"instructions": len(body), "hgmma": ops.get("HGMMA", 0), "opcodes": dict(ops)}


def measure(config: tuple) -> dict:
    asm = tk.compile_sm90(*config)
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = Path(d) / "k.ptx", Path(d) / "k.cubin"
        ptx.write_text(asm["ptx"])
        done = subprocess.run(
            [_ptxas(), "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(cubin)],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode:
            raise RuntimeError(done.stderr[-2000:])
        sass = subprocess.run(
            [_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    info = done.stderr + done.stdout
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    mma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", asm["ptx"])
    return {
        "registers": int(regs.group(1)) if regs else None,
        "spill_store_bytes": int(spills.group(1)) if spills else None,
        "wgmma_n": sorted({int(n) for n in mma}),
        **main_loop(sass),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    ns = p.parse_args()
    rows = []
    print(f"triton {triton.__version__}, sm_90a")
    print(f"{'config':44s} {'regs':>5s} {'spill':>6s} {'N':>5s} {'trip':>5s} {'HGMMA':>6s} "
          f"{'per wgmma x N/128':>18s}")  # fmt: skip
    for label, config in VARIANTS:
        r = {"label": label, "config": list(config), **measure(config)}
        rows.append(r)
        n = r["wgmma_n"][0]
        per = r["instructions"] / r["hgmma"] * 128 / n  # issue slots per 64x128x16 of MMA work
        r["instructions_per_mma_work"] = per
        print(f"{label:44s} {r['registers']:>5} {r['spill_store_bytes']:>6} {n:>5} "
              f"{r['instructions']:>5} {r['hgmma']:>6} {per:>18.1f}")  # fmt: skip
    if ns.out:
        ns.out.write_text(json.dumps({"triton": triton.__version__, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
