"""The Gluon swap-AB wgmma W4A16 GEMM: its layout on CPU (repack / the kernel's unpacking in
torch), its sm_90 code compiled here without a GPU (the cp.async ring, the A fragment in 8-byte
shared loads, async wgmma on it in registers), and the kernel against the dequantized matmul on
an H100 / H200 (`gpu`)."""

from __future__ import annotations

import re

import pytest
import torch

from pagoda.kernels import gluon_w4a16_wgmma as wg


@pytest.mark.parametrize("n,k", [(64, 64), (128, 192), (192, 128), (64, 576)])
def test_repack_and_the_kernels_unpacking_round_trip(n, k):
    g = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int16)
    words = wg.repack_wgmma(codes)
    assert words.dtype == torch.int32 and words.numel() == n * k // 8
    assert torch.equal(wg.unpack_wgmma(words, n, k), codes.to(torch.int32))


def test_every_word_nibble_holds_one_weight():
    word, nib = wg._positions(128, 256)
    word, nib = torch.broadcast_tensors(word, nib)
    keys = (word * 8 + nib).reshape(-1).sort().values
    assert torch.equal(keys, torch.arange(128 * 256))


def test_a_lane_fragment_is_two_adjacent_words_per_row():
    """Row r's nibble k = 32 h + 16 a + 8 b + 2 c + d sits in word 2 c + h of its block row."""
    word, nib = (t.expand(64, 64) for t in wg._positions(64, 64))
    for r, k in ((0, 0), (5, 9), (13, 37), (63, 63)):
        h, a, b, c, d = k // 32, (k // 16) % 2, (k // 8) % 2, (k % 8) // 2, k % 2
        assert word[r, k].item() == r * 8 + 2 * c + h
        assert nib[r, k].item() == 4 * a + 2 * b + d


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiples of 64"):
        wg.repack_wgmma(torch.zeros(64, 96, dtype=torch.int16))
    assert not wg.wgmma_supported(64, 128, 32)
    assert wg.wgmma_supported(128, 256, 128) and wg.wgmma_supported(64, 64, -1)
    with pytest.raises(ValueError, match="wna16_wgmma_gemm"):
        wg.wna16_wgmma_gemm(torch.zeros(2, 64), torch.zeros(512, dtype=torch.int32),
                            torch.ones(1, 64), 64, -1)  # fmt: skip


def _compile_ptx(block_m: int, num_wg: int, stages: int, zp: bool) -> str:
    """The kernel's sm_90 PTX (run in a fresh interpreter: see `_compiled`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = dict.fromkeys(
        ["M", "N", "K", "kt_per_split", "stride_xm", "stride_om", "stride_os"], "i32"
    )
    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*fp32",
           "b_ptr": "*bf16", "out_ptr": "*bf16", **sig}  # fmt: skip
    consts = {"GROUP_TILES": 2, "BLOCK_M": block_m, "NUM_WG": num_wg, "NUM_STAGES": stages,
              "HAS_ZP": zp, "HAS_BIAS": False, "ONE_SPLIT": True}  # fmt: skip
    sig.update(dict.fromkeys(consts, "constexpr"))
    # what the launcher specializes for 16-aligned pointers and strides
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 7, 8, 10, 11, 12)}
    src = GluonASTSource(fn=wg._kernel(), signature=sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": 4 * num_wg}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]


def _compiled(block_m: int, num_wg: int, stages: int, zp: bool) -> str:
    """`_compile_ptx` in a child process without TRITON_INTERPRET: the interpreter patches
    triton.language in place while it runs kernels (and leaves the patch behind when a jit
    function is called outside a launch or two threads interleave), so a compile in the test
    process can see interpreter builtins, depending on which tests ran before."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import sys; sys.path[:0] = sys.argv[1:3]; import test_gluon_w4a16_wgmma as t; "
        f"sys.stdout.write(t._compile_ptx({block_m}, {num_wg}, {stages}, {zp}))"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    done = subprocess.run(
        [sys.executable, "-c", code, here, root], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _ptxas_info(ptx: str) -> str:
    """ptxas -v on the PTX (the one Triton compiles sm_90 with): registers, spills, and
    whether it had to serialize the wgmma."""
    import os
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        cmd = [ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stderr


@pytest.mark.skipif(not wg.gluon_available(), reason="needs Triton with Gluon")
@pytest.mark.parametrize(
    "block_m,num_wg,stages,zp", [(8, 1, 4, False), (64, 2, 4, True), (256, 2, 4, False),
                                 (128, 2, 3, True)]
)  # fmt: skip
def test_sm90_code_pipelines_through_shared_memory(block_m, num_wg, stages, zp):
    """Compiled for sm_90 here (no GPU needed): cp.async fills the ring; the weight's A fragment
    comes from it in 8-byte shared loads (no ldmatrix) and stays in registers for the async
    wgmma (one per K = 16), one MMA group left in flight; no shuffles for the layout
    conversion, no local memory."""
    ptx = _compiled(block_m, num_wg, stages, zp)
    mmas = re.findall(
        r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16 \{[^}]*\}, \{", ptx
    )  # the A operand a register list, not a descriptor
    assert len(mmas) == 8 and {int(v) for v in mmas} == {block_m}  # two K steps a loop trip
    assert "cp.async.cg.shared.global" in ptx and "cp.async.commit_group" in ptx
    waits = {int(v) for v in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)}
    assert waits == {0, 2 * stages - 5}
    mma_waits = {int(v) for v in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)}
    assert mma_waits == {0, 1}
    assert ptx.count("ld.shared.v2.b32") == 4  # per step a thread's words of rows r, r + 8
    assert "ld.global.v2" not in ptx  # the words come through the ring only
    for absent in ("ldmatrix", "shfl", "ld.local", "st.local"):
        assert absent not in ptx, absent
    info = _ptxas_info(ptx)
    assert "0 bytes spill stores, 0 bytes spill loads" in info, info
    assert "serialized" not in info, info  # ptxas keeps the async wgmma asynchronous


def _case(m: int, n: int, k: int, group: int, zp: bool, seed: int):
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
    return x, codes, scales, zeros, x.float() @ w.bfloat16().float().t()


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not (_hopper() and wg.gluon_available()), reason="needs an sm_90 GPU, Gluon")
@pytest.mark.parametrize("m", [1, 5, 8, 17, 64, 100, 256])
@pytest.mark.parametrize(
    "group,zp,bias", [(128, False, False), (64, True, True), (-1, True, False)]
)
def test_gemm_matches_the_dequantized_matmul_gpu(m, group, zp, bias):
    n, k = 256, 512 if group == 128 else 576  # 9 K steps: an odd count, a padded last pair
    x, codes, scales, zeros, ref = _case(m, n, k, group, zp, seed=m)
    b = torch.randn(n).bfloat16() if bias else None
    if bias:
        ref = ref + b.float()
    dev = torch.device("cuda")
    words = wg.repack_wgmma(codes.to(dev))
    configs = (None, (8 if m <= 8 else 64, 1, 1, 3), (256, 2, 3, 4), (32, 2, 2, 5))
    for config, s_dtype in zip(configs, (torch.bfloat16,) * 3 + (torch.float32,)):  # fp32 path
        y = wg.wna16_wgmma_gemm(
            x.to(dev), words, scales.to(dev, s_dtype), n, group,
            zeros_t=zeros.to(dev) if zp else None, bias=b.to(dev) if bias else None,
            config=config,
        )  # fmt: skip
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        err = (y.float().cpu() - ref).abs().max().item()
        assert err <= 2.0**-7 * ref.abs().max().item(), (config, err)
