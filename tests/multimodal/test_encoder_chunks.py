"""Vision towers in chunks of whole frames: `split_grids` keeps order and frames, bounds each
chunk; and the Qwen2-VL, Qwen2.5-VL and Qwen3-VL towers give the same embeddings chunked as in
one forward (they attend within a frame)."""

from __future__ import annotations

import pytest
import torch

from pagoda.config import ModelConfig
from pagoda.models.loader import load_model
from pagoda.multimodal.encoder_chunks import split_grids


def _frames(chunks):
    """Every frame as (item, frame index), in order: the chunks' content."""
    return [(h, w) for chunk in chunks for t, h, w in chunk for _ in range(t)]


@pytest.mark.parametrize("max_patches", [1, 16, 40, 64, 1000])
def test_split_grids_bounds_and_order(max_patches):
    grids = [(1, 4, 4), (5, 4, 6), (1, 8, 8), (3, 2, 2)]
    chunks = split_grids(grids, max_patches)
    # the same frames in the same order
    assert _frames(chunks) == [(h, w) for t, h, w in grids for _ in range(t)]
    for chunk in chunks:
        patches = sum(t * h * w for t, h, w in chunk)
        # within the bound, or a single frame larger than it
        assert patches <= max_patches or (len(chunk) == 1 and chunk[0][0] == 1)
    # chunks are full: the next chunk's first frame would not have fit
    for a, b in zip(chunks, chunks[1:], strict=False):
        used = sum(t * h * w for t, h, w in a)
        assert used + b[0][1] * b[0][2] > max_patches
    assert split_grids(grids, 10**6) == [grids]


def _tower_cases(tmp_path):
    from tests.models.test_qwen2_5_vl import save_tiny_vl
    from tests.models.test_qwen3_vl import save_tiny_qwen3_vl

    for name in ("qwen2_5_vl", "qwen2_vl", "qwen3_vl"):
        path = tmp_path / name
        if name == "qwen3_vl":
            hf = save_tiny_qwen3_vl(path)
        else:
            hf = save_tiny_vl(path, name)
        config = ModelConfig(
            model=str(path), hf_config=hf.config, dtype="float32", max_model_len=1024
        )
        yield name, load_model(config, "cpu")


def test_towers_chunked_equal_one_forward(tmp_path, monkeypatch):
    import pagoda.models.qwen2_5_vl as qwen_vl

    grids = [(1, 8, 8), (4, 4, 8), (1, 4, 4)]  # an image, a 4-slice video, an image
    patches = sum(t * h * w for t, h, w in grids)
    real = qwen_vl.split_grids
    for name, model in _tower_cases(tmp_path):
        dim = model.model.visual.patch_embed.proj.weight[0].numel()
        pixels = torch.randn(patches, dim, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            monkeypatch.setattr(qwen_vl, "split_grids", lambda g: real(g, 10**6))
            whole = model.embed_images(pixels, grids)
            # 40 patches: the image alone, the video cut into 1 + 1 + 1 + 1 slices
            monkeypatch.setattr(qwen_vl, "split_grids", lambda g: real(g, 40))
            assert len(real(grids, 40)) >= 4
            chunked = model.embed_images(pixels, grids)
        assert chunked.shape == whole.shape, name
        # the same rows through the same layers; only matmul batch sizes differ (float32)
        torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5, msg=name)
