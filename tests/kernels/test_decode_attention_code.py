"""The fused decode attention compiled for sm_90 on the CPU (no GPU needed): where the L2
prefetch of its first cache blocks sits in its code."""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")

from tests.kernels.test_gluon_mma_wgmma import compiled_in_child  # noqa: E402

_PTRS = {
    "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*fp32",
    "sin_ptr": "*fp32", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
    "slot_mapping_ptr": "*i64", "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32",
    "out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
    "k_center_ptr": "*fp32", "qk_scale": "fp32", "k_scale": "fp32", "v_scale": "fp32",
}  # fmt: skip


def _compile_ptx(kv_pf_bytes: int = 0) -> str:
    """The kernel's sm_90 PTX for Qwen2.5-3B heads (16 q / 2 kv, D = 128), 32 splits, PDL
    (in a fresh interpreter: see `compiled_in_child`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagoda.kernels.attention.triton_decode_attention import (
        _fused_decode_attention_kernel as fn,
    )

    consts = dict(
        NUM_QUERIES_PER_KV=8, BLOCK_SIZE=16, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_M=16,
        BLOCK_N=16, NUM_SPLITS=32, SLIDING=False, DROP=16, DOT_PRECISION="tf32",
        UPCAST_DOT=False, USE_PDL=True, PDL_EARLY=True, KV_PF_BYTES=kv_pf_bytes, QLEN=1,
        FP8_MAX=0.0, K_CENTER=False,  # a bf16 cache
    )  # fmt: skip
    sig = {n: "constexpr" if n in consts else _PTRS.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn, sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm[
        "ptx"
    ]


def _lines(ptx: str, pattern: str) -> list[int]:
    return [i for i, line in enumerate(ptx.splitlines()) if re.search(pattern, line)]


@pytest.mark.parametrize("kv_pf_bytes", [0, 8192])
def test_prefetches_before_the_wait(kv_pf_bytes):
    """Everything prefetched sits after the early PDL trigger and before `griddepcontrol.wait`
    (nothing it reads is written by a kernel of the step): with the cache block size given, one
    predicated `cp.async.bulk.prefetch.L2` for K and one for V in the loop over the split's
    first blocks, fed by block-table loads before the wait too; the bf16 q / k / v loads come
    after it. Without, no prefetch at all."""
    ptx = compiled_in_child("test_decode_attention_code", kv_pf_bytes)
    pf = _lines(ptx, r"cp\.async\.bulk\.prefetch\.L2\.global")
    (wait,) = _lines(ptx, r"griddepcontrol\.wait")
    (trigger,) = _lines(ptx, r"griddepcontrol\.launch_dependents")
    assert len(pf) == (2 if kv_pf_bytes else 0)
    assert all(trigger < i < wait for i in pf)
    lines = ptx.splitlines()
    for i in pf:
        assert re.match(
            r"\s*@\S+ cp\.async\.bulk\.prefetch\.L2\.global \[%rd\d+\], %r\d+;", lines[i]
        )
    # before the wait: the sequence length (+ the block table with the cache prefetch) as
    # 32-bit loads; the bf16 q / k / v loads after it
    early32 = [i for i in _lines(ptx, r"ld\.global\S*\.b32 ") if i < wait]
    assert len(early32) == (2 if kv_pf_bytes else 1)
    loads16 = _lines(ptx, r"ld\.global\S*\.b16")
    assert loads16 and min(loads16) > wait
