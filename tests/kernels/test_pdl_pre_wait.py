"""The decode path's PDL kernels, compiled for sm_90 on the CPU: before `griddepcontrol.wait`
none writes global memory or reads an activation another kernel of the step writes (the
contract of `pagoda/kernels/pdl.py`); the reads allowed there are weights, host-copied step
inputs and the layer's own KV cache. A race here would show on a GPU only now and then."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from tests.kernels.ptx_pdl import check_pre_wait  # noqa: E402
from tests.kernels.test_gluon_mma_wgmma import compiled_in_child  # noqa: E402

_W4_TYPES = {
    "x_ptr": "*i32", "w_ptr": "*i32", "sp_ptr": "*i8", "zp_ptr": "*i8", "b_ptr": "*bf16",
    "out_ptr": "*bf16", "ws_ptr": "*fp32", "wsi_ptr": "*i32", "cnt_ptr": "*i32",
}  # fmt: skip
_DENSE_TYPES = {
    "x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32",
    "wsi_ptr": "*i32", "cnt_ptr": "*i32",
}  # fmt: skip
_NORM_TYPES = {
    "x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
    "res_out_ptr": "*bf16", "eps": "fp32",
}  # fmt: skip
_REDUCE_TYPES = {
    "out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
    "query_start_loc_ptr": "*i32",
}  # fmt: skip


def _kernel(name: str):
    """(jit function, types, constexprs, activation parameters) of kernel `name`."""
    if name == "w4":
        from pagoda.kernels.wna16 import triton_w4a16_mma as mm

        consts = dict(
            GROUP_TILES=2, KT=4, NB=1, HAS_BIAS=True, HAS_ZP=False, ONE_SPLIT=False,
            INTERPRET=False, USE_PDL=True,
        )  # fmt: skip
        return mm._w4_mma_gemv_kernel, _W4_TYPES, consts, {"x_ptr"}
    if name == "dense":
        from pagoda.kernels.dense import triton_gemv as tg

        consts = dict(
            BLOCK_N=8, BLOCK_K=512, EVEN_N=True, EVEN_K=True, ONE_SPLIT=True, HAS_BIAS=True,
            NUM_STAGES=3, USE_PDL=True,
        )  # fmt: skip
        return tg._gemv_kernel, _DENSE_TYPES, consts, {"x_ptr"}
    if name == "rms_norm":
        from pagoda.kernels.norm_act import triton_fused_ops as fo

        consts = dict(HAS_RESIDUAL=True, IN_DROP=16, OUT_DROP=16, BLOCK_M=1, BLOCK_N=2048,
                      USE_PDL=True, PDL_EARLY=True)  # fmt: skip
        return fo._rms_norm_kernel, _NORM_TYPES, consts, {"x_ptr", "res_ptr"}
    if name == "reduce":
        from pagoda.kernels.attention import triton_paged_attention as pa

        consts = dict(NUM_SPLITS=32, SPLITS_PAD=32, HEAD_DIM=128, HEAD_DIM_PAD=128,
                      USE_PDL=True, PDL_EARLY=True)  # fmt: skip
        act = {"part_acc_ptr", "part_m_ptr", "part_l_ptr"}
        return pa._split_kv_reduce_kernel, _REDUCE_TYPES, consts, act
    raise ValueError(name)


def _compile_ptx(name: str) -> str:
    """The kernel's sm_90 PTX, then a line naming the PTX parameter indices of its activation
    arguments (in a fresh interpreter: see `compiled_in_child`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, types, consts, act = _kernel(name)
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    params = [a for a in fn.arg_names if sig[a] != "constexpr"]
    src = ASTSource(fn, sig, constexprs=consts)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return ptx.asm["ptx"] + "\n// ACTIVATIONS " + ",".join(str(params.index(a)) for a in act)


def _ptx_and_activations(*args) -> tuple[str, set[int]]:
    out = compiled_in_child(*args)
    ptx, _, act = out.rpartition("\n// ACTIVATIONS ")
    return ptx, {int(v) for v in act.split(",") if v}


@pytest.mark.parametrize("name", ["w4", "dense", "rms_norm", "reduce"])
def test_nothing_written_and_no_activation_read_before_the_wait(name):
    """W4A16 GEMV (M = 1): only weight words and scales before the wait; the dense GEMV, the
    RMSNorm and the split-KV reduce: nothing at all."""
    ptx, act = _ptx_and_activations("test_pdl_pre_wait", name)
    accesses = check_pre_wait(ptx, act)
    if name == "w4":  # the first step's words (w_ptr, 1) and scales (sp_ptr, 2)
        assert accesses and all(a.kind == "load" for a in accesses)
        assert {min(a.params) for a in accesses} == {1, 2}
        with pytest.raises(AssertionError, match="before the PDL wait"):
            check_pre_wait(ptx, {1})  # the checker does see those reads
    else:
        assert accesses == []


@pytest.mark.parametrize("kv_pf_bytes", [0, 8192])
def test_fused_decode_attention_reads_no_activation_before_the_wait(kv_pf_bytes):
    """Before its wait the fused decode attention reads the sequence length and the block table
    and prefetches cache blocks: nothing from q / k / v (parameters 0-2, the QKV projection's
    output) and no store."""
    ptx = compiled_in_child("test_decode_attention_code", kv_pf_bytes)
    accesses = check_pre_wait(ptx, {0, 1, 2})
    loads = {min(a.params) for a in accesses if a.kind == "load" and a.params}
    fetched = [a.params for a in accesses if a.kind == "prefetch"]
    # seq_lens (9), block table (10); K / V cache (6, 7)
    assert loads == {9} | ({10} if kv_pf_bytes else set())
    assert len(fetched) == (2 if kv_pf_bytes else 0)
    assert {min(p) for p in fetched if p} == ({6, 7} if kv_pf_bytes else set())
