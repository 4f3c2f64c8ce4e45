"""The wgmma W4A16 GEMM on the tensor-core GEMV's layout: its slot order and unpacking on the CPU
(torch mirror against `repack_mma`), its sm_90 code compiled here without a GPU, and the kernel
against the dequantized matmul on an H100 / H200 (`gpu`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from pagoda.kernels.wna16 import gluon_mma_wgmma as wg
from pagoda.kernels.workspace import SplitKWorkspace

pytest.importorskip("triton")  # the layout (`repack_mma`) lives with the Triton GEMV
from pagoda.kernels.wna16 import triton_w4a16_mma as mma  # noqa: E402


def test_slot_order_is_a_permutation_of_pairs():
    real = [wg.slot_to_real_pair(s) for s in range(32)]
    assert sorted(real) == list(range(32))
    # MMA v, thread c: slots 2c, 2c + 1 hold real K 16 c + 4 v + {0, 1}, slots 2c + 8, 2c + 9
    # hold 16 c + 4 v + {2, 3} (the layout's fragment rule)
    for v in range(4):
        for c in range(4):
            assert real[8 * v + c] * 2 == 16 * c + 4 * v
            assert real[8 * v + 4 + c] * 2 == 16 * c + 4 * v + 2


@pytest.mark.parametrize("n,k,num_wg", [(64, 64, 1), (128, 192, 1), (128, 128, 2), (256, 64, 2)])
def test_the_kernels_unpacking_feeds_each_slot_its_real_k(n, k, num_wg):
    g = torch.Generator().manual_seed(n * 3 + k)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int16)
    words = mma.repack_mma(codes)
    slots = wg.unpack_slots(words, n, k, num_wg)
    perm = torch.tensor([2 * wg.slot_to_real_pair(s // 2) + s % 2 for s in range(64)])
    real = torch.cat([perm + 64 * t for t in range(k // 64)])
    assert torch.equal(slots, codes[:, real].to(torch.int32))


@pytest.mark.parametrize("n,k,num_wg", [(64, 64, 1), (128, 192, 1), (256, 128, 2)])
def test_natural_order_unpacking_feeds_each_slot_its_own_k(n, k, num_wg):
    """With the quad transpose (NATURAL_X) slot s of a tile is real K s: the activation tile
    is copied as it is."""
    g = torch.Generator().manual_seed(n + k + num_wg)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int16)
    slots = wg.unpack_slots(mma.repack_mma(codes), n, k, num_wg, natural=True)
    assert torch.equal(slots, codes.to(torch.int32))


def test_bad_inputs_are_refused():
    assert not wg.wgmma_supported(64, 128, 32) and not wg.wgmma_supported(48, 128, 128)
    assert wg.wgmma_supported(128, 256, 128) and wg.wgmma_supported(64, 64, -1)
    words = torch.zeros(64 * 64 // 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="wna16_mma_wgmma"):
        wg.wna16_mma_wgmma(torch.zeros(2, 64), words, torch.zeros(4, 1, 8, dtype=torch.int32),
                           64, -1)  # fmt: skip


def test_default_configs():
    for m in (8, 17, 33, 64, 100, 128, 200, 256, 512):
        for n, k in ((4608, 3584), (2048, 11008), (37888, 3584)):
            c = wg.default_wgmma_config(m, n, k, 132)
            block_m, wgs, split, stages, natural, scale_ahead, staged = c
            assert block_m in wg.BLOCK_MS and min(m, 16) <= block_m <= 64
            assert natural == (m > 32) and n % (64 * wgs) == 0 and split >= 1
            # scales ahead in slot order; the staged epilogue for 64-row tiles (it needs a ring
            # of at least two stages a warpgroup to hold the fp32 tile)
            assert scale_ahead == (not natural) and staged == (block_m >= 64)
            assert not staged or stages >= 2 * wgs
            assert wg.wgmma_smem_bytes(block_m, wgs, stages) <= wg.SMEM_BYTES
    # up to 32 rows one program along M; past that a large layer keeps 64-row programs (its
    # weights read once), a small one takes two programs; one warpgroup a program where K is
    # short (3B) or the columns fill the GPU (gate_up, but for 32-row tiles), else two
    assert wg.default_wgmma_config(32, 37888, 3584, 132)[:3] == (32, 2, 1)
    assert wg.default_wgmma_config(16, 37888, 3584, 132)[:3] == (16, 1, 1)
    assert wg.default_wgmma_config(32, 22016, 2048, 132)[:3] == (32, 1, 1)
    assert wg.default_wgmma_config(64, 37888, 3584, 132)[:3] == (64, 1, 1)
    assert wg.default_wgmma_config(64, 4608, 3584, 132)[:3] == (32, 2, 4)  # 72 programs
    assert wg.default_wgmma_config(16, 3584, 18944, 132)[:3] == (16, 2, 9)  # 28 programs
    assert wg.default_wgmma_config(64, 2560, 2048, 132)[:3] == (32, 1, 3)  # 80 programs


def _compile_ptx(
    block_m: int,
    num_wg: int,
    stages: int,
    zp: bool,
    one_split: bool,
    natural: bool = False,
    scale_ahead: bool = False,
    what: str = "ptx",
    staged: bool = False,
) -> str:
    """The kernel's sm_90 PTX (in a fresh interpreter: see `_compiled`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    ints = ["M", "N", "K", "kt_per_split", "n_groups", "stride_xm", "stride_om"]
    sig = {"x_ptr": "*bf16" if natural else "*i32", "w_ptr": "*bf16", "sp_ptr": "*bf16",
           "zp_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32",
           "wsi_ptr": "*i32", "cnt_ptr": "*i32", **dict.fromkeys(ints, "i32")}  # fmt: skip
    consts = {"GROUP_TILES": 2, "BLOCK_M": block_m, "NUM_WG": num_wg, "NUM_STAGES": stages,
              "NATURAL_X": natural, "HAS_ZP": zp, "HAS_BIAS": False,
              "ONE_SPLIT": one_split, "SCALE_AHEAD": scale_ahead,
              "STAGED": staged}  # fmt: skip
    sig.update(dict.fromkeys(consts, "constexpr"))
    attrs = {(i,): [["tt.divisibility", 16]] for i in (*range(9), 10, 11, 14, 15)}
    src = GluonASTSource(fn=wg._kernel(), signature=sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": 4 * num_wg}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm[what]


def _compiled(*args) -> str:
    return compiled_in_child("test_gluon_mma_wgmma", *args)


def compiled_in_child(module: str, *args) -> str:
    """`module._compile_ptx(*args)` (a test module beside this one) in a child process without
    TRITON_INTERPRET (the interpreter patches triton.language in place while the suite runs)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        f"import sys; sys.path[:0] = sys.argv[1:3]; import {module} as t; "
        f"sys.stdout.write(t._compile_ptx{args!r})"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    done = subprocess.run(
        [sys.executable, "-c", code, here, root], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.skipif(not wg.gluon_available(), reason="needs Triton with Gluon")
@pytest.mark.parametrize(
    "block_m,num_wg,stages,zp,one_split",
    [(8, 1, 4, False, True), (64, 1, 4, True, True), (64, 2, 4, False, False),
     (128, 2, 3, True, True)],
)  # fmt: skip
def test_sm90_code(block_m, num_wg, stages, zp, one_split):
    """Compiled for sm_90 here: the words come through the ring in 16-byte copies and one
    16-byte shared load a step, the activations in 4-byte copies (the slot order); the
    dequantization is the asm's 15 instructions per word, feeding wgmma's register operand
    (no shuffles, no local memory), one MMA group left in flight."""
    ptx = _compiled(block_m, num_wg, stages, zp, one_split)
    mmas = re.findall(
        r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16 \{[^}]*\}, \{", ptx
    )  # the A operand a register list, not a descriptor
    assert len(mmas) == 8 and {int(v) for v in mmas} == {block_m}  # two K steps a loop trip
    # copies: the prologue's S - 1 word stages and S - 2 activation stages, then per loop trip
    # two of each; 16 bytes a thread for the words, 4-byte pairs for the activations
    w_copies = re.findall(r"cp\.async\.cg\.shared\.global .*0x10, 0x10;", ptx)
    assert len(w_copies) == stages + 1
    x_copies = re.findall(r"cp\.async\.ca\.shared\.global .*0x4, %r\d+;", ptx)
    assert len(x_copies) == stages * block_m * 32 // (128 * num_wg)  # each pair copied once
    assert ptx.count("ld.shared.v4.b32") == 2  # a thread's 4 words, once a step
    # per loop trip: 2 steps x 4 words x (4 lop3, 4 add, 4 mul)
    assert ptx.count("lop3.b32") == 32 and ptx.count("mul.rn.bf16x2") == 32
    assert ptx.count("add.rn.bf16x2") == 32
    assert {int(v) for v in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)} == {0, 1}
    for absent in ("ldmatrix", "shfl", "ld.local", "st.local"):
        assert absent not in ptx, absent


@pytest.mark.skipif(not wg.gluon_available(), reason="needs Triton with Gluon")
@pytest.mark.parametrize("block_m,num_wg,stages", [(16, 1, 4), (64, 2, 8)])
def test_sm90_code_natural_order(block_m, num_wg, stages):
    """NATURAL_X: the activations in 16-byte copies, the words through the quad transpose (4
    prmt, 4 shfl a step), the same dequantization and register-operand wgmma."""
    ptx = _compiled(block_m, num_wg, stages, False, True, True)
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16", ptx)) == 8
    assert "cp.async.ca" not in ptx  # no 4-byte gathers
    w_copies = re.findall(r"cp\.async\.cg\.shared\.global .*0x10, 0x10;", ptx)
    x_copies = re.findall(r"cp\.async\.cg\.shared\.global .*0x10, %r\d+;", ptx)  # masked rows
    assert len(w_copies) == stages + 1
    assert len(x_copies) == stages * max(1, block_m * 8 // (128 * num_wg))
    assert ptx.count("shfl.sync.bfly.b32") == 8 and ptx.count("mul.rn.bf16x2") == 32
    for absent in ("ldmatrix", "ld.local", "st.local"):
        assert absent not in ptx, absent


@pytest.mark.skipif(not wg.gluon_available(), reason="needs Triton with Gluon")
@pytest.mark.parametrize("one_split", [True, False])
def test_sm90_code_staged_epilogue(one_split):
    """STAGED (64-row tiles): the fp32 tile goes through shared memory, then out in chunks of
    4 contiguous columns a thread: 8-byte bf16 stores and, with split-K, 16-byte vector adds
    into the workspace (not one scalar atomic per element), the last split's read-back in one
    round trip, and no local memory."""
    ptx = _compiled(64, 2, 4, False, one_split, True, True, "ptx", True)
    assert ptx.count("st.global.v2.b32") == 64 * 128 // (256 * 4)  # 4 bf16 a store
    adds = re.findall(r"(?:red|atom)\.global\.\S*add\.v4\.f32", ptx)  # 3.9 red, 3.6 atom
    assert len(adds) == (0 if one_split else 64 * 128 // (256 * 4))
    assert "atom.global.gpu.relaxed.add.f32" not in ptx  # no scalar adds
    # the last split reads the tile's sums back in one round trip: every exchange before the
    # first store, then the counter's reset
    ops = re.findall(r"atom\.global\.\S*exch|st\.global", ptx)
    runs = re.findall(r"X+", "".join("X" if op.startswith("atom") else "S" for op in ops))
    assert len(runs) == (0 if one_split else 2), runs
    for absent in ("ld.local", "st.local"):
        assert absent not in ptx, absent


def _case(m: int, n: int, k: int, group: int, zp: bool, seed: int, dev):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int16)
    groups = 1 if group <= 0 or group >= k else k // group
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 0.002).bfloat16()
    zeros = torch.randint(0, 16, (groups, n), generator=g) if zp else None
    z = zeros.float() if zp else torch.full((groups, n), 8.0)
    per = k // groups
    w = (codes.float() - z.t().repeat_interleave(per, 1)) * scales.float().t().repeat_interleave(
        per, 1
    )
    x = torch.randn(m, k, generator=g).bfloat16()
    ref = x.float() @ w.bfloat16().float().t()
    words = mma.repack_mma(codes.to(dev))
    pairs = mma.repack_mma_scales(scales.to(dev))
    zpairs = mma.repack_mma_zeros(zeros.to(dev)) if zp else None
    return x.to(dev), words, pairs, zpairs, ref


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(
    not (_hopper() and wg.gluon_available()), reason="needs an sm_90 GPU and Gluon"
)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("m", [1, 5, 8, 17, 33, 64, 100, 256, 300])
@pytest.mark.parametrize(
    "group,zp,bias", [(128, False, False), (64, True, True), (-1, True, False)]
)
def test_gemm_matches_the_dequantized_matmul_gpu(m, group, zp, bias):
    n, k = 256, 512 if group == 128 else 576  # 9 K steps: an odd count, a padded last pair
    configs = (None, (8 if m <= 8 else 64, 1, 1, 3), (256, 2, 1, 4), (32, 2, 3, 5), (16, 1, 4, 4),
               (64, 2, 1, 4, True), (16, 1, 3, 6, True), (64, 2, 3, 4, True, True, True),
               (128, 2, 1, 4, True, False, True), (8, 1, 2, 3, False, True, True),
               (32, 2, 1, 4, False, True, False))  # fmt: skip
    check_configs(wg.wna16_mma_wgmma, configs, m, n, k, group, zp, bias)


def check_configs(kernel, configs, m: int, n: int, k: int, group: int, zp: bool, bias: bool):
    """`kernel` (a wgmma GEMM's entry) with each config against the fp32 matmul of the
    dequantized weight (within bf16 rounding of the output); the workspace ends zeroed."""
    dev = torch.device("cuda")
    x, words, pairs, zpairs, ref = _case(m, n, k, group, zp, seed=m, dev=dev)
    b = torch.randn(n).bfloat16() if bias else None
    if bias:
        ref = ref + b.float()
    ws = SplitKWorkspace()
    for config in configs:
        y = kernel(
            x, words, pairs, n, group, bias=b.to(dev) if bias else None, zero_pairs=zpairs,
            workspace=ws, config=config,
        )  # fmt: skip
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        err = (y.float().cpu() - ref).abs().max().item()
        assert err <= 2.0**-7 * ref.abs().max().item(), (config, err)
    assert all(int(t.count_nonzero()) == 0 for t in ws.all_buffers())  # split-K cleaned up


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("m", [64, 256])
@pytest.mark.parametrize("zp", [False, True])
def test_qwen_shapes_and_graph_replay_gpu(m, zp):
    """Qwen2.5-7B / 3B layer shapes with the default configs (split-K where few programs),
    then the same call captured in a CUDA graph and replayed on new inputs."""
    shapes = ((4608, 3584), (3584, 18944), (2048, 2048), (2048, 11008))
    check_shapes_and_graph_replay(wg.wna16_mma_wgmma, m, zp, shapes)


def check_shapes_and_graph_replay(kernel, m: int, zp: bool, shapes) -> None:
    """`kernel` (a wgmma GEMM's entry) at each (N, K) of `shapes` with its default config
    against the reference, then captured in a CUDA graph and replayed on new inputs (equal to
    a fresh call up to the rounding of split-K's atomic order); the workspace ends zeroed."""
    dev = torch.device("cuda")
    ws = SplitKWorkspace()
    for n, k in shapes:
        x, words, pairs, zpairs, ref = _case(m, n, k, 128, zp, seed=n + k, dev=dev)
        y = kernel(x, words, pairs, n, 128, zero_pairs=zpairs, workspace=ws)
        err = (y.float().cpu() - ref).abs().max().item()
        assert err <= 2.0**-7 * ref.abs().max().item(), (n, k, err)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            yg = kernel(x, words, pairs, n, 128, zero_pairs=zpairs, workspace=ws)
        x2 = torch.randn_like(x)
        x.copy_(x2)
        graph.replay()
        ref2 = kernel(x2, words, pairs, n, 128, zero_pairs=zpairs, workspace=ws)
        # split-K sums fp32 partials with atomics, in arrival order: equal up to rounding
        tol = 2.0**-7 * ref2.float().abs().max().item()
        assert (yg.float() - ref2.float()).abs().max().item() <= tol, (n, k)
    assert all(int(t.count_nonzero()) == 0 for t in ws.all_buffers())
