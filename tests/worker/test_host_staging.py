"""The pinned staging buffer: values reach the device intact, a region is never overwritten while
a copy from it may still be pending, and arrays past a region's room fall back to their own
pinned copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.worker.host_staging import PinnedStaging

pytestmark = pytest.mark.gpu


@pytest.fixture
def device():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


def test_values_and_layout(device):
    staging = PinnedStaging(device, slot_bytes=4096, slots=2)
    rng = np.random.default_rng(0)
    for _ in range(7):
        staging.next_step()
        arrays = [
            rng.integers(-5, 1000, size=13).astype(np.int64),
            rng.standard_normal((3, 5)).astype(np.float32),
            rng.integers(0, 9, size=(2, 7)).astype(np.int32),
            np.arange(0, dtype=np.int64),
            rng.integers(0, 9, size=11).astype(np.int32)[::2],  # not contiguous
        ]
        out = [staging.to_device(a) for a in arrays]
        for a, t in zip(arrays, out, strict=True):
            assert t.device.type == "cuda" and t.shape == a.shape
            np.testing.assert_array_equal(t.cpu().numpy(), a)
    assert staging.num_fallbacks == 0


def test_region_not_reused_while_copy_pending(device):
    """Two regions: the third step reuses the first one's bytes. Its copy is queued behind a
    long device sleep; the host must wait rather than overwrite the bytes it reads."""
    staging = PinnedStaging(device, slot_bytes=1024, slots=2)
    first = np.arange(100, 164, dtype=np.int64)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time before the copy runs
    early = staging.to_device(first)
    staging.next_step()
    staging.to_device(np.zeros(64, dtype=np.int64))
    staging.next_step()  # back to the first region: waits for its copies
    staging.to_device(np.full(64, -1, dtype=np.int64))
    torch.cuda.synchronize()
    np.testing.assert_array_equal(early.cpu().numpy(), first)


def test_overflow_falls_back(device):
    staging = PinnedStaging(device, slot_bytes=256, slots=2)
    big = np.arange(100, dtype=np.int64)  # 800 bytes > 256
    small = np.arange(8, dtype=np.int64)
    np.testing.assert_array_equal(staging.to_device(small).cpu().numpy(), small)
    np.testing.assert_array_equal(staging.to_device(big).cpu().numpy(), big)
    assert staging.num_fallbacks == 1
