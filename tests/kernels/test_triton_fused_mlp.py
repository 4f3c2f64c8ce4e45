"""The batch-1 decode MLP in one launch (`kernels/triton_fused_mlp`) against the unfused kernels'
torch reference: the CPU interpreter on small shapes (the barrier with one program, the task
split over several programs as two launches), its sm_90 code compiled here, Qwen2.5 shapes,
CUDA graphs and the engine on the GPU."""

from __future__ import annotations

import re

import pytest
import torch

triton = pytest.importorskip("triton")

from tests.kernels.test_gluon_mma_wgmma import compiled_in_child  # noqa: E402


def _case(h, inter, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)

    def t(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*shape, generator=g)).to(dtype).to(device)

    return (
        t(1, h),  # hidden (o_proj's output)
        t(1, h),  # residual
        t(h, scale=0.1, shift=1.0),  # post-attention norm weight
        t(2 * inter, h, scale=h**-0.5),  # gate_up
        t(h, inter, scale=inter**-0.5),  # down
    )


def _ulp(dtype):
    return 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10


def _check(out, new_residual, act, case, eps):
    """The residual add is exact; silu(gate) * up and down(act) are each the fp32 sums of the
    unfused GEMVs rounded once (at most one ulp apart: the order of the sums differs)."""
    from pagoda.kernels.fused_ops import fused_add_rms_norm_ref, silu_and_mul_ref

    hidden, residual, norm_w, w_gu, w_d = case
    inter = w_d.shape[1]
    x, ref_residual = fused_add_rms_norm_ref(hidden, residual, norm_w, eps)
    assert torch.equal(new_residual, ref_residual)
    ulp = _ulp(hidden.dtype)
    ref_act = silu_and_mul_ref((x.float() @ w_gu.float().t()).to(x.dtype))
    got_act = act[:inter].view(1, inter)
    torch.testing.assert_close(got_act.float(), ref_act.float(), rtol=ulp, atol=1e-3)
    ref_out = (got_act.float() @ w_d.float().t()).to(x.dtype)  # down of the kernel's own act
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=ulp, atol=1e-3)


@pytest.mark.parametrize(
    "h,inter,dtype,cfg",
    [
        (64, 96, torch.bfloat16, (8, 32, 8, 64)),  # whole tiles everywhere
        (48, 40, torch.float16, (4, 32, 16, 16)),  # K, row and feature tails
        (96, 72, torch.bfloat16, (16, 64, 4, 32)),  # more programs than some phase's tasks
    ],
)
@pytest.mark.parametrize("two_launches", [False, True])
def test_fused_mlp_interpreter(h, inter, dtype, cfg, two_launches) -> None:
    from pagoda.kernels.triton_fused_mlp import FusedMlpConfig, fused_mlp_decode

    case = _case(h, inter, dtype, seed=h + inter)
    config = FusedMlpConfig(*cfg, num_warps=2, num_stages=2)
    act = torch.full((inter + 5,), float("nan"), dtype=dtype)
    barrier = torch.zeros(2, dtype=torch.int32)
    for call in range(2):  # the barrier is ready again for the next launch
        out, new_residual = fused_mlp_decode(
            *case[:3], 1e-6, *case[3:], act, barrier, config, two_launches=two_launches
        )
        _check(out, new_residual, act, case, 1e-6)
        assert barrier.tolist() == ([0, 0] if two_launches else [0, call + 1])
        assert torch.isnan(act[inter:]).all()  # nothing past I is written


def test_fused_mlp_default_config_and_reference() -> None:
    """The default tiles, and `fused_mlp_ref` (the unfused kernels' order of rounding) within
    the one-ulp steps of the sums."""
    from pagoda.kernels.triton_fused_mlp import fused_mlp_decode, fused_mlp_ref

    case = _case(128, 200, torch.bfloat16, seed=3)
    act = torch.empty(200, dtype=torch.bfloat16)
    out, new_residual = fused_mlp_decode(
        *case[:3], 1e-5, *case[3:], act, torch.zeros(2, dtype=torch.int32)
    )
    _check(out, new_residual, act, case, 1e-5)
    ref_out, ref_residual = fused_mlp_ref(*case[:3], 1e-5, *case[3:])
    assert torch.equal(new_residual, ref_residual)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=4 * 2.0**-7, atol=4e-3)


def test_fused_mlp_errors() -> None:
    from pagoda.kernels.triton_fused_mlp import FusedMlpConfig, fused_mlp_decode

    hidden, residual, norm_w, w_gu, w_d = _case(32, 48, torch.bfloat16, seed=0)
    act, bar = torch.empty(48, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32)

    def call(**kw):
        args = dict(
            hidden=hidden, residual=residual, norm_weight=norm_w, eps=1e-6, w_gate_up=w_gu,
            w_down=w_d, act=act, barrier=bar,
        )  # fmt: skip
        args.update(kw)
        return fused_mlp_decode(**args)

    with pytest.raises(ValueError, match="one row only"):
        call(hidden=hidden.expand(2, -1), residual=residual.expand(2, -1))
    with pytest.raises(ValueError, match="bf16 / fp16 only"):
        call(hidden=hidden.float())
    with pytest.raises(ValueError, match=r"down must be \[32, 48\]"):
        call(w_down=w_d[:, :40])
    with pytest.raises(ValueError, match=r"gate_up must be \[2I, 32\]"):
        call(w_gate_up=w_gu[:95])
    with pytest.raises(ValueError, match="act scratch"):
        call(act=act[:47])
    with pytest.raises(ValueError, match="barrier"):
        call(barrier=bar.long())
    with pytest.raises(ValueError, match="residual must be"):
        call(residual=residual.half())
    with pytest.raises(ValueError, match=r"norm weight must be a contiguous \[32\]"):
        call(norm_weight=norm_w[:16])
    with pytest.raises(ValueError, match="block_k2=48: a power of two"):
        FusedMlpConfig(block_k2=48)


def test_workspace_scratch_and_barrier() -> None:
    """The runner's workspace hands out one growing scratch row per dtype and one barrier pair
    per device, zeroed once."""
    from pagoda.kernels.workspace import SplitKWorkspace

    ws = SplitKWorkspace()
    cpu = torch.device("cpu")
    a = ws.scratch(cpu, 100, torch.bfloat16, "a")
    assert a.numel() >= 100 and a.dtype == torch.bfloat16
    assert ws.scratch(cpu, 50, torch.bfloat16, "a") is a
    b = ws.scratch(cpu, 300, torch.bfloat16, "a")
    assert b.numel() >= 300 and b is not a
    other = ws.scratch(cpu, 100, torch.bfloat16, "b")
    assert other.data_ptr() != b.data_ptr()  # names never share memory
    assert ws.scratch(cpu, 10, torch.float16, "a").dtype == torch.float16
    bar = ws.barrier(cpu)
    assert bar.tolist() == [0, 0] and bar.dtype == torch.int32
    assert ws.barrier(cpu) is bar


def _compile_ptx(kernel: str = "dense") -> str:
    """A kernel's sm_90 PTX for Qwen2.5-3B's MLP (H 2048, I 11008, group 128), the default
    tiles, PDL, integer arguments divisible by 16 as Triton specializes them (see
    `compiled_in_child`): the dense one-launch MLP, or the W4A16 norm + gate_up + SiLU ("w4")."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagoda.kernels import triton_fused_mlp as fm

    if kernel == "w4":
        fn = fm._norm_gate_up_silu_w4_kernel
        consts = dict(
            BLOCK_H=2048, GROUP_TILES=2, KT=4, G=1, HAS_ZP=True, DROP=16, INTERPRET=False,
            USE_PDL=True,
        )  # fmt: skip
        kinds = {"xsi_ptr": "*i32", "w_ptr": "*i32", "sp_ptr": "*i8", "zp_ptr": "*i8"}
    else:
        fn = fm._fused_mlp_kernel
        consts = dict(
            BLOCK_H=2048, BLOCK_I=8, BLOCK_K=512, BLOCK_N=8, BLOCK_K2=1024, PHASES=3, DROP=16,
            NUM_STAGES=3, USE_PDL=True,
        )  # fmt: skip
        kinds = {"bar_ptr": "*i32", "stride_gu": "i32", "stride_d": "i32"}
    kinds.update({"eps": "fp32", "M": "i32", "H": "i32", "INTER": "i32", "n_groups_s": "i32"})
    sig = {n: "constexpr" if n in consts else kinds.get(n, "*bf16") for n in fn.arg_names}
    aligned = [i for i, n in enumerate(fn.arg_names) if sig[n] not in ("constexpr", "fp32")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": 4, "num_stages": 3}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]


def test_sm90_code() -> None:
    """Compiled for sm_90 here: both phases stream their weights through cp.async in 16-byte
    copies; between them the barrier reads the generation (acquire), arrives (acq_rel), and
    its last arrival resets the count before it releases the next generation; the dependent
    launch is triggered only past the barrier (every program resident), after the one wait."""
    ptx = compiled_in_child("test_triton_fused_mlp")
    lines = ptx.splitlines()

    def at(pattern):
        return [i for i, line in enumerate(lines) if re.search(pattern, line)]

    (wait,) = at(r"griddepcontrol\.wait")
    (trigger,) = at(r"griddepcontrol\.launch_dependents")
    (arrive,) = at(r"atom\.global\.gpu\.acq_rel\.add\.u32")
    (reset,) = at(r"atom\.global\.gpu\.relaxed\.exch\.b32")
    (release,) = at(r"(atom|red)\.global\.gpu\.release\.add\.u32")
    acquire = at(r"ld\.global\.gpu\.acquire\.b32")
    assert len(acquire) == 2  # the generation before arriving, and the spin
    copies = at(r"cp\.async\.cg\.shared\.global \[ %r\d+ \+ 0 \], \[ %rd\d+ \+ 0 \], 0x10")
    assert wait < min(copies) and wait < min(acquire)
    assert acquire[0] < arrive < reset < release < acquire[1] < trigger
    assert any(c < arrive for c in copies) and any(c > trigger for c in copies)
    assert not at(r"\.local\.")  # no spills


def test_sm90_code_w4a16() -> None:
    """The W4A16 kernel compiled for sm_90 here: its first words and scale pairs (16-byte
    loads) are issued before `griddepcontrol.wait` (weights never depend on the previous
    kernel), the tensor-core MMAs come after the wait, the dependent launch is triggered after
    the last of them, and nothing spills to local memory."""
    ptx = compiled_in_child("test_triton_fused_mlp", "w4")
    lines = ptx.splitlines()

    def at(pattern):
        return [i for i, line in enumerate(lines) if re.search(pattern, line)]

    (wait,) = at(r"griddepcontrol\.wait")
    (trigger,) = at(r"griddepcontrol\.launch_dependents")
    mmas = at(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32")
    wide = at(r"ld\.global(\.nc)?\.v4\.b32")
    assert mmas and wait < min(mmas) and max(mmas) < trigger
    assert any(i < wait for i in wide) and any(i > wait for i in wide)
    assert not at(r"\.local\.")


# ---------------------------------------------------------------- W4A16


def _w4_case(h, inter, group, zp, seed, device="cpu", m=1):
    """Norm inputs (m rows) and a gate_up weight [2I, H] in the tensor-core layout (unsigned
    codes and zero codes 0..15, or the symmetric offset 8), with its fp32 dequantization."""
    import pagoda.kernels.triton_w4a16_mma as mm

    g = torch.Generator().manual_seed(seed)
    n, gs = 2 * inter, h if group <= 0 else group
    q = torch.randint(0, 16, (n, h), generator=g).to(torch.int32)
    scale = (torch.rand(n, h // gs, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    z = torch.randint(0, 16, (n, h // gs), generator=g).to(torch.int32) if zp else None
    zero = z if zp else torch.full_like(q[:, : h // gs], 8)
    w = (q - zero.repeat_interleave(gs, 1)).float() * scale.float().repeat_interleave(gs, 1)
    hidden, residual, norm_w = (
        torch.randn(m, h, generator=g).to(torch.bfloat16),
        torch.randn(m, h, generator=g).to(torch.bfloat16),
        (1 + 0.1 * torch.randn(h, generator=g)).to(torch.bfloat16),
    )
    words = mm.repack_mma(q)
    pairs = mm.repack_mma_scales(scale.t().contiguous())
    zpairs = mm.repack_mma_zeros(z.t().contiguous()) if zp else None
    on = [t.to(device) if t is not None else None for t in (hidden, residual, norm_w, words)]
    return (*on, pairs.to(device), zpairs.to(device) if zp else None, w)


def _check_w4(act, new_residual, xs, case, eps):
    """The residual add is exact and every program's slot holds the normalised rows (equal to
    the reference up to the norm's fp32 sum, one ulp); gate and up are the fp32 sums of those
    rows times the dequantized weight rounded once (one ulp each, in any order), so
    silu(gate) * up, rounded twice more, is within two ulps."""
    from pagoda.kernels.fused_ops import fused_add_rms_norm_ref, silu_and_mul_ref

    hidden, residual, norm_w, _, _, _, w = case
    m, h, inter = hidden.shape[0], hidden.shape[1], w.shape[0] // 2
    x, ref_residual = fused_add_rms_norm_ref(hidden.cpu(), residual.cpu(), norm_w.cpu(), eps)
    assert torch.equal(new_residual.cpu(), ref_residual)
    slot = xs.cpu()[: m * h].view(m, h)  # program 0's
    torch.testing.assert_close(slot.float(), x.float(), rtol=2.0**-7, atol=0.0)
    ref = silu_and_mul_ref((slot.float() @ w.t()).to(torch.bfloat16))
    got = act.cpu()[: m * inter].view(m, inter)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2 * 2.0**-7, atol=1e-3)


@pytest.mark.parametrize(
    "h,inter,group,zp,cfg,m",
    [
        (128, 64, 64, False, (1, 1, 2), 1),  # groups of one K tile; 4 tasks on 3 programs
        (256, 96, 128, True, (2, 2, 4), 1),  # zero points, two column groups a task
        (192, 48, -1, False, (4, 1, 4), 3),  # one scale a column; K / 64 = 3: one tile a step
        (256, 80, 128, True, (4, 2, 8), 8),  # 5 column groups: 2 does not divide, one a task
        (128, 64, 64, True, (2, 1, 4), 5),
    ],
)
def test_norm_gate_up_silu_w4a16_interpreter(h, inter, group, zp, cfg, m) -> None:
    from pagoda.kernels.triton_fused_mlp import (
        FusedW4Config,
        norm_gate_up_silu_w4a16,
        norm_gate_up_silu_w4a16_programs,
    )

    case = _w4_case(h, inter, group, zp, seed=h + inter + m, m=m)
    config = FusedW4Config(*cfg, programs_per_sm=1)
    slots = norm_gate_up_silu_w4a16_programs(case[0], inter, config)
    act = torch.full((m * inter + 3,), float("nan"), dtype=torch.bfloat16)
    xs = torch.empty(slots * m * h, dtype=torch.bfloat16)
    new_residual = norm_gate_up_silu_w4a16(
        *case[:3], 1e-6, case[3], case[4], group, case[5], act, xs, config
    )
    _check_w4(act, new_residual, xs, case, 1e-6)
    assert torch.isnan(act[m * inter :]).all()
    rows = xs.view(slots, m * h)
    assert all(torch.equal(rows[0], rows[i]) for i in range(slots))


def test_norm_gate_up_silu_w4a16_errors() -> None:
    from pagoda.kernels.triton_fused_mlp import norm_gate_up_silu_w4a16

    hidden, residual, norm_w, words, pairs, _, _ = _w4_case(128, 64, 64, False, seed=1)
    act, xs = torch.empty(64, dtype=torch.bfloat16), torch.empty(3 * 128, dtype=torch.bfloat16)

    def call(**kw):
        args = dict(
            hidden=hidden, residual=residual, norm_weight=norm_w, eps=1e-6, words=words,
            scale_pairs=pairs, group_size=64, zero_pairs=None, act=act, xs=xs,
        )  # fmt: skip
        args.update(kw)
        return norm_gate_up_silu_w4a16(**args)

    with pytest.raises(ValueError, match="hidden must be bf16"):
        call(hidden=hidden.half())
    with pytest.raises(ValueError, match="1-8 rows"):
        call(hidden=hidden.expand(9, -1), residual=residual.expand(9, -1))
    with pytest.raises(ValueError, match="residual must be"):
        call(residual=residual[:, :64])
    with pytest.raises(ValueError, match="norm weight must be"):
        call(norm_weight=norm_w.float())
    with pytest.raises(ValueError, match="do not hold"):
        call(words=words[:-128])
    with pytest.raises(ValueError, match="act: >= 1 x 64"):
        call(act=act[:63])
    with pytest.raises(ValueError, match="xs scratch"):
        call(xs=xs[:200])


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("h,inter", [(2048, 11008), (3584, 18944), (896, 4864)])
def test_fused_mlp_qwen_shapes_gpu(h, inter) -> None:
    """Qwen2.5-3B, 7B and 0.5B MLPs with one program an SM (a cooperative launch), three calls
    in a row (barrier generations), then captured in a CUDA graph and replayed on new inputs."""
    from pagoda.kernels.triton_fused_mlp import fused_mlp_decode

    case = _case(h, inter, torch.bfloat16, seed=h, device="cuda")
    act = torch.empty(inter, device="cuda", dtype=torch.bfloat16)
    barrier = torch.zeros(2, device="cuda", dtype=torch.int32)
    for _ in range(3):
        out, new_residual = fused_mlp_decode(*case[:3], 1e-6, *case[3:], act, barrier)
        _check(out, new_residual, act, case, 1e-6)
    assert barrier[0].item() == 0 and barrier[1].item() == 3
    hidden, residual = case[0].clone(), case[1].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_res = fused_mlp_decode(hidden, residual, case[2], 1e-6, *case[3:], act, barrier)
    for seed in (1, 2):
        new = _case(h, inter, torch.bfloat16, seed=seed, device="cuda")
        hidden.copy_(new[0])
        residual.copy_(new[1])
        graph.replay()
        torch.cuda.synchronize()
        _check(g_out, g_res, act, (hidden, residual, *case[2:]), 1e-6)
    assert barrier[0].item() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("h,inter,zp,m", [(2048, 11008, False, 1), (3584, 18944, True, 8)])
def test_norm_gate_up_silu_w4a16_qwen_shapes_gpu(h, inter, zp, m) -> None:
    """Qwen2.5-3B and 7B gate_up (group 128, with and without zero points; 1 and 8 rows), the
    default programs, then in a CUDA graph replayed on new rows."""
    from pagoda.kernels.triton_fused_mlp import (
        norm_gate_up_silu_w4a16,
        norm_gate_up_silu_w4a16_programs,
    )

    case = _w4_case(h, inter, 128, zp, seed=h, device="cuda", m=m)
    slots = norm_gate_up_silu_w4a16_programs(case[0], inter)
    act = torch.empty(m * inter, device="cuda", dtype=torch.bfloat16)
    xs = torch.empty(slots * m * h, device="cuda", dtype=torch.bfloat16)
    args = (1e-6, case[3], case[4], 128, case[5], act, xs)
    _check_w4(act, norm_gate_up_silu_w4a16(*case[:3], *args), xs, case, 1e-6)
    hidden, residual = case[0].clone(), case[1].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_res = norm_gate_up_silu_w4a16(hidden, residual, case[2], *args)
    for seed in (5, 6):
        new = _w4_case(h, inter, 128, zp, seed=seed, device="cuda", m=m)
        hidden.copy_(new[0])
        residual.copy_(new[1])
        graph.replay()
        torch.cuda.synchronize()
        _check_w4(act, g_res, xs, (hidden, residual, *case[2:]), 1e-6)


@pytest.mark.gpu
def test_awq_engine_with_fused_mlp_equals_transformers_gpu(tmp_path, monkeypatch):
    """The AutoAWQ checkpoint of Qwen2.5-3B's shapes (zero points, group 128) through the engine
    at batch 1 with the fused decode MLP: greedy tokens equal transformers' on the dequantized
    weights, and every layer took the W4A16 launch in the eager steps."""
    from pagoda import SamplingParams
    from pagoda.kernels import triton_fused_mlp
    from pagoda.models.llama import DecoderLayer
    from tests.entrypoints.test_gpu_engine import assert_greedy_matches, engine, hf_greedy
    from tests.entrypoints.test_gpu_engine_w4a16 import _awq_pair

    monkeypatch.setattr(DecoderLayer, "fused_mlp_decode", True)
    hf, awq = _awq_pair(tmp_path)
    prompts = [[(7 * i + j) % 150000 for i in range(n)] for j, n in enumerate((6, 120))]
    ref, ref_logits = hf_greedy(hf, prompts, 12)
    del hf
    torch.cuda.empty_cache()
    calls = []
    real = triton_fused_mlp.norm_gate_up_silu_w4a16
    monkeypatch.setattr(
        triton_fused_mlp,
        "norm_gate_up_silu_w4a16",
        lambda *a, **k: calls.append(1) or real(*a, **k),
    )
    llm = engine(awq, True, quantization="AWQ", max_num_seqs=1)
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, ref_logits)
    assert len(calls) >= 2 * 11  # two layers, eleven decode steps a prompt at least


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False])
def test_engine_with_fused_mlp_equals_transformers_gpu(tmp_path, monkeypatch, eager):
    """The engine with the fused decode MLP on every layer: greedy tokens equal transformers'
    (Qwen2.5-3B shapes, 3 layers), eager and with CUDA graphs."""
    from transformers import AutoModelForCausalLM

    from pagoda import SamplingParams
    from pagoda.models.llama import DecoderLayer
    from tests.entrypoints.test_gpu_engine import _save, assert_greedy_matches, engine, hf_greedy

    monkeypatch.setattr(DecoderLayer, "fused_mlp_decode", True)
    path = _save(tmp_path, "qwen2.5-3b.json", layers=3)
    prompts = [[(13 * i + j) % 150000 for i in range(n)] for j, n in enumerate((5, 90, 260))]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    hf.generation_config.eos_token_id = None
    ref, ref_logits = hf_greedy(hf, prompts, 16)
    del hf
    torch.cuda.empty_cache()
    llm = engine(path, eager, max_num_seqs=1)  # batch 1: every decode step takes the fused MLP
    calls = []
    from pagoda.kernels import triton_fused_mlp

    real = triton_fused_mlp.fused_mlp_decode
    monkeypatch.setattr(
        triton_fused_mlp, "fused_mlp_decode", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, ref_logits)
    if eager:
        assert calls  # (with graphs, the captured launches replay without a Python call)
