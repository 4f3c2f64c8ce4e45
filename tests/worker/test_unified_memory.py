"""KV cache sizing on an integrated GPU (Jetson), with the CUDA calls faked on CPU.

On unified memory `cudaMemGetInfo` reports the whole system RAM as "total" and a "free" that
leaves out reclaimable page cache, so neither can size the KV cache. The runner must budget
from the system's available memory plus what it already holds (the weights). See
docs/jetson.md.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.engine.args import EngineArgs
from pagoda.worker import model_runner as mr
from tests.helpers import save_tiny_model

GiB = 1 << 30


@pytest.fixture
def runner(tmp_path, monkeypatch):
    path = save_tiny_model("llama", tmp_path / "tiny")
    _, mc, cc, _, rc = EngineArgs(
        model=str(path), device="cpu", max_model_len=256, gpu_memory_utilization=0.9
    ).create_configs()
    r = mr.ModelRunner(mc, cc, rc)
    r.load_model()
    # Pretend to be a 64 GiB Jetson: device "cuda", integrated, with the figures below.
    r.device = torch.device("cuda")
    r.weights_bytes = 7 * GiB
    fake = {
        "synchronize": lambda *a: None,
        "empty_cache": lambda: None,
        "reset_peak_memory_stats": lambda *a: None,
        "memory_allocated": lambda *a: 7 * GiB,  # the weights
        "max_memory_allocated": lambda *a: 9 * GiB,  # + 2 GiB of profiling activations
        "memory_reserved": lambda *a: 9 * GiB,
        # Tegra: total = system RAM; free excludes the page cache the kernel would reclaim
        "mem_get_info": lambda *a: (12 * GiB, 64 * GiB),
    }
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    monkeypatch.setattr(r, "_profile_run", lambda *a: None)
    monkeypatch.setattr(r, "_allocate_kv_cache", lambda n: None)
    return r


def test_integrated_gpu_budget_is_available_system_memory_plus_weights(runner, monkeypatch):
    monkeypatch.setattr(mr, "is_integrated_gpu", lambda device: True)
    monkeypatch.setattr(mr, "system_available_bytes", lambda: 40 * GiB)  # MemAvailable
    peak, non_torch, total, budget = runner._profile(8, 256)
    assert peak == 2 * GiB
    # "used" from cudaMemGetInfo is the OS + page cache + other processes: not ours to subtract
    assert non_torch == 0
    assert budget == int(0.9 * (40 + 7) * GiB)
    report = runner.initialize_kv_cache(8, 256)
    assert report.integrated_gpu
    kv_expected = 0.9 * 47 * GiB - 7 * GiB - 2 * GiB  # 33.3 GiB, within one block
    assert abs(report.kv_cache_bytes - kv_expected) < 2 * runner_block_bytes(runner)
    # what the engine adds (KV + activations) fits in what the system still had
    assert report.kv_cache_bytes + peak <= 40 * GiB


def test_integrated_gpu_kv_tracks_weight_savings(runner, monkeypatch):
    """Smaller weights leave that much more MemAvailable: the KV cache grows by the same."""
    monkeypatch.setattr(mr, "is_integrated_gpu", lambda device: True)
    sizes = {}
    for weights in (7, 3):
        # loading fewer weights leaves more available memory (47 GiB before loading)
        monkeypatch.setattr(mr, "system_available_bytes", lambda w=weights: (47 - w) * GiB)
        runner.weights_bytes = weights * GiB
        sizes[weights] = runner.initialize_kv_cache(8, 256).kv_cache_bytes
    gain = (sizes[3] - sizes[7]) / GiB
    assert gain == pytest.approx(4.0, abs=0.01)  # util x (A + W) - W: independent of W's share


def _discrete(runner, monkeypatch, in_use_at_start: float, fraction: float = 1.0):
    """A 64 GiB card: `in_use_at_start` GiB held before the engine loaded (other processes,
    the CUDA context, an earlier engine); after profiling torch holds 9 GiB (7 weights + 2
    activations) and cuBLAS added 0.5 GiB outside torch."""
    monkeypatch.setattr(mr, "is_integrated_gpu", lambda device: False)

    def get_fraction(device):  # torch's rule: an index, not torch.device("cuda")
        if not isinstance(device, int):
            raise ValueError(f"Expected a torch.device with a specified index, got {device}")
        return fraction

    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", get_fraction)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    runner.start_snapshot = mr.DeviceSnapshot(
        free_bytes=int((64 - in_use_at_start) * GiB), total_bytes=64 * GiB, reserved_bytes=0
    )
    used_now = in_use_at_start + 9 + 0.5
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda *a: (int((64 - used_now) * GiB), 64 * GiB)
    )


def test_discrete_gpu_budget_subtracts_what_the_device_held_at_start(runner, monkeypatch):
    _discrete(runner, monkeypatch, in_use_at_start=6)
    peak, non_torch, total, budget = runner._profile(8, 256)
    assert total == 64 * GiB and peak == 2 * GiB
    assert non_torch == GiB // 2  # only what grew since the start; the context was in "used"
    assert budget == int(0.9 * 64 * GiB) - 6 * GiB
    report = runner.initialize_kv_cache(8, 256)
    kv_expected = (0.9 * 64 - 6 - 7 - 2 - 0.5) * GiB
    assert abs(report.kv_cache_bytes - kv_expected) < 2 * runner_block_bytes(runner)
    assert report.in_use_at_start_bytes == 6 * GiB
    assert "in use at start" in str(report)
    # the device never holds more than utilization x total once this engine is up
    assert 6 * GiB + 7 * GiB + 2 * GiB + GiB // 2 + report.kv_cache_bytes <= 0.9 * 64 * GiB + 1


def test_discrete_gpu_kv_shrinks_by_what_an_earlier_engine_still_holds(runner, monkeypatch):
    _discrete(runner, monkeypatch, in_use_at_start=1)
    alone = runner.initialize_kv_cache(8, 256).kv_cache_bytes
    _discrete(runner, monkeypatch, in_use_at_start=21)  # 20 GiB not released
    second = runner.initialize_kv_cache(8, 256).kv_cache_bytes
    assert (alone - second) / GiB == pytest.approx(20, abs=0.01)


def test_device_already_full_is_a_clear_error(runner, monkeypatch):
    _discrete(runner, monkeypatch, in_use_at_start=58)
    with pytest.raises(ValueError, match=r"58.00 GiB were already in use.*LLM.shutdown\(\)"):
        runner._profile(8, 256)


def test_per_process_memory_cap_bounds_the_engine(runner, monkeypatch):
    """torch.cuda.set_per_process_memory_fraction(12/64): the engine's torch memory (weights,
    activations, KV cache) fits in 12 GiB even with a larger gpu_memory_utilization."""
    _discrete(runner, monkeypatch, in_use_at_start=1, fraction=12 / 64)
    report = runner.initialize_kv_cache(8, 256)
    torch_total = 7 * GiB + 2 * GiB + report.kv_cache_bytes
    assert torch_total <= 12 * GiB
    assert 12 * GiB - torch_total < 2 * runner_block_bytes(runner)


def runner_block_bytes(runner) -> int:
    mc = runner.model_config
    return 2 * mc.num_layers * runner.block_size * mc.num_kv_heads * mc.head_dim * 4
