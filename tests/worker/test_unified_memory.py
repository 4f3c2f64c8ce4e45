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


def test_discrete_gpu_budget_is_utilization_of_device_total(runner, monkeypatch):
    monkeypatch.setattr(mr, "is_integrated_gpu", lambda device: False)
    peak, non_torch, total, budget = runner._profile(8, 256)
    assert total == 64 * GiB and budget == int(0.9 * 64 * GiB)
    assert non_torch == (64 - 12 - 9) * GiB  # other processes / CUDA context on the card


def runner_block_bytes(runner) -> int:
    mc = runner.model_config
    return 2 * mc.num_layers * runner.block_size * mc.num_kv_heads * mc.head_dim * 4
