"""The TMA-fed, warp-specialized wgmma W4A16 GEMM: its configs and sm_90 code compiled here
without a GPU, and the kernel against the dequantized matmul on an H100 / H200 (`gpu`). Its
unpacking (quad transpose, then the dequantization asm) is the one `test_gluon_mma_wgmma`
checks against `repack_mma` on the CPU (`unpack_slots(..., natural=True)`)."""

from __future__ import annotations

import re

import pytest
import torch

from pagoda.kernels.wna16 import gluon_wgmma_tma as tk

pytest.importorskip("triton")  # the layout (`repack_mma`) lives with the Triton GEMV
from tests.kernels.test_gluon_mma_wgmma import (  # noqa: E402
    check_configs,
    check_shapes_and_graph_replay,
    compiled_in_child,
)


def test_supported_shapes_and_bad_inputs():
    assert tk.tma_supported(2560, 2048, 128) and tk.tma_supported(16, 64, -1)
    assert not tk.tma_supported(2560, 2048, 32)  # groups must be whole 64-K tiles
    assert not tk.tma_supported(2568, 2048, 128) and not tk.tma_supported(2560, 2000, 128)
    words = torch.zeros(64 * 64 // 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="wna16_wgmma_tma"):
        tk.wna16_wgmma_tma(torch.zeros(2, 64), words, torch.zeros(4, 1, 8, dtype=torch.int32),
                           64, -1)  # fmt: skip


def test_default_configs_fit_and_fill_the_gpu():
    for m in (1, 9, 16, 33, 64, 100, 128, 200, 256, 512):
        for n, k in ((4608, 3584), (3584, 18944), (37888, 3584), (2560, 2048), (22016, 2048)):
            block_m, wgs, split, stages = tk.default_tma_config(m, n, k, 132)
            assert block_m in tk.BLOCK_MS and block_m >= min(m, 128)
            assert block_m < 2 * max(m, 16) or block_m == tk.BLOCK_MS[0]
            assert stages >= 2 * wgs  # the epilogue stages a slab in the ring
            assert tk.smem_bytes(block_m, wgs, stages, True) <= tk.SMEM_BYTES
            tiles = tk.tile_count(m, n, block_m, wgs)
            whole, used, per = tk.tail_schedule(tiles, k // 64, 132, split)
            assert used == split and whole == tiles - (tiles % 132 if split > 1 else 0)
            assert per >= 4 and (used - 1) * per < k // 64 <= used * per  # each split a step
            partials = split * (tiles - whole) * tk.rows_per_cta(wgs) * block_m * 4
            assert partials <= n * k // 2 or split == 1
    # 7B gate_up at 128 rows: 296 tiles = two waves of 132 whole, the 32 left split 4 ways
    # (a last wave of 14-step CTAs instead of one of 56-step ones)
    assert tk.default_tma_config(128, 37888, 3584, 132) == (128, 1, 4, 4)
    assert tk.tail_schedule(296, 56, 132, 4) == (264, 4, 14)
    assert tk.default_tma_config(256, 37888, 3584, 132) == (128, 1, 1, 4)  # saves < 15 %
    assert tk.tail_schedule(100, 56, 132, 3) == (0, 3, 19)  # fewer tiles than SMs: all split
    assert tk.tail_schedule(264, 56, 132, 4) == (264, 1, 56)  # whole waves: no split
    assert tk.tail_schedule(10, 6, 132, 4) == (0, 3, 2)  # 4 splits of 6 steps: 3 of 2
    # the H200 sweep's best splits: 7B down 9, 3B down 8 (128 CTAs, not 10: 160 > 132
    # SMs), 7B qkv 3 at 64 rows; 3B qkv 4, not 6: its partials would pass its weight bytes
    assert tk.default_tma_config(128, 3584, 18944, 132) == (128, 1, 9, 4)
    assert tk.default_tma_config(128, 2048, 11008, 132) == (128, 1, 8, 4)
    assert tk.default_tma_config(64, 4608, 3584, 132) == (64, 1, 3, 4)
    assert tk.default_tma_config(64, 2560, 2048, 132) == (64, 1, 4, 4)


def _compile_ptx(*args) -> str:
    """The kernel's sm_90 PTX (in a fresh interpreter: see `_compiled`)."""
    return tk.compile_sm90(*args)["ptx"]


def _compiled(*args) -> str:
    return compiled_in_child("test_gluon_wgmma_tma", *args)


@pytest.mark.skipif(not tk.gluon_tma_available(), reason="needs Triton with Gluon's TMA")
@pytest.mark.parametrize(
    "block_m,wgs,stages,zp,one_split", [(64, 2, 4, False, True), (128, 1, 6, True, False)]
)
def test_sm90_code(block_m, wgs, stages, zp, one_split):
    """Compiled for sm_90 here: one bulk tensor copy per operand and stage (activations, words,
    scale pairs, zero pairs) issued by the producer warp on the stage's mbarrier; registers
    handed from the producer to the consumers; per step two slabs x 4 register-operand wgmma,
    each followed by a wait for all but one group; the words through the quad transpose and
    the dequantization asm; the split-K finish in one round trip a slab; no local memory."""
    ptx = _compiled(block_m, wgs, stages, zp, one_split)
    # (Triton 3.9 spells the destination shared::cta, 3.6 shared::cluster)
    copies = re.findall(
        r"cp\.async\.bulk\.tensor\.2d\.shared::(?:cta|cluster)\.global\.mbarrier", ptx
    )
    assert len(copies) == (4 if zp else 3)
    assert "cp.async.ca" not in ptx and "cp.async.cg" not in ptx  # no per-thread copies
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx)
    mmas = re.findall(
        r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16 \{[^}]*\}, \{", ptx
    )  # the A operand a register list, not a descriptor
    assert len(mmas) == 8 and {int(v) for v in mmas} == {block_m}
    waits = [int(v) for v in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)]
    assert waits.count(1) == 2 and waits.count(0) == 1
    # per step: 2 slabs x 4 words x (4 lop3, 4 add, 4 mul); the quad transpose's 4 shuffles
    assert ptx.count("mul.rn.bf16x2") == 32 and ptx.count("shfl.sync.bfly.b32") == 8
    adds = re.findall(r"(?:red|atom)\.global\.\S*add\.v4\.f32", ptx)  # 3.9 red, 3.6 atom
    assert (len(adds) > 0) == (not one_split)
    # the last split of a tile issues all of a slab's exchanges before the slab's stores (one
    # round trip a slab): two runs of exchanges, then the counter's reset
    ops = re.findall(r"atom\.global\.\S*exch|st\.global", ptx)
    runs = re.findall(r"X+", "".join("X" if op.startswith("atom") else "S" for op in ops))
    assert len(runs) == (0 if one_split else 3), runs
    for absent in ("ld.local", "st.local"):
        assert absent not in ptx, absent


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(
    not (_hopper() and tk.gluon_tma_available()), reason="needs an sm_90 GPU and Gluon's TMA"
)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("m", [1, 5, 16, 17, 33, 64, 100, 128, 200, 300])
@pytest.mark.parametrize(
    "group,zp,bias", [(128, False, False), (64, True, True), (-1, True, False)]
)
def test_gemm_matches_the_dequantized_matmul_gpu(m, group, zp, bias):
    """N = 400: a partial last CTA (zero-filled words, masked stores); K = 576: an odd count
    of K steps; every tile size, one and two warpgroups, split-K, ring depths."""
    n, k = 400, 512 if group == 128 else 576
    configs = (None, (16, 1, 1, 2), (32, 2, 1, 4), (64, 1, 3, 4), (64, 2, 2, 6), (64, 2, 2, 4),
               (128, 1, 1, 3), (128, 1, 3, 4), (128, 2, 4, 4))  # fmt: skip
    check_configs(tk.wna16_wgmma_tma, configs, m, n, k, group, zp, bias)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("m", [1, 100, 200, 256, 300])
@pytest.mark.parametrize("group,zp,bias", [(128, False, False), (64, True, True)])
def test_one_slab_configs_match_the_dequantized_matmul_gpu(m, group, zp, bias):
    """One 64-row slab a warpgroup (wgmma's N up to 256, two K steps a loop trip): 256-row
    tiles whole and split (the split rounded to even K steps), 128 and 64-row tiles, one
    warpgroup of one slab split 4 and 8 (the sweep's small-layer CTAs); N = 400 (a partial last
    CTA), K = 512."""
    configs = ((256, 2, 1, 4, 1), (256, 2, 3, 4, 1), (128, 2, 2, 4, 1), (64, 1, 1, 4, 1),
               (256, 2, 5, 4, 1), (128, 1, 4, 4, 1), (64, 1, 8, 4, 1))  # fmt: skip
    check_configs(tk.wna16_wgmma_tma, configs, m, 400, 512, group, zp, bias)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("m", [16, 64, 128, 256])
@pytest.mark.parametrize("zp", [False, True])
def test_qwen_shapes_and_graph_replay_gpu(m, zp):
    """Qwen2.5-7B / 3B layer shapes with the default configs (split-K where few CTAs; a wave
    of whole tiles, then split ones, on 3B gate_up at 16 and 64 rows; on an H200 the tuned
    table's at 128 and 256 rows: one slab a warpgroup, 7B down split 4), then the same call
    captured in a CUDA graph and replayed on new inputs."""
    shapes = ((4608, 3584), (3584, 18944), (22016, 2048), (2048, 11008))
    check_shapes_and_graph_replay(tk.wna16_wgmma_tma, m, zp, shapes)


def test_resolve_config_checks_what_the_kernel_runs():
    """Configs with one slab a warpgroup: BLOCK_M up to 256 with two warpgroups (a 64 x 256
    fp32 accumulator is all of one warpgroup's 128 registers), an even K / 64 (two K steps a
    loop trip); the 4-tuple default unchanged. The tuples of the deleted slot-order option
    (x's K order before `slabs`) are refused, not misread."""
    assert tk.resolve_config(None, 128, 37888, 3584, 132, False) == (128, 1, 4, 4, 2)
    assert tk.resolve_config((256, 2, 1, 4, 1), 256, 37888, 3584, 132, False) == (256, 2, 1, 4, 1)
    assert tk.resolve_config((128, 1, 1, 4, 2), 256, 37888, 3584, 132, False) == (128, 1, 1, 4, 2)
    bad = {
        (256, 2, 1, 4): "BLOCK_M in",  # 256 rows only with one slab
        (256, 1, 1, 4, 1): "two warpgroups",
        (128, 1, 1, 4, 3): "1 or 2 slabs",
        (256, 2, 1, 3, 1): "stages",
        (128, 1, 3, 4, 0): "1 or 2 slabs",  # slot order in the old form
        (256, 2, 1, 4, 1, 1): "slabs",  # the old (..., natural, slabs)
    }
    for config, match in bad.items():
        with pytest.raises(ValueError, match=match):
            tk.resolve_config(config, 256, 37888, 3584, 132, False)
    with pytest.raises(ValueError, match="even K"):
        tk.resolve_config((128, 2, 1, 4, 1), 64, 4096, 576, 132, False)
    assert tk.smem_bytes(256, 2, 4, True, 1) <= tk.SMEM_BYTES  # zero points fit too


@pytest.mark.skipif(not tk.gluon_tma_available(), reason="needs Triton with Gluon's TMA")
@pytest.mark.parametrize("zp,one_split", [(False, True), (True, False)])
def test_sm90_code_one_slab(zp, one_split):
    """One slab a warpgroup at 256 rows, two warpgroups: a loop trip is two K steps of four
    m64n256k16 register-operand wgmma each, a wait for all but one group after each step, the
    words of each step through the quad transpose; no local memory (the split finish goes 128
    rows at a time)."""
    ptx = _compiled(256, 2, 4, zp, one_split, 1)
    mmas = re.findall(
        r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16 \{[^}]*\}, \{", ptx
    )
    assert len(mmas) == 8 and {int(v) for v in mmas} == {256}
    waits = [int(v) for v in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)]
    assert waits.count(1) == 2 and waits.count(0) == 1
    assert ptx.count("shfl.sync.bfly.b32") == 8  # 2 steps x the transpose's 4 shuffles
    for absent in ("ld.local", "st.local"):
        assert absent not in ptx, absent


def test_tuned_configs_hold_their_bands_on_their_gpu_only():
    """The shipped H200 table: a swept M band takes its measured config, a band the heuristic
    won takes None (the heuristic), M outside every band and other GPUs take None; each
    config fits with and without zero points."""
    import json

    data = json.loads(tk._TUNED.read_text())
    gpu, entries = data["gpu"], data["entries"]
    assert any(e["config"] for e in entries) and any(e["config"] is None for e in entries)
    for e in entries:
        for m in {e["min_m"], e["m"]}:
            for zp in (False, True):
                got = tk.tuned_tma_config(gpu, m, e["n"], e["k"], e["group_size"], 132, zp)
                want = tuple(e["config"]) if e["config"] else None
                assert got == want, (e, m, zp)
                assert tk.tuned_tma_config("NVIDIA H100", m, e["n"], e["k"], 128, 132, zp) is None
        assert tk.tuned_tma_config(gpu, e["m"], e["n"], e["k"], 64, 132, False) is None
    top = max(e["m"] for e in entries)
    assert all(tk.tuned_tma_config(gpu, top + 1, e["n"], e["k"], 128, 132, False) is None
               for e in entries)  # fmt: skip
    # bands of one shape tile M without gaps or overlaps
    shapes = {(e["n"], e["k"]) for e in entries}
    for n, k in shapes:
        rows = sorted((e["min_m"], e["m"]) for e in entries if (e["n"], e["k"]) == (n, k))
        assert all(lo == prev_hi + 1 for (_, prev_hi), (lo, _) in zip(rows, rows[1:]))


def test_a_tuned_config_that_does_not_fit_falls_back(monkeypatch, tmp_path):
    """A table entry the kernel cannot run (BLOCK_M 256 on one warpgroup) is not used."""
    bad = {"gpu": "G", "entries": [
        {"n": 2048, "k": 2048, "min_m": 1, "m": 64, "group_size": 128, "config": [256, 1, 1, 4]},
        {"n": 2048, "k": 2048, "min_m": 65, "m": 128, "group_size": 128, "config": [64, 1, 2, 4]},
    ]}  # fmt: skip
    path = tmp_path / "t.json"
    path.write_text(__import__("json").dumps(bad))
    monkeypatch.setattr(tk, "_TUNED", path)
    tk._tuned_table.cache_clear()
    tk.tuned_tma_config.cache_clear()
    try:
        assert tk.tuned_tma_config("G", 64, 2048, 2048, 128, 132, False) is None
        assert tk.tuned_tma_config("G", 100, 2048, 2048, 128, 132, True) == (64, 1, 2, 4)
    finally:
        tk._tuned_table.cache_clear()
        tk.tuned_tma_config.cache_clear()
