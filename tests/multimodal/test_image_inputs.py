"""Image loading, preprocessing and prompt expansion, without a model.

Preprocessing must equal transformers' `Qwen2VLImageProcessorPil` bit for bit (resize bounds,
patch order), M-RoPE positions its `get_rope_index`; every bad input must fail with a
ValueError/TypeError that names the problem.
"""

from __future__ import annotations

import base64
import http.server
import io
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from pagoda.config import MultiModalConfig
from pagoda.multimodal.image_loader import ImageLoader
from pagoda.multimodal.image_processor import (
    ImageProcessorConfig,
    patchify_reference,
    preprocess_image,
    smart_resize,
)
from pagoda.multimodal.inputs import mrope_positions
from pagoda.multimodal.processor import MultiModalProcessor
from pagoda.worker.encoder_runner import patchify

IMAGE, START, END, VIDEO = 151655, 151652, 151653, 151656


def _image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    return img if mode == "RGB" else img.convert(mode)


def _png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(img: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(_png_bytes(img)).decode()


def _processor(limit: int = 2, max_model_len: int = 4096, **mm) -> MultiModalProcessor:
    hf_config = SimpleNamespace(
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
        vision_config=SimpleNamespace(patch_size=14, temporal_patch_size=2, spatial_merge_size=2),
    )
    mm_config = MultiModalConfig(limit_per_prompt=limit, **mm)
    return MultiModalProcessor.from_model(None, hf_config, None, mm_config, max_model_len)


@pytest.mark.parametrize(
    ("size", "kwargs"),
    [
        ((56, 84), {}),
        ((112, 56), {}),
        ((100, 70), {}),  # sides rounded to multiples of 28
        ((30, 20), {}),  # below min_pixels: scaled up
        ((640, 480), {"max_pixels": 28 * 28 * 64}),  # above max_pixels: scaled down
        ((37, 91), {"min_pixels": 28 * 28 * 16, "max_pixels": 28 * 28 * 20}),
    ],
)
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L"])
def test_preprocessing_matches_transformers(size, kwargs, mode):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    img = _image(*size, mode=mode)
    config = ImageProcessorConfig(**kwargs)
    # Both bounds explicit: HF's processor writes them into a class-level dict that later
    # instances would otherwise inherit.
    bounds = dict(min_pixels=config.min_pixels, max_pixels=config.max_pixels)
    ref = Qwen2VLImageProcessorPil(**bounds)(images=[img])
    ours = preprocess_image(img, config)
    assert list(ours.grid_thw) == ref["image_grid_thw"][0].tolist()
    assert ours.num_tokens == np.prod(ours.grid_thw) // 4
    expected = ref["pixel_values"]
    assert np.array_equal(patchify_reference(ours.pixels, config), expected)
    on_device = patchify(torch.from_numpy(ours.pixels), config, torch.float32)
    assert torch.equal(on_device, torch.from_numpy(expected))


def test_smart_resize_bounds_and_aspect_ratio():
    h, w = smart_resize(720, 1280, 28, 56 * 56, 28 * 28 * 1280)
    assert h % 28 == 0 and w % 28 == 0 and h * w <= 28 * 28 * 1280
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2010, 28, 56 * 56, 28 * 28 * 1280)


def test_content_hash_follows_pixels():
    config = ImageProcessorConfig()
    a, b = _image(56, 84, seed=1), _image(56, 84, seed=2)
    assert preprocess_image(a, config).mm_hash == preprocess_image(a.copy(), config).mm_hash
    assert preprocess_image(a, config).mm_hash != preprocess_image(b, config).mm_hash
    # the same picture resized differently is a different encoder input
    small = ImageProcessorConfig(max_pixels=28 * 28 * 4)
    assert preprocess_image(a, config).mm_hash != preprocess_image(a, small).mm_hash


def test_config_from_model_files(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(
        '{"min_pixels": 3136, "max_pixels": 12845056, "image_mean": [0.5, 0.5, 0.5]}'
    )
    vision = SimpleNamespace(patch_size=14, temporal_patch_size=2, spatial_merge_size=2)
    cfg = ImageProcessorConfig.from_model(str(tmp_path), vision, {"max_pixels": 100352})
    assert (cfg.min_pixels, cfg.max_pixels, cfg.image_mean) == (3136, 100352, (0.5,) * 3)
    (tmp_path / "preprocessor_config.json").write_text('{"size": {"longest_edge": 200704}}')
    assert ImageProcessorConfig.from_model(str(tmp_path), vision, {}).max_pixels == 200704
    assert ImageProcessorConfig.from_model(None, vision, {}).max_pixels == 28 * 28 * 1280


def test_mrope_positions_match_transformers():
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    grids = [(1, 6, 4), (1, 4, 10)]
    ids = [1, 2, START] + [IMAGE] * 6 + [END, 3, START] + [IMAGE] * 10 + [END, 4, 5]
    placeholders = [(3, 6), (12, 10)]
    ours, delta = mrope_positions(len(ids), placeholders, grids, 2)
    config = Qwen2_5_VLConfig(vision_config={"spatial_merge_size": 2})
    fake = SimpleNamespace(config=config, get_vision_position_ids=None)
    fake.get_vision_position_ids = lambda *a, **k: Qwen2_5_VLModel.get_vision_position_ids(
        fake, *a, **k
    )
    input_ids = torch.tensor([ids])
    ref, ref_delta = Qwen2_5_VLModel.get_rope_index(
        fake, input_ids, (input_ids == IMAGE).int(), torch.tensor(grids)
    )
    assert np.array_equal(ours, ref[:, 0].numpy())
    assert delta == ref_delta.item()


# ---------------------------------------------------------------------- loading


def test_loader_sources(tmp_path):
    loader = ImageLoader(MultiModalConfig())
    img = _image(40, 30)
    assert loader.load(img) is img
    assert loader.load(_data_url(img)).size == (40, 30)
    assert loader.load(_png_bytes(img)).size == (40, 30)
    path = tmp_path / "a.png"
    img.save(path)
    assert loader.load(str(path), allow_local_paths=True).size == (40, 30)
    assert loader.load(path.as_uri(), allow_local_paths=True).size == (40, 30)
    with pytest.raises(ValueError, match="offline API"):
        loader.load(str(path))  # what a server does
    with pytest.raises(ValueError, match="does not exist"):
        loader.load(str(tmp_path / "missing.png"), allow_local_paths=True)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("data:image/png;base64,!!!notbase64", "invalid base64"),
        (
            "data:image/png;base64," + base64.b64encode(b"not an image").decode(),
            r"^data URL: not an image \(12 bytes starting with b'not an i'\); send a PNG, JPEG",
        ),
        ("", "^image URL is empty: send the image as a data: URL .* or a local path$"),
        ("  ", "^image URL is empty"),
        ("data:image/png,rawdata", "only base64"),
        (b"\x89PNG\r\n\x1a\n truncated", "not a valid"),
        ("https://example.com/cat.png", "remote images is disabled"),
        ("ftp://example.com/cat.png", "unsupported URL scheme"),
    ],
)
def test_loader_rejects_bad_images(source, message):
    with pytest.raises(ValueError, match=message):
        ImageLoader(MultiModalConfig()).load(source, allow_local_paths=True)


def test_loader_messages_name_no_python_objects():
    loader = ImageLoader(MultiModalConfig())
    for source in (b"\x00" * 64, b"<html></html>", "data:image/png;base64,AAAA"):
        with pytest.raises(ValueError, match="not an image") as e:
            loader.load(source)
        assert "object at 0x" not in str(e.value) and "BytesIO" not in str(e.value)
    with pytest.raises(ValueError, match=r"^image URL is empty: send the image as a data: URL"):
        loader.load("")  # the server's case: no local paths, so none are suggested
    with pytest.raises(ValueError) as e:
        loader.load("")
    assert "local" not in str(e.value)


def test_loader_rejects_wrong_type():
    with pytest.raises(TypeError, match="PIL image"):
        ImageLoader(MultiModalConfig()).load(123)


def test_loader_size_limits():
    img = _image(64, 64)
    with pytest.raises(ValueError, match="max_image_bytes"):
        ImageLoader(MultiModalConfig(max_image_bytes=100)).load(_data_url(img))
    with pytest.raises(ValueError, match="pixels"):
        ImageLoader(MultiModalConfig(max_image_pixels=1000)).load(_data_url(img))


@pytest.fixture
def http_server():
    """A local HTTP server: /ok.png (an image), /big.png (over the limit), /slow.png."""
    body = _png_bytes(_image(32, 32))
    stop = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path == "/slow.png":
                stop.wait(2.0)
            data = body * 50 if self.path == "/big.png" else body
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    stop.set()
    server.shutdown()
    server.server_close()


def test_loader_remote_images(http_server):
    config = MultiModalConfig(
        allow_remote_images=True, image_fetch_timeout_s=0.5, max_image_bytes=10_000
    )
    loader = ImageLoader(config)
    assert loader.load(f"{http_server}/ok.png").size == (32, 32)
    with pytest.raises(ValueError, match="max_image_bytes"):
        loader.load(f"{http_server}/big.png")
    with pytest.raises(ValueError, match="could not fetch"):
        loader.load(f"{http_server}/slow.png")


# ---------------------------------------------------------------------- prompts


def test_process_expands_placeholders_and_hashes():
    proc = _processor()
    a, b = _image(56, 84), _image(112, 56, seed=1)
    ids = [1, START, IMAGE, END, 2, START, IMAGE, END, 3]
    out_ids, mm = proc.process(ids, [a, b])
    assert mm.placeholders == [(2, 6), (11, 8)]
    assert out_ids == [1, START] + [IMAGE] * 6 + [END, 2, START] + [IMAGE] * 8 + [END, 3]
    assert [h for _, _, h in mm.hash_ranges()] == [img.mm_hash for img in mm.items]
    assert mm.mrope_positions.shape == (3, len(out_ids))
    # an already expanded prompt is accepted as is
    again, mm2 = proc.process(out_ids, [a, b])
    assert again == out_ids and mm2.placeholders == mm.placeholders
    # no image: the prompt passes through, stray placeholders do not
    assert proc.process([1, 2, 3], []) == ([1, 2, 3], None)


@pytest.mark.parametrize(
    ("ids", "n_images", "error", "message"),
    [
        ([1, START, IMAGE, END], 0, ValueError, "1 image placeholder"),
        ([1, 2], 1, ValueError, "0 image placeholder"),
        ([1, START, IMAGE, END] * 3, 3, ValueError, "limit_mm_per_prompt"),
        ([1, VIDEO], 0, ValueError, "1 video placeholder"),
        ([1, IMAGE, IMAGE, IMAGE], 1, ValueError, "3 tokens long"),
    ],
)
def test_process_rejects_bad_prompts(ids, n_images, error, message):
    with pytest.raises(error, match=message):
        _processor(limit=2).process(ids, [_image(56, 84)] * n_images)


def test_process_names_the_bad_image_and_too_long_prompts():
    proc = _processor()
    ids = [START, IMAGE, END, START, IMAGE, END]
    with pytest.raises(ValueError, match="image 1: .*invalid base64"):
        proc.process(ids, [_image(56, 84), "data:image/png;base64,@@"])
    short = _processor(max_model_len=20)
    with pytest.raises(ValueError, match="max_pixels"):
        short.process([START, IMAGE, END], [_image(280, 280)])


def test_multi_modal_data_shapes():
    img = _image(28, 28)
    assert MultiModalProcessor.media_of({"image": img}) == ([img], [])
    assert MultiModalProcessor.media_of({"image": [img, img]}) == ([img, img], [])
    with pytest.raises(ValueError, match="unsupported modality audio"):
        MultiModalProcessor.media_of({"audio": img})
    with pytest.raises(TypeError, match="multi_modal_data"):
        MultiModalProcessor.media_of([img])


def test_parse_chat_message_shapes():
    proc = _processor()
    img = _image(28, 28)
    messages = [
        {"role": "system", "content": "Answer only used english"},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:x"}},
                {"type": "image", "image": img},
                {"type": "image", "url": "https://x/bee.jpg"},
                {"type": "image", "path": "hard.jpg"},
                {"type": "input_image", "image_url": "data:y"},
                {"type": "image_pil", "image_pil": img},
                {"image": "qwen-vl-utils.png"},  # no "type"
                {"type": "text", "text": "Describe"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
    ]
    normalized, media = proc.parse_chat(messages)
    assert all(kind == "image" for kind, _ in media)
    sources = [source for _, source in media]
    assert sources == ["data:x", img, "https://x/bee.jpg", "hard.jpg", "data:y", img,
                       "qwen-vl-utils.png"]  # fmt: skip
    assert normalized[0]["content"] == "Answer only used english"
    assert normalized[1]["content"][:2] == [{"type": "image"}, {"type": "image"}]
    assert normalized[1]["content"][-1] == {"type": "text", "text": "Describe"}
    assert normalized[2]["content"] == "ok"  # text-only lists become strings
    inline, _ = proc.parse_chat(messages, inline_placeholders=True)
    assert inline[1]["content"].count(proc.placeholder) == 7
    for bad, message in [
        ({"role": "user", "content": [{"type": "audio"}]}, "unsupported type 'audio'"),
        ({"role": "user", "content": [{"type": "image"}]}, "without an image"),
        ({"role": "robot", "content": "hi"}, "role 'robot'"),
    ]:
        with pytest.raises(ValueError, match=message):
            proc.parse_chat([bad])


def test_multimodal_config_validation():
    assert MultiModalConfig.from_user({"image": 3}, None).limit_per_prompt == 3
    with pytest.raises(ValueError, match="unsupported modality audio"):
        MultiModalConfig.from_user({"audio": 1}, None)
    with pytest.raises(ValueError, match="unknown key"):
        MultiModalConfig.from_user(None, {"nframes": 2})
    with pytest.raises(ValueError, match="min_pixels"):
        MultiModalConfig.from_user(None, {"min_pixels": 10_000, "max_pixels": 100})
    with pytest.raises(ValueError, match=">= 0"):
        MultiModalConfig.from_user({"image": -1}, None)


def test_loader_applies_exif_orientation():
    img = _image(40, 30)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to view
    buf = io.BytesIO()
    img.save(buf, format="JPEG", exif=exif)
    assert ImageLoader(MultiModalConfig()).load(buf.getvalue()).size == (30, 40)
