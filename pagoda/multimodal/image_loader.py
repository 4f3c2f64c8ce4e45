"""Turn the image references users send into decoded PIL images, within limits.

Accepted: PIL images, encoded bytes, `data:` URLs (base64), local paths and `file://` URLs (only
when the caller allows it: the offline API does, the server does not), and `http(s)://` URLs only
when remote fetching is enabled, with a timeout and a byte limit. Decoded files are turned
upright by their EXIF orientation. Every failure is a ValueError that says what was wrong.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from pagoda.config import MultiModalConfig


class ImageLoader:
    def __init__(self, config: MultiModalConfig) -> None:
        self.allow_remote = config.allow_remote_images
        self.timeout_s = config.image_fetch_timeout_s
        self.max_bytes = config.max_image_bytes
        self.max_pixels = config.max_image_pixels

    def load(self, source: Any, allow_local_paths: bool = False) -> Any:
        """A decoded RGB-convertible PIL image from any accepted source."""
        from PIL import Image

        if isinstance(source, Image.Image):
            self._check_pixels(*source.size)
            return source
        if isinstance(source, (bytes, bytearray, memoryview)):
            return self._decode(bytes(source), "image bytes")
        if isinstance(source, os.PathLike):
            source = os.fspath(source)
        if not isinstance(source, str):
            raise TypeError(
                "an image must be a PIL image, bytes, a data: URL, an http(s) URL or a local "
                f"path; got {type(source).__name__}"
            )
        if not source.strip():
            raise ValueError(
                "image URL is empty: send the image as a data: URL "
                "(data:image/png;base64,...)" + (" or a local path" if allow_local_paths else "")
            )
        if source.startswith("data:"):
            return self._decode(self._data_url_bytes(source), "data URL")
        scheme = urllib.parse.urlsplit(source).scheme.lower()
        if scheme in ("http", "https"):
            if not self.allow_remote:
                raise ValueError(
                    f"image URL {_short(source)}: fetching remote images is disabled; enable it "
                    "with allow_remote_images=True, or send the image as a data: URL"
                )
            return self._decode(self._fetch(source), _short(source))
        if scheme == "file":
            source = urllib.request.url2pathname(urllib.parse.urlsplit(source).path)
        elif scheme and len(scheme) > 1:  # one letter: a Windows drive, i.e. a path
            raise ValueError(f"image {_short(source)}: unsupported URL scheme {scheme!r}")
        if not allow_local_paths:
            raise ValueError(
                f"image {_short(source)}: local image paths are accepted by the offline API "
                "(LLM) only; send the image as a data: URL (base64)"
            )
        return self._decode(self._read_file(source), source)

    # ------------------------------------------------------------------ sources

    def _data_url_bytes(self, url: str) -> bytes:
        header, sep, payload = url.partition(",")
        if not sep:
            raise ValueError("image data URL has no ',' separating the header from the data")
        if not header.endswith(";base64"):
            raise ValueError(
                f"image data URL {header!r}: only base64 data URLs are supported "
                "(data:image/png;base64,...)"
            )
        # 4 base64 characters carry 3 bytes: reject oversized payloads before decoding them.
        if len(payload) * 3 // 4 > self.max_bytes:
            raise ValueError(self._too_big("data URL", len(payload) * 3 // 4))
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"image data URL: invalid base64 data ({e})") from None

    def _read_file(self, path: str) -> bytes:
        if not os.path.isfile(path):
            raise ValueError(f"image file {path!r} does not exist")
        size = os.path.getsize(path)
        if size > self.max_bytes:
            raise ValueError(self._too_big(path, size))
        with open(path, "rb") as f:
            return f.read()

    def _fetch(self, url: str) -> bytes:
        request = urllib.request.Request(url, headers={"User-Agent": "pagoda"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                length = response.headers.get("Content-Length")
                if length is not None and length.isdigit() and int(length) > self.max_bytes:
                    raise ValueError(self._too_big(_short(url), int(length)))
                data = response.read(self.max_bytes + 1)
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise ValueError(f"image URL {_short(url)}: could not fetch it ({e})") from None
        if len(data) > self.max_bytes:
            raise ValueError(self._too_big(_short(url), len(data)))
        return data

    # ------------------------------------------------------------------ decoding

    def _decode(self, data: bytes, what: str) -> Any:
        from PIL import Image, ImageOps, UnidentifiedImageError

        if len(data) > self.max_bytes:
            raise ValueError(self._too_big(what, len(data)))
        try:
            image = Image.open(io.BytesIO(data))
            # The header gives the size: refuse huge images before decoding their pixels.
            self._check_pixels(*image.size)
            image.load()
            # Camera photos store their rotation in EXIF: show the model what a viewer shows
            # (as transformers' load_image does).
            image = ImageOps.exif_transpose(image)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
        except Image.DecompressionBombError as e:
            raise ValueError(f"{what}: the image is too large ({e})") from None
        except UnidentifiedImageError:
            # Pillow's own message names its BytesIO object (`<_io.BytesIO object at 0x...>`),
            # which tells the user nothing; the first bytes say what was sent instead.
            raise ValueError(
                f"{what}: not an image ({len(data)} bytes starting with {data[:8]!r}); send a "
                "PNG, JPEG, WebP or GIF file"
            ) from None
        except (OSError, SyntaxError) as e:
            raise ValueError(f"{what}: not a valid image file ({e})") from None
        return image

    def _check_pixels(self, width: int, height: int) -> None:
        if width < 1 or height < 1:
            raise ValueError(f"the image is {width}x{height}: it has no pixels")
        if width * height > self.max_pixels:
            raise ValueError(
                f"the image is {width}x{height} = {width * height} pixels, more than the "
                f"{self.max_pixels} allowed"
            )

    def _too_big(self, what: str, size: int) -> str:
        return f"{what}: the image is {size} bytes, more than max_image_bytes={self.max_bytes}"


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
