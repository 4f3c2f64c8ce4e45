"""Fused decode attention (RoPE + cache write + paged attention) against the unfused reference.

Without CUDA the kernel runs under TRITON_INTERPRET=1, set here before the kernel module is
imported (the variable is process-wide and read when `@triton.jit` runs), on small shapes. With
CUDA the same cases run compiled; `gpu`-marked cases add Qwen2.5-7B shapes (28 q / 4 kv heads,
D = 128), contexts up to 40k, batches up to 64, CUDA-graph replay and the model layer.

Every case checks the output against `fused_decode_attention_ref` (rotary -> cache write ->
paged attention), the cache contents bit for bit (NaN everywhere no sequence owns, including the
new tokens' slots before the step, so a kernel that read a slot it had not written would show
NaN), that q/k/v are left untouched and that padding tokens (slot -1) write nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1" and tuple(
    int(part) for part in triton.__version__.split(".")[:2]
) < (3, 7):
    # Its interpreter calls int() on 1-element arrays (loop bounds read from memory), which
    # numpy >= 2.4 rejects; 3.7 fixed it. The compiled GPU path is unaffected.
    pytest.skip("CPU tests need triton >= 3.7 (interpreter bug)", allow_module_level=True)

from pagoda.kernels.attention.reference import fused_decode_attention_ref  # noqa: E402
from pagoda.kernels.attention.triton_decode_attention import fused_decode_attention_triton  # noqa: E402
from pagoda.kernels.attention.triton_paged_attention import choose_num_splits  # noqa: E402
from pagoda.layers import attention as attention_mod  # noqa: E402
from pagoda.layers.attention import Attention, AttentionMetadata  # noqa: E402
from pagoda.layers.linear import default_linear_method_factory  # noqa: E402
from pagoda.layers.rotary import MRotaryEmbedding, RotaryEmbedding, get_rope  # noqa: E402
from pagoda.models.llama import DecoderAttention, DecoderOptions  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 runs with input_precision="ieee", so it is exact up to summation order.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@dataclass
class Case:
    positions: torch.Tensor  # [T]
    qkv: torch.Tensor  # [T, (H + 2 Hkv) * D]; q, k, v are strided views of it
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    kv_cache: torch.Tensor  # [2, N, bs, Hkv, D]
    slot_mapping: torch.Tensor  # [T]
    query_start_loc: torch.Tensor  # [T+1]
    seq_lens: torch.Tensor  # [T]
    block_tables: torch.Tensor  # [T, max_blocks]
    seq_lens_cpu: list[int]
    num_padding: int  # trailing sequences with slot -1 (CUDA-graph batch padding)
    scale: float
    query_len: int = 1  # new tokens per sequence

    @property
    def num_real(self) -> int:  # tokens of real sequences
        return (len(self.seq_lens_cpu) - self.num_padding) * self.query_len


def make_case(
    seq_lens: list[int],  # per real sequence, including the new token
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    *,
    num_padding: int = 1,
    block_size: int = 16,
    seed: int = 0,
    device: str = DEVICE,
    query_len: int = 1,
) -> Case:
    """Random decode batch: cached keys [0, len - Q) per sequence in shuffled blocks, NaN
    elsewhere (block 0, the null block, included), Q = `query_len` new tokens per sequence (a
    verify step when Q > 1); padding sequences as the graph runner pads (Q tokens, length Q,
    slot -1)."""
    q_len = query_len
    g = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # + null block 0 and spares
    cache = torch.full(
        (2, num_blocks, block_size, num_kv_heads, head_dim),
        float("nan"),
        dtype=dtype,
        device=device,
    )
    perm = torch.randperm(num_blocks - 1, generator=g, device=device) + 1
    num_seqs = len(seq_lens) + num_padding
    block_tables = torch.zeros(num_seqs, max(blocks_per_seq) + 2, dtype=torch.int32, device=device)
    slots = []
    first = 0
    for b, (seq_len, nb) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        ids = perm[first : first + nb]
        first += nb
        block_tables[b, :nb] = ids.to(torch.int32)
        keys = cache[:, ids].flatten(1, 2)  # copy: [2, nb * bs, Hkv, D]
        keys[:, : seq_len - q_len] = torch.randn(
            2, seq_len - q_len, num_kv_heads, head_dim, generator=g, device=device
        ).to(dtype)
        cache[:, ids] = keys.view(2, nb, block_size, num_kv_heads, head_dim)
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(ids[pos // block_size]) * block_size + pos % block_size)
    all_lens = list(seq_lens) + [q_len] * num_padding
    qkv = torch.randn(
        num_seqs * q_len, (num_heads + 2 * num_kv_heads) * head_dim, generator=g, device=device
    ).to(dtype)
    q, k, v = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    rope = RotaryEmbedding(head_dim, max(all_lens) + 8, rope_theta=10000.0).to(device)
    return Case(
        positions=torch.tensor(
            [p for n in all_lens for p in range(n - q_len, n)], dtype=torch.int64, device=device
        ),
        qkv=qkv,
        q=q,
        k=k,
        v=v,
        cos=rope.cos_cache,
        sin=rope.sin_cache,
        kv_cache=cache,
        slot_mapping=torch.tensor(
            slots + [-1] * (num_padding * q_len), dtype=torch.int64, device=device
        ),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * q_len,
        seq_lens=torch.tensor(all_lens, dtype=torch.int32, device=device),
        block_tables=block_tables,
        seq_lens_cpu=all_lens,
        num_padding=num_padding,
        scale=head_dim**-0.5,
        query_len=q_len,
    )


def run_fused(case: Case, cache: torch.Tensor, **kwargs) -> torch.Tensor:
    return fused_decode_attention_triton(
        case.positions, case.q, case.k, case.v, case.cos, case.sin, cache, case.slot_mapping,
        case.query_start_loc, case.seq_lens, case.block_tables, case.scale,
        max(case.seq_lens_cpu), query_len=case.query_len, **kwargs,
    )  # fmt: skip


def run_ref(case: Case, cache: torch.Tensor) -> torch.Tensor:
    return fused_decode_attention_ref(
        case.positions, case.q, case.k, case.v, case.cos, case.sin, cache, case.slot_mapping,
        case.query_start_loc.tolist(), case.seq_lens_cpu, case.block_tables, case.scale,
    )  # fmt: skip


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), f"{out.isnan().sum().item()} output elements NaN"
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e} >= {TOLERANCE[dtype]:.0e}"


def check(case: Case, **kwargs) -> torch.Tensor:
    """Run fused and reference on copies of the cache; returns the fused output."""
    qkv_before = case.qkv.clone()
    cache_ref = case.kv_cache.clone()
    cache_out = case.kv_cache.clone()
    ref = run_ref(case, cache_ref)
    out = run_fused(case, cache_out, **kwargs)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype  # [T, H*D]
    assert torch.equal(case.qkv, qkv_before), "q / k / v were modified"
    # The cache: rotated keys and values of the real tokens, bit-identical to the unfused ops
    # (compiled float32 may contract products into FMAs: bf16/fp16 rounding steps prevent it);
    # padding tokens (slot -1) left no trace.
    exact = case.q.dtype != torch.float32 or DEVICE != "cuda"
    tol = 0.0 if exact else 1e-5
    torch.testing.assert_close(cache_out, cache_ref, rtol=tol, atol=tol, equal_nan=True)
    written = case.slot_mapping[: case.num_real]
    flat = cache_out.flatten(1, 2)  # [2, N * bs, Hkv, D]
    assert not flat[:, written].isnan().any(), "new tokens' slots were not written"
    assert (flat.isnan() != case.kv_cache.flatten(1, 2).isnan()).sum() == written.numel() * (
        2 * flat.shape[2] * flat.shape[3]
    ), "slots other than the new tokens' changed"
    # Outputs: real rows against the reference; padding rows are don't-care but finite (they
    # attend to their own k/v only, never to the NaN null block).
    n = case.num_real
    assert_close(out[:n], ref[:n], case.q.dtype)
    assert not out[n:].isnan().any()
    return out


# (num_heads, num_kv_heads): GQA ratios 1, 4 and 7 (Qwen2.5-7B: 28 over 4).
GQA = [(2, 2), (8, 2), (14, 2)]
GQA_IDS = ["gqa1", "gqa4", "gqa7"]
# Contexts (new token included) around block edges, mostly not multiples of the block size,
# one long enough for 3 non-empty split chunks of 128 keys, and a fresh 1-token sequence.
SEQ_LENS = [1, 15, 16, 17, 70, 300]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA, ids=GQA_IDS)
def test_matches_reference(num_heads, num_kv_heads, head_dim, num_splits, dtype):
    case = make_case(SEQ_LENS, num_heads, num_kv_heads, head_dim, dtype, seed=head_dim + num_heads)
    check(case, num_splits=num_splits)


# 64 splits run compiled (`-m gpu`): under the interpreter they took 40 s and 23 s of CI; 8
# splits of these lengths already leave most chunks empty.
_GPU_64 = pytest.param(64, marks=pytest.mark.gpu)


@pytest.mark.parametrize("num_splits", [2, 8, _GPU_64])
def test_many_splits_with_empty_chunks(num_splits):
    """With many splits most chunks of the short sequences are empty (m = -inf, l = 0)."""
    case = make_case([300, 33, 2, 129], 14, 2, 128, torch.bfloat16, num_padding=2, seed=3)
    check(case, num_splits=num_splits)


def test_splits_agree_with_single_pass():
    """Split-KV partials + reduce equal the single pass up to float32 summation order."""
    case = make_case([300, 200], 8, 2, 64, torch.float32, num_padding=0, seed=4)
    one = check(case, num_splits=1)
    four = check(case, num_splits=4)
    torch.testing.assert_close(four, one, rtol=1e-5, atol=1e-5)


def test_float32():
    check(make_case(SEQ_LENS, 8, 2, 64, torch.float32, seed=5), num_splits=1)


def test_auto_split_choice_matches_paged_attention():
    # The fused op delegates to paged attention's `choose_num_splits`: on the CPU `_num_sms` is
    # 1, so it never splits; on an H200 (132 SMs) this batch gets 2 splits.
    assert choose_num_splits(6, 2, 1, 300, 1) == 1
    check(make_case(SEQ_LENS, 8, 2, 64, torch.bfloat16, seed=6))


@pytest.mark.parametrize("head_dim", [80, 96])
def test_head_dim_not_power_of_two(head_dim):
    """Padded lanes of D: the rotate-half partner and cos/sin index stay within [0, D)."""
    check(make_case([40, 7], 8, 2, head_dim, torch.float16, seed=7), num_splits=1)
    check(make_case([140, 7], 8, 2, head_dim, torch.float16, seed=8), num_splits=2)


def test_block_size_32():
    check(make_case([1, 31, 32, 33, 90], 8, 2, 64, torch.bfloat16, block_size=32, seed=9))


def test_contiguous_inputs_and_out_buffer():
    """q/k/v as separate contiguous [T, H, D] tensors; out into a caller's buffer."""
    case = make_case([20, 50], 8, 2, 64, torch.float16, seed=10)
    num_tokens = case.q.shape[0]
    ref = run_ref(case, case.kv_cache.clone())
    cache = case.kv_cache.clone()
    out = torch.full((num_tokens, 8 * 64), float("nan"), dtype=torch.float16, device=DEVICE)
    result = fused_decode_attention_triton(
        case.positions, case.q.contiguous().view(num_tokens, 8, 64),
        case.k.contiguous().view(num_tokens, 2, 64), case.v.contiguous().view(num_tokens, 2, 64),
        case.cos, case.sin, cache, case.slot_mapping, case.query_start_loc, case.seq_lens,
        case.block_tables, case.scale, 50, out=out,
    )  # fmt: skip
    assert result is out
    assert_close(out[: case.num_real], ref[: case.num_real], torch.float16)


def test_bad_arguments():
    case = make_case([5, 9], 8, 2, 64, torch.float32, num_padding=0)
    with pytest.raises(ValueError, match="tokens per sequence"):
        fused_decode_attention_triton(
            case.positions, case.q, case.k, case.v, case.cos, case.sin, case.kv_cache,
            case.slot_mapping, case.query_start_loc[:2], case.seq_lens[:1],
            case.block_tables, case.scale, 9,
        )  # fmt: skip
    with pytest.raises(ValueError, match="dtype"):
        fused_decode_attention_triton(
            case.positions, case.q.half(), case.k.half(), case.v.half(), case.cos, case.sin,
            case.kv_cache, case.slot_mapping, case.query_start_loc, case.seq_lens,
            case.block_tables, case.scale, 9,
        )  # fmt: skip
    with pytest.raises(ValueError, match="num_splits"):
        run_fused(case, case.kv_cache.clone(), num_splits=0)


# ---- several new tokens per sequence (speculative verify steps) -----------------------------


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("query_len", [2, 5, 9])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA, ids=GQA_IDS)
def test_verify_step_matches_reference(num_heads, num_kv_heads, query_len, num_splits):
    """1 + k tokens per sequence (k drafts): causal among the new tokens, every cached key
    visible, the new keys stored; contexts across block edges, a sequence holding only its
    new tokens, and graph-padding sequences."""
    if num_heads // num_kv_heads * query_len > 128:
        pytest.skip("over MAX_QUERY_ROWS: the paged attention takes such steps")
    lens = [query_len, query_len + 1, 16 + query_len, 70, 300]
    case = make_case(
        lens, num_heads, num_kv_heads, 64, torch.bfloat16, query_len=query_len, num_padding=2,
        seed=20 + query_len,
    )  # fmt: skip
    check(case, num_splits=num_splits)


def test_verify_step_float32():
    """float32 (exact up to summation order), 5 tokens a sequence, 2 splits (the FP8 cache:
    `test_fp8_kv_cache.py`, on the GPU)."""
    check(make_case([9, 40, 130], 8, 2, 64, torch.float32, query_len=5, seed=31), num_splits=2)


def test_verify_step_rejects_window_and_too_many_rows():
    case = make_case([20, 30], 8, 2, 64, torch.float32, query_len=4, num_padding=0)
    with pytest.raises(ValueError, match="sliding window"):
        run_fused(case, case.kv_cache.clone(), sliding_window=8)
    case = make_case([40], 14, 2, 64, torch.float32, query_len=19, num_padding=0)
    with pytest.raises(ValueError, match="query rows"):
        run_fused(case, case.kv_cache.clone())


# ---- the model layer: DecoderAttention's two paths -------------------------------------------


def _layer(qk_norm: bool, dtype: torch.dtype, device: str, heads=(4, 2), head_dim=64, rope=None):
    num_heads, num_kv_heads = heads
    config = SimpleNamespace(
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=8192,  # positions up to 5k in the GPU case
        rope_theta=10000.0,
    )
    rope = rope or get_rope(config, head_dim)
    layer = DecoderAttention(
        config,
        DecoderOptions(qkv_bias=True, qk_norm=qk_norm),
        rope,
        default_linear_method_factory,
        "layers.0.self_attn",
    )
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    # Linear and norm weights in the model dtype; the cos/sin tables stay float32 (as loaded).
    for m in (layer.qkv_proj, layer.o_proj, layer.q_norm, layer.k_norm):
        if m is not None:
            m.to(device=device, dtype=dtype)
    layer.rotary_emb.to(device)
    return layer


def _decode_metadata(case: Case) -> AttentionMetadata:
    return AttentionMetadata(
        num_actual_tokens=case.q.shape[0],
        query_start_loc=case.query_start_loc,
        seq_lens=case.seq_lens,
        block_tables=case.block_tables,
        slot_mapping=case.slot_mapping,
        max_query_len=case.query_len,
        max_seq_len=max(case.seq_lens_cpu),
        query_start_loc_cpu=case.query_start_loc.tolist(),
        seq_lens_cpu=case.seq_lens_cpu,
        uniform_query_len=case.query_len > 1,
    )


def _run_layer(layer, case: Case, hidden: torch.Tensor, md: AttentionMetadata):
    layer.attn.kv_cache = case.kv_cache.clone()
    out = layer(case.positions, hidden, md)
    return out, layer.attn.kv_cache


@pytest.mark.parametrize("rope", ["qwen2", "qwen3", "qwen2_5_vl"])
def test_decoder_attention_fused_path_matches_unfused(monkeypatch, rope):
    """The wiring in DecoderAttention / Attention: forcing the fused path on the CPU gives the
    unfused path's output (real rows) and exactly its cache — with M-RoPE too (Qwen2.5-VL's
    decode steps: [T] positions, the fused kernel reading M-RoPE's own cos/sin table)."""
    dtype = torch.bfloat16
    mrope = MRotaryEmbedding(64, 8192, 10000.0, [8, 12, 12]) if rope == "qwen2_5_vl" else None
    layer = _layer(rope == "qwen3", dtype, "cpu", rope=mrope)
    case = make_case([5, 20, 33], 4, 2, 64, dtype, seed=12, device="cpu")
    md = _decode_metadata(case)
    hidden = torch.randn(case.q.shape[0], 128, generator=torch.Generator().manual_seed(13))
    hidden = hidden.to(dtype)
    # On the CPU the layer never takes the fused path: the reference path is unchanged.
    assert not layer.attn.use_fused_decode(case.positions, case.q, layer.rotary_emb, md)
    want, want_cache = _run_layer(layer, case, hidden, md)
    monkeypatch.setattr(Attention, "use_fused_decode", lambda self, *args: True)
    got, got_cache = _run_layer(layer, case, hidden, md)
    torch.testing.assert_close(got_cache, want_cache, rtol=0, atol=0, equal_nan=True)
    n = case.num_real
    assert_close(got[:n], want[:n], dtype)


@pytest.mark.parametrize("rope", ["qwen2", "qwen2_5_vl"])
def test_decoder_attention_verify_step_fused_matches_unfused(monkeypatch, rope):
    """A verify step (5 tokens a sequence, as the verify graphs run it) through the layer:
    the fused path's output and cache equal the unfused path's (RoPE, cache write, paged
    attention), with M-RoPE's [T] positions too; a step not marked uniform never takes it."""
    dtype = torch.bfloat16
    mrope = MRotaryEmbedding(64, 8192, 10000.0, [8, 12, 12]) if rope == "qwen2_5_vl" else None
    layer = _layer(False, dtype, "cpu", rope=mrope)
    case = make_case([5, 20, 33], 4, 2, 64, dtype, seed=14, device="cpu", query_len=5)
    md = _decode_metadata(case)
    hidden = torch.randn(case.q.shape[0], 128, generator=torch.Generator().manual_seed(15))
    hidden = hidden.to(dtype)
    want, want_cache = _run_layer(layer, case, hidden, md)
    md.uniform_query_len = False  # e.g. an eager prefill of equal-length prompts
    assert not layer.attn.use_fused_decode(case.positions, case.q, layer.rotary_emb, md)
    md.uniform_query_len = True
    monkeypatch.setattr(Attention, "use_fused_decode", lambda self, *args: True)
    got, got_cache = _run_layer(layer, case, hidden, md)
    torch.testing.assert_close(got_cache, want_cache, rtol=0, atol=0, equal_nan=True)
    assert_close(got[: case.num_real], want[: case.num_real], dtype)


def test_fused_path_predicate_for_multi_token_steps():
    """`use_fused_decode` for query length > 1 (checked before the device): only steps marked
    uniform, without a sliding window, within the row and sequence limits."""
    case = make_case([20], 4, 2, 64, torch.float32, device="cpu", query_len=3, num_padding=0)
    md = _decode_metadata(case)
    attn = Attention(4, 64, 0.125, 2)
    fake_cuda = SimpleNamespace(is_cuda=True, shape=case.q.shape, dtype=case.q.dtype)
    attn.kv_cache = case.kv_cache
    rope = RotaryEmbedding(64, 64, rope_theta=10000.0)
    uses = attn.use_fused_decode
    triton_ok = attention_mod._fused_decode_kernel() is not None
    assert uses(case.positions, fake_cuda, rope, md) == triton_ok
    md.uniform_query_len = False
    assert not uses(case.positions, fake_cuda, rope, md)
    md.uniform_query_len = True
    attn.sliding_window = 16
    assert not uses(case.positions, fake_cuda, rope, md)
    attn.sliding_window = None
    md.max_query_len = 33  # 2 heads a KV head x 33 tokens > 64 rows (FUSED_MAX_QUERY_ROWS)
    assert not uses(case.positions, fake_cuda, rope, md)
    md.max_query_len = 3
    md.seq_lens = torch.full((17,), 20, dtype=torch.int32)  # > FUSED_MAX_VERIFY_SEQS
    md.num_actual_tokens = 17 * 3
    many = SimpleNamespace(is_cuda=True, shape=(17 * 3, case.q.shape[1]), dtype=case.q.dtype)
    assert not uses(torch.zeros(17 * 3, dtype=torch.long), many, rope, md)


def test_env_var_turns_fused_path_off(monkeypatch):
    try:
        monkeypatch.setenv("PAGODA_DISABLED_KERNELS", "fused_decode_attn")
        attention_mod._fused_decode_kernel.cache_clear()
        assert attention_mod._fused_decode_kernel() is None
        monkeypatch.delenv("PAGODA_DISABLED_KERNELS")
        attention_mod._fused_decode_kernel.cache_clear()
        assert attention_mod._fused_decode_kernel() is fused_decode_attention_triton
    finally:
        attention_mod._fused_decode_kernel.cache_clear()


# ---- GPU: Qwen2.5-7B shapes ---------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_splits", [None, 1])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_gpu_qwen_shapes(batch, num_splits):
    """28 q / 4 kv heads, D = 128, bf16, contexts 1..40k: automatic split-KV and single pass."""
    g = torch.Generator().manual_seed(batch)
    lens = [int(n) for n in torch.randint(1, 40_001, (batch,), generator=g)]
    lens[0] = 40_000
    if batch > 1:
        lens[1] = 1
    case = make_case(lens, 28, 4, 128, torch.bfloat16, num_padding=3, seed=batch)
    if num_splits is None and batch == 1:
        assert choose_num_splits(len(case.seq_lens_cpu), 4, 1, 40_000, 132) > 1
    check(case, num_splits=num_splits)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_short_contexts(dtype):
    """The decode contexts the ~768-token profile has, at batch 1 and 16."""
    for batch in (1, 16):
        g = torch.Generator().manual_seed(batch)
        lens = [int(n) for n in torch.randint(600, 900, (batch,), generator=g)]
        check(make_case(lens, 28, 4, 128, dtype, num_padding=0, seed=batch))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("window", [None, 100])
def test_gpu_kv_prefetch_changes_no_result(window):
    """The splits' first cache blocks prefetched before the wait (on by default on sm_90):
    output and cache bit-identical to kv_prefetch=False, contexts from 1 to 9k keys (splits
    with more blocks than the prefetched 4, empty splits), with and without a window."""
    from pagoda.kernels.attention.triton_decode_attention import _kv_block_bytes

    case = make_case([9000, 1, 40, 700, 64], 28, 4, 128, torch.bfloat16, num_padding=2, seed=9)
    if torch.cuda.get_device_capability() >= (9, 0):  # the prefetch really runs
        assert _kv_block_bytes(case.kv_cache, 7 * 8) == 16 * 4 * 128 * 2
    outs, caches = [], []
    for kv_prefetch in (True, False):
        cache = case.kv_cache.clone()
        outs.append(run_fused(case, cache, num_splits=8, sliding_window=window,
                              kv_prefetch=kv_prefetch))  # fmt: skip
        caches.append(cache)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(caches[0], caches[1], rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_replay():
    """Captured once with fixed splits and padding rows, replayed for new lengths and tables."""
    first = make_case([4000, 900, 17, 12000], 28, 4, 128, torch.bfloat16, num_padding=4, seed=1)
    second = make_case([13, 16000, 2500, 777], 28, 4, 128, torch.bfloat16, num_padding=4, seed=2)
    num_blocks = max(first.kv_cache.shape[1], second.kv_cache.shape[1])
    width = max(first.block_tables.shape[1], second.block_tables.shape[1])

    def load(case: Case, static: Case) -> None:
        static.qkv.copy_(case.qkv)
        static.positions.copy_(case.positions)
        static.slot_mapping.copy_(case.slot_mapping)
        static.seq_lens.copy_(case.seq_lens)
        static.block_tables.zero_()
        static.block_tables[:, : case.block_tables.shape[1]] = case.block_tables
        static.kv_cache.fill_(float("nan"))
        static.kv_cache[:, : case.kv_cache.shape[1]] = case.kv_cache

    static = make_case([4000, 900, 17, 12000], 28, 4, 128, torch.bfloat16, num_padding=4)
    static.kv_cache = torch.empty_like(second.kv_cache[:, :1]).expand(-1, num_blocks, -1, -1, -1)
    static.kv_cache = static.kv_cache.contiguous()
    static.block_tables = torch.zeros(8, width, dtype=torch.int32, device=DEVICE)
    static.cos, static.sin = second.cos, second.sin  # the larger table (positions up to 16k)
    out = torch.empty(8, 28 * 128, dtype=torch.bfloat16, device=DEVICE)

    def step() -> None:
        run_fused(static, static.kv_cache, num_splits=8, out=out)

    load(first, static)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for case in (first, second):
        load(case, static)
        before = static.kv_cache.clone()
        graph.replay()
        case.kv_cache, case.block_tables = before, static.block_tables.clone()
        ref = run_ref(case, before)
        torch.testing.assert_close(static.kv_cache, before, rtol=0, atol=0, equal_nan=True)
        assert_close(out[: case.num_real], ref[: case.num_real], torch.bfloat16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qk_norm", [False, True], ids=["qwen2", "qwen3"])
def test_gpu_decoder_attention_fused_vs_unfused(monkeypatch, qk_norm):
    """The layer on CUDA takes the fused path for decode-only batches only, and it agrees with
    `PAGODA_DISABLED_KERNELS=fused_decode_attn` (the unfused kernels): output close, cache
    identical."""
    dtype = torch.bfloat16
    layer = _layer(qk_norm, dtype, DEVICE, heads=(28, 4), head_dim=128)
    case = make_case([700, 1, 33, 5000], 28, 4, 128, dtype, num_padding=2, seed=14)
    md = _decode_metadata(case)
    hidden = torch.randn(case.q.shape[0], 128, device=DEVICE).to(dtype)
    layer.attn.kv_cache = case.kv_cache
    assert layer.attn.use_fused_decode(case.positions, case.q, layer.rotary_emb, md)
    prefill = AttentionMetadata(**{**md.__dict__, "max_query_len": 2})
    assert not layer.attn.use_fused_decode(case.positions, case.q, layer.rotary_emb, prefill)
    # M-RoPE: fused with [T] positions (decode steps), not with [3, T] (image tokens)
    mrope = MRotaryEmbedding(128, 8192, 10000.0, [16, 24, 24]).to(DEVICE)
    assert layer.attn.use_fused_decode(case.positions, case.q, mrope, md)
    positions3 = case.positions.expand(3, -1)
    assert not layer.attn.use_fused_decode(positions3, case.q, mrope, md)
    got, got_cache = _run_layer(layer, case, hidden, md)
    try:
        monkeypatch.setenv("PAGODA_DISABLED_KERNELS", "fused_decode_attn")
        attention_mod._fused_decode_kernel.cache_clear()
        assert not layer.attn.use_fused_decode(case.positions, case.q, layer.rotary_emb, md)
        want, want_cache = _run_layer(layer, case, hidden, md)
    finally:
        attention_mod._fused_decode_kernel.cache_clear()
    torch.testing.assert_close(got_cache, want_cache, rtol=0, atol=0, equal_nan=True)
    n = case.num_real
    assert_close(got[:n], want[:n], dtype)
