"""FP8 KV cache: the torch references and the Triton write / paged attention on FP8 blocks.

The reference stores K / k_scale (and V / v_scale) clamped to the format's range and reads back
stored * scale; attention is then exact float32 over those values. The Triton paged kernel
converts the FP8 tiles to q's type and folds the scales into the softmax scale and the output,
so in float32 it equals the reference up to summation order (1e-5). The Triton interpreter's
FP8 stores round wrongly (see test_triton_fp8.py), so the Triton write is checked on the GPU;
the integer e4m3 path of sm_80 / 87 (`soft_e4m3`: uint8 codes, `kernels/fp8/triton_e4m3.py`)
rounds in integers, so its writes are checked here too, bit for bit, and on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.attention.reference import (
    paged_attention_ref,
    to_cache_dtype,
    write_kv_cache_ref,
)

pytest.importorskip(
    "triton"
)  # the Triton kernels against the references (CI's no-Triton venv skips)

from pagoda.kernels.attention.triton_paged_attention import paged_attention_triton  # noqa: E402

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
H, HKV, D, BS, NB = 4, 2, 32, 16, 12


def _batch(dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seq_lens, q_lens = [37, 5, 20], [37, 1, 4]
    bt = torch.tensor([[1, 2, 3], [5, 0, 0], [7, 8, 0]], dtype=torch.int32)
    slots = []
    for b, n in enumerate(seq_lens):
        slots += [int(bt[b, p // BS]) * BS + p % BS for p in range(n)]
    t = len(slots)
    k = torch.randn(t, HKV, D, generator=g) * 3
    v = torch.randn(t, HKV, D, generator=g)
    cache = torch.zeros(2, NB, BS, HKV, D, dtype=dtype).to(device)
    write_kv_cache_ref(k, v, cache.cpu() if device != "cpu" else cache, torch.tensor(slots))
    q = torch.randn(sum(q_lens), H, D, generator=g)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    return k, v, cache, torch.tensor(slots), q, qsl, seq_lens, bt


@pytest.mark.parametrize("dtype", FP8)
def test_reference_write_stores_scaled_values(dtype):
    k, v, cache, slots, *_ = _batch(dtype)
    write_kv_cache_ref(k, v, cache, slots, k_scale=0.02, v_scale=0.5)
    flat = cache.view(2, -1, HKV, D)
    want_k = to_cache_dtype(k, dtype, 0.02)
    assert torch.equal(flat[0, slots].view(torch.uint8), want_k.view(torch.uint8))
    limit = torch.finfo(dtype).max
    assert torch.equal(want_k.float(), (k / 0.02).clamp(-limit, limit).to(dtype).float())
    # e4m3 keeps 3 mantissa bits: the round trip is within 2^-4 relative (normal values)
    back = flat[1, slots].float() * 0.5
    rel = 2**-4 if dtype == torch.float8_e4m3fn else 2**-3
    assert torch.all((back - v).abs() <= v.abs() * rel + 0.5 * 2**-9)


# (cache dtype, soft_e4m3): the e4m3 cache read through Triton's conversion and as codes
READS = [(torch.float8_e4m3fn, False), (torch.float8_e4m3fn, True), (torch.float8_e5m2, False)]
READ_IDS = ["e4m3", "e4m3-soft", "e5m2"]


@pytest.mark.parametrize(("dtype", "soft"), READS, ids=READ_IDS)
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_paged_attention_reads_fp8_blocks(dtype, soft, splits):
    k, v, cache, slots, q, qsl, seq_lens, bt = _batch(dtype)
    write_kv_cache_ref(k, v, cache, slots, k_scale=0.02, v_scale=0.01)
    ref = paged_attention_ref(q, cache, qsl, seq_lens, bt, 0.2, k_scale=0.02, v_scale=0.01)
    got = paged_attention_triton(
        q,
        cache,
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        bt,
        0.2,
        max(b - a for a, b in zip(qsl, qsl[1:])),
        max(seq_lens),
        num_splits=splits,
        k_scale=0.02,
        v_scale=0.01,
        soft_e4m3=soft,
    )
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_soft_e4m3_write_matches_reference_bit_for_bit():
    """The sm_80 / 87 cache write: K / k_scale and V / v_scale rounded to e4m3 codes in
    integers, the bytes torch's conversion gives (ties to even, saturating at 448: the keys
    here reach 3 * 4.5 / 0.02 ~ 670, beyond the range)."""
    from pagoda.kernels.attention.triton_kv_cache_write import write_kv_cache_triton

    k, v, want, slots, *_ = _batch(torch.float8_e4m3fn)
    write_kv_cache_ref(k, v, want, slots, k_scale=0.02, v_scale=0.01)
    got = torch.zeros_like(want)
    write_kv_cache_triton(k, v, got, slots, 0.02, 0.01, soft_e4m3=True)
    assert (k / 0.02).abs().max() > 448  # saturation is exercised
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(ValueError, match="soft_e4m3 takes a float8_e4m3fn"):
        write_kv_cache_triton(k, v, torch.zeros_like(want, dtype=torch.float8_e5m2), slots,
                              soft_e4m3=True)  # fmt: skip


def _fused_on_fp8_cache(case, dtype, soft, num_splits, query_len, k_center=None):
    """The fused decode on `case` with its cached keys in `dtype` (NaN slots stay NaN in e4m3 /
    e5m2), against the unfused reference: asserts the new tokens' codes equal bit for bit and
    returns the real rows (out, ref). `k_center`: the new keys stored minus it."""
    from pagoda.kernels.attention.reference import fused_decode_attention_ref
    from pagoda.kernels.attention.triton_decode_attention import fused_decode_attention_triton

    ks, vs = 0.011, 0.007
    cache = torch.empty_like(case.kv_cache, dtype=dtype)
    cache.copy_(to_cache_dtype(case.kv_cache.float(), dtype, 1.0))
    ref_cache, out_cache = cache.clone(), cache.clone()
    ref = fused_decode_attention_ref(
        case.positions, case.q, case.k, case.v, case.cos, case.sin, ref_cache,
        case.slot_mapping, case.query_start_loc.tolist(), case.seq_lens_cpu,
        case.block_tables, case.scale, k_scale=ks, v_scale=vs, k_center=k_center,
    )  # fmt: skip
    out = fused_decode_attention_triton(
        case.positions, case.q, case.k, case.v, case.cos, case.sin, out_cache,
        case.slot_mapping, case.query_start_loc, case.seq_lens, case.block_tables, case.scale,
        max(case.seq_lens_cpu), num_splits=num_splits, k_scale=ks, v_scale=vs,
        query_len=query_len, soft_e4m3=soft, k_center=k_center,
    )  # fmt: skip
    n = case.num_real
    written = case.slot_mapping[:n]
    flat_out, flat_ref = out_cache.flatten(1, 2), ref_cache.flatten(1, 2)
    assert torch.equal(
        flat_out[:, written].view(torch.uint8), flat_ref[:, written].view(torch.uint8)
    )
    return out[:n], ref[:n]


@pytest.mark.parametrize("query_len", [1, 3])
def test_fused_decode_attention_soft_e4m3(query_len):
    """RoPE + e4m3 cache write + attention in one launch with the cache as uint8 codes (the
    sm_80 / 87 path), float32 on the CPU interpreter: the new tokens' codes equal the unfused
    reference's bit for bit, outputs to float32 summation order."""
    from tests.kernels.test_fused_decode_attention import make_case

    case = make_case([query_len, 17, 40], 4, 2, 32, torch.float32, device="cpu",
                     query_len=query_len)  # fmt: skip
    out, ref = _fused_on_fp8_cache(case, torch.float8_e4m3fn, True, 2, query_len)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_len", [1, 3])
def test_fused_decode_attention_key_center(query_len, dtype):
    """The fused decode with `k_center` (keys stored minus a per-KV-head constant, as the
    runner sets it: representable in the model dtype) against the unfused reference doing the
    same, e4m3 as uint8 codes on the CPU interpreter: the new keys' codes bit for bit (in bf16
    the kernel rounds K - c to bf16 as the torch subtraction does), outputs to float32
    summation order (bf16: its q and probabilities in the dots); and a center on a model-dtype
    cache is refused (its keys would not be read back as written)."""
    from pagoda.kernels.attention.triton_decode_attention import fused_decode_attention_triton
    from tests.kernels.test_fused_decode_attention import make_case

    case = make_case([query_len, 17, 40], 4, 2, 32, dtype, device="cpu",
                     query_len=query_len)  # fmt: skip
    center = torch.randn(2, 32, generator=torch.Generator().manual_seed(5)) * 0.5
    center = center.to(dtype).float()
    out, ref = _fused_on_fp8_cache(case, torch.float8_e4m3fn, True, 2, query_len, center)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        assert err < 1e-2
    with pytest.raises(ValueError, match="k_center applies to an FP8 cache"):
        fused_decode_attention_triton(
            case.positions, case.q, case.k, case.v, case.cos, case.sin, case.kv_cache,
            case.slot_mapping, case.query_start_loc, case.seq_lens, case.block_tables,
            case.scale, max(case.seq_lens_cpu), k_center=center, query_len=query_len,
        )  # fmt: skip


def test_fp8_attention_is_close_to_full_precision():
    """Calibrated e4m3 (scale = max|x| / 448) changes attention outputs by about e4m3's
    relative step (2^-4) times the value: far less than the outputs themselves."""
    k, v, cache16, slots, q, qsl, seq_lens, bt = _batch(torch.float32)
    write_kv_cache_ref(k, v, cache16, slots)
    exact = paged_attention_ref(q, cache16, qsl, seq_lens, bt, 0.2)
    cache8 = torch.zeros_like(cache16, dtype=torch.float8_e4m3fn)
    ks, vs = k.abs().max().item() / 448, v.abs().max().item() / 448
    write_kv_cache_ref(k, v, cache8, slots, k_scale=ks, v_scale=vs)
    approx = paged_attention_ref(q, cache8, qsl, seq_lens, bt, 0.2, k_scale=ks, v_scale=vs)
    err = (approx - exact).abs().max().item()
    assert 0 < err < 0.1 * exact.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "soft"), READS, ids=READ_IDS)
def test_triton_write_and_attention_on_gpu(dtype, soft):
    """soft=False on an e4m3 cache needs sm_89+ (Triton's conversion); soft runs anywhere."""
    if dtype == torch.float8_e4m3fn and not soft and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton converts e4m3 from sm_89")
    from pagoda.kernels.attention.triton_kv_cache_write import write_kv_cache_triton

    k, v, _, slots, q, qsl, seq_lens, bt = _batch(dtype)
    ref_cache = torch.zeros(2, NB, BS, HKV, D, dtype=dtype)
    write_kv_cache_ref(k, v, ref_cache, slots, k_scale=0.02, v_scale=0.01)
    cache = torch.zeros(2, NB, BS, HKV, D, dtype=dtype, device="cuda")
    kb, vb = k.cuda().bfloat16(), v.cuda().bfloat16()
    write_kv_cache_triton(kb, vb, cache, slots.cuda(), 0.02, 0.01, soft_e4m3=soft)
    ref_bf = torch.zeros_like(ref_cache)
    write_kv_cache_ref(kb.cpu(), vb.cpu(), ref_bf, slots, k_scale=0.02, v_scale=0.01)
    assert torch.equal(cache.cpu().view(torch.uint8), ref_bf.view(torch.uint8))
    for splits in (1, 4):
        got = paged_attention_triton(
            q.cuda().bfloat16(),
            cache,
            torch.tensor(qsl, dtype=torch.int32, device="cuda"),
            torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
            bt.cuda(),
            0.2,
            37,
            37,
            num_splits=splits,
            k_scale=0.02,
            v_scale=0.01,
            soft_e4m3=soft,
        )
        ref = paged_attention_ref(
            q.bfloat16().float(), ref_bf, qsl, seq_lens, bt, 0.2, k_scale=0.02, v_scale=0.01
        )
        # bf16 q and probabilities in the tensor-core dots: ~2^-8 relative
        torch.testing.assert_close(got.float().cpu(), ref, rtol=2e-2, atol=2e-2)


# mean |prompt log-prob - the model-dtype cache's| on the static-kv fixture, measured on the CPU
# in float32 (0.065 e4m3 with its calibrated scales, 0.126 e5m2): twice that as the GPU bound
_MEAN_LOGPROB_DRIFT = {"fp8": 0.13, "fp8_e5m2": 0.25}


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_engine_with_fp8_kv_cache_on_gpu(kv):
    from pagoda import LLM, SamplingParams
    from tests.quant.test_fp8 import FP8_FIXTURES

    if kv == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 needs sm_89+")
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": list(range(5, 60))}, {"prompt_token_ids": [7, 8, 9, 10]}]
    logprobs, tokens = {}, {}
    for dtype in ("auto", kv):
        llm = LLM(
            str(FP8_FIXTURES / "static-kv"),
            dtype="bfloat16",
            kv_cache_dtype=dtype,
            gpu_memory_utilization=0.15,
            print_memory_report=False,
        )
        lp = []
        for out, prompt in zip(llm.generate(prompts, params), prompts):
            ids = prompt["prompt_token_ids"]
            lp += [d[t].logprob for t, d in zip(ids[1:], out.prompt_logprobs[1:])]
        logprobs[dtype] = torch.tensor(lp)
        tokens[dtype] = llm.llm_engine.memory_report.kv_token_capacity
        llm.shutdown()
    assert tokens[kv] >= 1.9 * tokens["auto"]
    drift = (logprobs[kv] - logprobs["auto"]).abs().mean().item()
    assert 0 < drift < _MEAN_LOGPROB_DRIFT[kv]


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "soft"), READS, ids=READ_IDS)
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("query_len", [1, 5])
@pytest.mark.parametrize("centered", [False, True])
def test_fused_decode_attention_on_fp8_cache(dtype, soft, num_splits, query_len, centered):
    """RoPE + FP8 cache write + attention in one launch against the unfused reference: the
    new keys / values in the cache bit for bit, outputs within bf16 rounding; one new token a
    sequence (decode) and five (a verify step of 4 drafts)."""
    if dtype == torch.float8_e4m3fn and not soft and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton converts e4m3 from sm_89")
    from tests.kernels.test_fused_decode_attention import make_case

    case = make_case(
        [query_len, 17, 300, 2000], 28, 4, 128, torch.bfloat16, device="cuda", query_len=query_len
    )
    # a center as the runner binds it: float32 values representable in the model dtype
    center = torch.randn(4, 128, device="cuda").bfloat16().float() if centered else None
    out, ref = _fused_on_fp8_cache(case, dtype, soft, num_splits, query_len, center)
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < 1e-2  # bf16 q and probabilities in the dots


def test_scales_are_ignored_by_a_model_dtype_cache():
    """A checkpoint's k_scale / v_scale describe FP8 storage: a float cache reads K and V as
    written, on every path (a GPU run of the static-kv fixture with a bf16 cache applied them
    and drifted by 1.4 nats a token before this held)."""
    k, v, cache, slots, q, qsl, seq_lens, bt = _batch(torch.float32)
    write_kv_cache_ref(k, v, cache, slots, k_scale=0.02, v_scale=0.01)
    plain = torch.zeros_like(cache)
    write_kv_cache_ref(k, v, plain, slots)
    assert torch.equal(cache, plain)
    want = paged_attention_ref(q, plain, qsl, seq_lens, bt, 0.2)
    args = (torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32), bt)
    got = paged_attention_triton(q, cache, *args, 0.2, 37, 37, k_scale=0.02, v_scale=0.01)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ref = paged_attention_ref(q, cache, qsl, seq_lens, bt, 0.2, k_scale=0.02, v_scale=0.01)
    torch.testing.assert_close(ref, want, rtol=0, atol=0)
