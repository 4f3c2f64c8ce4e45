"""The fused decode attention compiled for sm_90 on the CPU (no GPU needed): where the L2
prefetch of the next kernels' weights sits in its code."""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")

from tests.kernels.test_gluon_mma_wgmma import compiled_in_child  # noqa: E402

_PTRS = {
    "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*fp32",
    "sin_ptr": "*fp32", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
    "slot_mapping_ptr": "*i64", "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32",
    "out_ptr": "*bf16", "pf_ptr": "*i64", "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32",
    "part_l_ptr": "*fp32", "qk_scale": "fp32",
}  # fmt: skip


def _compile_ptx(num_pf: int, kv_pf_bytes: int = 0, late: bool = False) -> str:
    """The kernel's sm_90 PTX for Qwen2.5-3B heads (16 q / 2 kv, D = 128), 32 splits, PDL
    (in a fresh interpreter: see `compiled_in_child`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagoda.kernels.triton_decode_attention import _fused_decode_attention_kernel as fn

    consts = dict(
        NUM_QUERIES_PER_KV=8, BLOCK_SIZE=16, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_M=16,
        BLOCK_N=16, NUM_SPLITS=32, SLIDING=False, DROP=16, DOT_PRECISION="tf32",
        UPCAST_DOT=False, USE_PDL=True, PDL_EARLY=True, NUM_PF=num_pf, KV_PF_BYTES=kv_pf_bytes,
        PF_LATE=late,
    )  # fmt: skip
    sig = {n: "constexpr" if n in consts else _PTRS.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn, sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm[
        "ptx"
    ]


@pytest.mark.parametrize("num_pf,kv_pf_bytes", [(0, 0), (3, 0), (0, 8192), (2, 8192)])
def test_prefetches_before_the_wait(num_pf, kv_pf_bytes):
    """Everything prefetched sits after the early PDL trigger and before `griddepcontrol.wait`
    (nothing it reads is written by a kernel of the step): one predicated
    `cp.async.bulk.prefetch.L2` per weight range (in a loop over its pieces) and, with the cache
    block size given, one for K and one for V in the loop over the split's first blocks; the
    block-table load feeding them before the wait too, q / k / v loads after it. With neither,
    no prefetch at all."""
    ptx = compiled_in_child("test_decode_attention_code", num_pf, kv_pf_bytes)
    lines = ptx.splitlines()
    pf = [i for i, line in enumerate(lines) if "cp.async.bulk.prefetch.L2.global" in line]
    wait = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    trigger = [i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line]
    assert len(wait) == 1 and len(trigger) == 1
    assert len(pf) == num_pf + (2 if kv_pf_bytes else 0)
    assert all(trigger[0] < i < wait[0] for i in pf)
    for i in pf:
        assert re.match(
            r"\s*@\S+ cp\.async\.bulk\.prefetch\.L2\.global \[%rd\d+\], %r\d+;", lines[i]
        )
    if kv_pf_bytes:  # its size: the constexpr block size, moved into the size register
        assert re.search(rf"mov\.b32 \s*%r\d+, {kv_pf_bytes};", ptx) or f", {kv_pf_bytes};" in ptx
    # the bf16 q / k / v loads of the new token come after the wait
    loads16 = [i for i, line in enumerate(lines) if re.search(r"ld\.global\S*\.b16", line)]
    assert loads16 and min(loads16) > wait[0]


def test_late_weight_prefetch_after_the_stores():
    """PF_LATE: the weight ranges' prefetches follow the program's last partial store (its own
    loads never queue behind them); the cache blocks' stay before the wait."""
    ptx = compiled_in_child("test_decode_attention_code", 2, 8192, True)
    lines = ptx.splitlines()
    pf = [i for i, line in enumerate(lines) if "cp.async.bulk.prefetch.L2.global" in line]
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    stores = [i for i, line in enumerate(lines) if line.strip().startswith(("st.global", "@"))
              and "st.global" in line]  # fmt: skip
    assert len(pf) == 4
    assert all(i < wait for i in pf[:2])
    assert all(i > max(stores) for i in pf[2:])
