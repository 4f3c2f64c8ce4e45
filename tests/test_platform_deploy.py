"""The emulated compute capability (`pagoda bench edge --emulate-capability`) and the Triton
cache count that tells a cold start from a warm one."""

from __future__ import annotations

import pytest
import torch

from pagoda import envs, platform
from pagoda.engine import llm_engine


@pytest.fixture
def fake_h200(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    platform._capability.cache_clear()
    yield
    platform._capability.cache_clear()


def test_emulated_capability_is_what_the_registries_see(fake_h200, monkeypatch):
    assert platform.capability(0) == (9, 0)
    platform._capability.cache_clear()
    monkeypatch.setenv("PAGODA_EMULATE_CAPABILITY", "8.9")
    assert platform.capability(0) == (8, 9)


def test_bad_emulated_capability_is_a_clear_error(fake_h200, monkeypatch):
    monkeypatch.setenv("PAGODA_EMULATE_CAPABILITY", "sm89")
    with pytest.raises(ValueError, match=r"PAGODA_EMULATE_CAPABILITY='sm89': use MAJOR.MINOR"):
        envs.emulated_capability()
    monkeypatch.setenv("PAGODA_EMULATE_CAPABILITY", "10.0")
    with pytest.raises(ValueError, match=r"10.0 is above the device's 9.0"):
        platform.capability(0)


def test_triton_cache_entries_count_compiled_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(llm_engine, "triton_available", lambda: True)
    assert llm_engine.triton_cache_entries() == 0
    for name in ("abc", "def"):
        (tmp_path / name).mkdir()
    (tmp_path / "lock").write_text("")  # files are not kernels
    assert llm_engine.triton_cache_entries() == 2
    monkeypatch.setattr(llm_engine, "triton_available", lambda: False)
    assert llm_engine.triton_cache_entries() is None


def test_triton_cache_kernels_name_each_entry(tmp_path, monkeypatch):
    """Entries as Triton writes them (`<name>.json` beside `__grp__<name>.json`): two
    snapshots tell which kernels compiled in between, by name."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(llm_engine, "triton_available", lambda: True)
    assert llm_engine.triton_cache_kernels() == {}
    (tmp_path / "h1").mkdir()
    for f in ("_rms_norm_kernel.json", "__grp___rms_norm_kernel.json", "_rms_norm_kernel.cubin"):
        (tmp_path / "h1" / f).write_text("{}")
    before = llm_engine.triton_cache_kernels()
    (tmp_path / "h2").mkdir()
    (tmp_path / "h2" / "_paged_attention_kernel.json").write_text("{}")
    after = llm_engine.triton_cache_kernels()
    assert before == {"h1": "_rms_norm_kernel"}
    assert [n for e, n in after.items() if e not in before] == ["_paged_attention_kernel"]
    monkeypatch.setattr(llm_engine, "triton_available", lambda: False)
    assert llm_engine.triton_cache_kernels() is None


def test_memory_report_says_cold_or_warm():
    from pagoda.worker.memory import MemoryReport

    base = dict(
        device="cuda:0",
        dtype="bfloat16",
        weights_bytes=1,
        peak_activation_bytes=1,
        non_torch_bytes=0,
        kv_cache_bytes=1,
        num_blocks=1,
        block_size=16,
        max_model_len=16,
        total_memory_bytes=1,
        memory_budget_bytes=1,
        load_time_s=1.0,
        startup_time_s=12.5,
    )
    assert "12.50 s, cold: 7 Triton kernels compiled" in str(
        MemoryReport(**base, triton_kernels_compiled=7)
    )
    assert "12.50 s, warm Triton cache" in str(MemoryReport(**base, triton_kernels_compiled=0))
    assert "start-up           12.50 s\n" in str(MemoryReport(**base)) + "\n"
