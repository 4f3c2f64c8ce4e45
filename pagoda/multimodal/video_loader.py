"""Turn the video references users send into sampled RGB frames, within limits.

Accepted: frames already decoded (a uint8 array [T, H, W, 3], or a list of PIL images / [H, W, 3]
arrays), encoded bytes, `data:` URLs (base64), local paths and `file://` URLs (only when the
caller allows it, as for images), and `http(s)://` URLs only when remote fetching is enabled.
Encoded videos are decoded with PyAV (`pip install av`), an optional extra: frames given as
arrays never need it. Only the frames that sampling keeps are converted to RGB.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagoda.config import MultiModalConfig

# (total frames, frames per second) -> (indices to keep, the rate they represent)
FrameSampler = Callable[[int, float], tuple[np.ndarray, float]]


@dataclass(frozen=True)
class LoadedVideo:
    """Frames [T, H, W, 3] uint8 and the rate they represent (None: frames given as is)."""

    frames: np.ndarray
    sample_fps: float | None
    # seconds of each kept frame into the clip (decoded videos; None: frames given as is)
    frame_times: np.ndarray | None = None


class VideoLoader:
    def __init__(self, config: MultiModalConfig) -> None:
        self.allow_remote = config.allow_remote_images
        self.timeout_s = config.image_fetch_timeout_s
        self.max_bytes = config.max_video_bytes
        self.max_pixels = config.max_image_pixels  # per frame

    def load(
        self, source: Any, sampler: FrameSampler, allow_local_paths: bool = False
    ) -> LoadedVideo:
        """Frames of any accepted source; encoded videos are sampled by `sampler`."""
        if isinstance(source, (bytes, bytearray, memoryview)):
            return self._decode(bytes(source), "video bytes", sampler)
        if isinstance(source, os.PathLike):
            source = os.fspath(source)
        if isinstance(source, str):
            return self._load_reference(source, sampler, allow_local_paths)
        return LoadedVideo(self._frames(source), None)

    # ------------------------------------------------------------------ decoded frames

    def _frames(self, source: Any) -> np.ndarray:
        from PIL import Image

        if isinstance(source, (list, tuple)):
            if not source:
                raise ValueError("the video is an empty list of frames")
            frames = []
            for i, frame in enumerate(source):
                if isinstance(frame, Image.Image):
                    frame = np.asarray(frame.convert("RGB"))
                else:
                    frame = _as_uint8(frame, f"frame {i}", ndim=3)
                if frames and frame.shape != frames[0].shape:
                    raise ValueError(
                        f"video frame {i} is {frame.shape[1]}x{frame.shape[0]}, frame 0 is "
                        f"{frames[0].shape[1]}x{frames[0].shape[0]}: all frames need one size"
                    )
                frames.append(frame)
            array = np.stack(frames)
        elif hasattr(source, "__array__"):
            array = _as_uint8(source, "the video", ndim=4)
        else:
            raise TypeError(
                "a video must be a uint8 array [T, H, W, 3], a list of frames (PIL images or "
                "[H, W, 3] arrays), bytes, a data: URL, an http(s) URL or a local path; got "
                f"{type(source).__name__}"
            )
        if array.shape[0] == 0:
            raise ValueError("the video has no frames")
        self._check_pixels(array.shape[2], array.shape[1])
        return array

    # ------------------------------------------------------------------ references

    def _load_reference(
        self, source: str, sampler: FrameSampler, allow_local_paths: bool
    ) -> LoadedVideo:
        if not source.strip():
            raise ValueError("video URL is empty: send the video as a data: URL")
        if source.startswith("data:"):
            return self._decode(self._data_url_bytes(source), "video data URL", sampler)
        scheme = urllib.parse.urlsplit(source).scheme.lower()
        if scheme in ("http", "https"):
            if not self.allow_remote:
                raise ValueError(
                    f"video URL {_short(source)}: fetching remote media is disabled; enable it "
                    "with allow_remote_images=True, or send the video as a data: URL"
                )
            return self._decode(self._fetch(source), _short(source), sampler)
        if scheme == "file":
            source = urllib.request.url2pathname(urllib.parse.urlsplit(source).path)
        elif scheme and len(scheme) > 1:
            raise ValueError(f"video {_short(source)}: unsupported URL scheme {scheme!r}")
        if not allow_local_paths:
            raise ValueError(
                f"video {_short(source)}: local video paths are accepted by the offline API "
                "(LLM) only; send the video as a data: URL (base64)"
            )
        if not os.path.isfile(source):
            raise ValueError(f"video file {source!r} does not exist")
        size = os.path.getsize(source)
        if size > self.max_bytes:
            raise ValueError(self._too_big(source, size))
        with open(source, "rb") as f:
            return self._decode(f.read(), source, sampler)

    def _data_url_bytes(self, url: str) -> bytes:
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ValueError(
                "video data URL: only base64 data URLs are supported (data:video/mp4;base64,...)"
            )
        if len(payload) * 3 // 4 > self.max_bytes:
            raise ValueError(self._too_big("video data URL", len(payload) * 3 // 4))
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"video data URL: invalid base64 data ({e})") from None

    def _fetch(self, url: str) -> bytes:
        request = urllib.request.Request(url, headers={"User-Agent": "pagoda"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                data = response.read(self.max_bytes + 1)
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise ValueError(f"video URL {_short(url)}: could not fetch it ({e})") from None
        if len(data) > self.max_bytes:
            raise ValueError(self._too_big(_short(url), len(data)))
        return data

    # ------------------------------------------------------------------ decoding

    def _decode(self, data: bytes, what: str, sampler: FrameSampler) -> LoadedVideo:
        try:
            import av
        except ImportError:
            raise ValueError(
                f"{what}: decoding video files needs PyAV: pip install av (or pass the frames "
                "as a uint8 array [T, H, W, 3] or a list of images)"
            ) from None
        if len(data) > self.max_bytes:
            raise ValueError(self._too_big(what, len(data)))
        try:
            total, fps = self._probe(av, data)
            indices, sample_fps = sampler(total, fps)
            frames = self._read_frames(av, data, indices)
            if len(frames) < len(indices):
                # The container's frame count was too high: sample the frames that exist.
                total = self._count_frames(av, data)
                indices, sample_fps = sampler(total, fps)
                frames = self._read_frames(av, data, indices)
            times = indices.astype(np.float64) / fps
        except (av.error.FFmpegError, OSError, EOFError) as e:
            # (PyAV's errors are also ValueErrors; their text names an internal '<none>' file)
            reason = getattr(e, "strerror", None) or type(e).__name__
            raise ValueError(
                f"{what}: not a readable video ({reason}); send an MP4, WebM, MKV, MOV or AVI file"
            ) from None
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
        return LoadedVideo(np.stack(frames), sample_fps, times)

    def _probe(self, av: Any, data: bytes) -> tuple[int, float]:
        """(frame count, frames per second) from the container's header."""
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise ValueError("the file has no video stream")
            stream = container.streams.video[0]
            self._check_pixels(stream.codec_context.width, stream.codec_context.height)
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            if not rate or float(rate) <= 0:
                raise ValueError("the video stream has no frame rate")
            total = stream.frames
        if total <= 0:  # not in the header (some containers): count the frames
            total = self._count_frames(av, data)
        return total, float(rate)

    def _count_frames(self, av: Any, data: bytes) -> int:
        with av.open(io.BytesIO(data)) as container:
            return sum(1 for _ in container.decode(video=0))

    def _read_frames(self, av: Any, data: bytes, indices: np.ndarray) -> list[np.ndarray]:
        wanted: dict[int, int] = {}
        for index in indices.tolist():
            wanted[index] = wanted.get(index, 0) + 1  # an index may repeat (short clips)
        last = int(indices.max())
        frames: list[np.ndarray] = []
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    rgb = frame.to_ndarray(format="rgb24")  # [H, W, 3] uint8
                    frames.extend([rgb] * wanted[i])
                if i >= last:
                    break
        return frames

    def _check_pixels(self, width: int, height: int) -> None:
        if width < 1 or height < 1:
            raise ValueError(f"the video frames are {width}x{height}: they have no pixels")
        if width * height > self.max_pixels:
            raise ValueError(
                f"the video frames are {width}x{height} = {width * height} pixels, more than "
                f"the {self.max_pixels} allowed"
            )

    def _too_big(self, what: str, size: int) -> str:
        return f"{what}: the video is {size} bytes, more than max_video_bytes={self.max_bytes}"


def _as_uint8(value: Any, what: str, ndim: int) -> np.ndarray:
    array = np.asarray(value)
    shape = "[H, W, 3]" if ndim == 3 else "[T, H, W, 3]"
    if array.ndim != ndim or array.shape[-1] != 3:
        raise ValueError(f"{what} must be a {shape} RGB array, got shape {list(array.shape)}")
    if array.dtype != np.uint8:
        raise ValueError(f"{what} must be uint8 (0-255), got {array.dtype}")
    return array


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
