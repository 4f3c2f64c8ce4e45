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
    with pytest.raises(ValueError, match="block_k2=48: a power of two"):
        FusedMlpConfig(block_k2=48)


def test_workspace_scratch_and_barrier() -> None:
    """The runner's workspace hands out one growing scratch row per dtype and one barrier pair
    per device, zeroed once."""
    from pagoda.kernels.workspace import SplitKWorkspace

    ws = SplitKWorkspace()
    cpu = torch.device("cpu")
    a = ws.scratch(cpu, 100, torch.bfloat16)
    assert a.numel() >= 100 and a.dtype == torch.bfloat16
    assert ws.scratch(cpu, 50, torch.bfloat16) is a
    b = ws.scratch(cpu, 300, torch.bfloat16)
    assert b.numel() >= 300 and b is not a
    assert ws.scratch(cpu, 10, torch.float16).dtype == torch.float16
    bar = ws.barrier(cpu)
    assert bar.tolist() == [0, 0] and bar.dtype == torch.int32
    assert ws.barrier(cpu) is bar


def _compile_ptx() -> str:
    """The kernel's sm_90 PTX for Qwen2.5-3B's MLP (H 2048, I 11008), the default tiles, PDL,
    integer arguments divisible by 16 as Triton specializes them (see `compiled_in_child`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagoda.kernels.triton_fused_mlp import _fused_mlp_kernel as fn

    consts = dict(
        BLOCK_H=2048, BLOCK_I=8, BLOCK_K=512, BLOCK_N=8, BLOCK_K2=1024, PHASES=3, DROP=16,
        NUM_STAGES=3, USE_PDL=True,
    )  # fmt: skip
    kinds = {"bar_ptr": "*i32", "eps": "fp32", "H": "i32", "INTER": "i32"}
    kinds.update({"stride_gu": "i32", "stride_d": "i32"})
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
