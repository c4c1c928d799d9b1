"""What an image in a prompt costs in tokens, per model, priced before the request runs.

Vision-language models turn one image into a number of prompt tokens that depends on the model:

* **fixed**: every image costs the same (LLaVA-1.5: 576; Gemma 3 without pan-and-scan: 256):
  ``ImageRule(tokens=N)``.
* **dynamic resolution** (Qwen2-VL, Qwen2.5-VL and their kin): the engine resizes the image so both
  sides are multiples of ``patch_pixels`` (28: 14-pixel patches merged 2 x 2) and its area lies in
  ``[min_pixels, max_pixels]``, then spends one token per ``patch_pixels``² block, plus
  ``extra_tokens`` per image (vision start/end markers). A thumbnail costs a handful of tokens, a
  4k screenshot ~10,000, and the default ``max_pixels`` (12,845,056) allows 16,384 per image.

The gateway never fetches an image. It prices one by its size when the request carries it (a
``data:`` URL whose header gives width and height: PNG, JPEG, GIF, WebP), and at the most the rule
allows otherwise (a remote URL, a file id, a format or header it cannot read): a tenant cannot make
an image cost less than the engine will spend on it. The size bound is ``ceil(w / p) * ceil(h / p)``
blocks (or, for an image under ``min_pixels``, the blocks of its enlargement to that area, each side
rounded up), at most ``max_pixels / p²``: never below what the engine's resize (each side rounded to
the nearest multiple of ``p``, the area then scaled into the bounds) produces.
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

# How much of a data: URL is decoded to find the image's size: PNG, GIF and WebP name it in their
# first 30 bytes; a JPEG names it in its frame header, after any metadata segments (EXIF, ICC
# profiles, up to 64 KB each), so it is looked for in growing prefixes, up to the last.
_FIRST_CHARS = 4096
_MOST_CHARS = 1 << 20

# Segments a JPEG may have before its frame header: real files have a dozen or two (APP0, EXIF, an
# ICC profile in up to ~16 chunks, quantization and Huffman tables); a file of thousands of empty
# ones would make reading its size a long loop on the gateway's event loop. Beyond: the most.
_JPEG_MOST_SEGMENTS = 256

_JPEG_FRAMES = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))


@dataclass(frozen=True, slots=True)
class ImageRule:
    """How many prompt tokens one image costs on a model (module docstring)."""

    tokens: int | None = None  # fixed per image; None: dynamic resolution (the fields below)
    patch_pixels: int = 28
    min_pixels: int = 3_136
    max_pixels: int = 12_845_056
    extra_tokens: int = 0

    def __post_init__(self) -> None:
        if self.tokens is not None and self.tokens < 0:
            raise ValueError("tokens must be >= 0")
        if self.patch_pixels < 1 or self.min_pixels < 1 or self.extra_tokens < 0:
            raise ValueError("patch_pixels and min_pixels must be >= 1, extra_tokens >= 0")
        if self.max_pixels < max(self.min_pixels, self.patch_pixels * self.patch_pixels):
            raise ValueError("max_pixels must be at least min_pixels and one patch_pixels² block")

    @property
    def most(self) -> int:
        """What the largest image costs: the price of one the gateway cannot measure."""
        if self.tokens is not None:
            return self.tokens
        return self.max_pixels // (self.patch_pixels * self.patch_pixels) + self.extra_tokens

    def for_size(self, width: int, height: int) -> int:
        """The cost of a ``width`` x ``height`` image (an upper bound of the engine's count)."""
        if self.tokens is not None:
            return self.tokens
        f = self.patch_pixels
        blocks = math.ceil(width / f) * math.ceil(height / f)
        if max(f, round(height / f) * f) * max(f, round(width / f) * f) < self.min_pixels:
            # Enlarged to min_pixels, each side rounded up to a block: a thin image gains more
            # blocks than min_pixels holds (the engine's own expressions, so the same doubles).
            beta = math.sqrt(self.min_pixels / (height * width))
            blocks = max(blocks, math.ceil(height * beta / f) * math.ceil(width * beta / f))
        return min(blocks, self.max_pixels // (f * f)) + self.extra_tokens

    def price(self, url: object) -> int:
        """The cost of an image given by ``url`` (the part's URL string; anything else: the most)."""
        if self.tokens is not None or not isinstance(url, str):
            return self.most
        return self.price_size(data_url_size(url))

    def price_size(self, size: tuple[int, int] | None) -> int:
        """The cost of an image of ``size`` (width, height), or of one whose size is unknown: the most."""
        return self.most if size is None else self.for_size(*size)


def data_url_size(url: str) -> tuple[int, int] | None:
    """(width, height) of the image in a ``data:`` URL, from its header; None when there is none
    (not a data: URL, not an image format read here, a header cut short or malformed)."""
    if not url.startswith("data:"):
        return None
    comma = url.find(",", 5, 5 + 256)  # (a media type and its parameters are short)
    if comma < 0:
        return None
    b64 = url[5:comma].endswith(";base64")
    start, limit = comma + 1, _FIRST_CHARS
    while True:
        chunk = url[start : start + limit]
        try:
            if b64:
                chunk = chunk[: len(chunk) // 4 * 4]
                data = base64.b64decode(chunk)
            else:
                data = unquote_to_bytes(chunk)
        except (binascii.Error, ValueError):
            return None
        size, more = image_size(data)
        if size is not None or not more or start + limit >= len(url) or limit >= _MOST_CHARS:
            return size
        limit *= 16


def image_size(data: bytes) -> tuple[tuple[int, int] | None, bool]:
    """((width, height) or None, whether more of the file could still tell it) from a file's start."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        if len(data) < 24 or data[12:16] != b"IHDR":
            return None, len(data) < 24
        return _positive(*struct.unpack(">II", data[16:24])), False
    if data[:6] in (b"GIF87a", b"GIF89a"):
        if len(data) < 10:
            return None, True
        return _positive(*struct.unpack("<HH", data[6:10])), False
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _webp(data)
    if data[:2] == b"\xff\xd8":
        return _jpeg(data)
    return None, False


def _webp(data: bytes) -> tuple[tuple[int, int] | None, bool]:
    if len(data) < 30:
        return None, True
    kind = data[12:16]
    if kind == b"VP8X":  # extended: 24-bit (width - 1), (height - 1)
        w = int.from_bytes(data[24:27], "little") + 1
        h = int.from_bytes(data[27:30], "little") + 1
        return _positive(w, h), False
    if kind == b"VP8L":  # lossless: signature 0x2f, then 14-bit (width - 1), (height - 1)
        if data[20] != 0x2F:
            return None, False
        bits = int.from_bytes(data[21:25], "little")
        return _positive((bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1), False
    if kind == b"VP8 ":  # lossy: a key frame's start code, then 14-bit width, height
        if data[23:26] != b"\x9d\x01\x2a":
            return None, False
        w, h = struct.unpack("<HH", data[26:30])
        return _positive(w & 0x3FFF, h & 0x3FFF), False
    return None, False


def _jpeg(data: bytes) -> tuple[tuple[int, int] | None, bool]:
    """Walk the segments to the first frame header (SOFn), which gives the size the decoder uses."""
    i = 2
    n = len(data)
    for _ in range(_JPEG_MOST_SEGMENTS):
        if i < n and data[i] != 0xFF:
            # Not a marker where one must be. Decoders skip such bytes to the next 0xFF; a size
            # found that way could be one planted for this reader only: none (the most) instead.
            return None, False
        while i < n and data[i] == 0xFF:  # (fill bytes may pad a marker)
            i += 1
        if i + 3 > n:
            return None, True
        marker = data[i]
        if marker in (0xD8, 0xD9, 0xDA) or 0xD0 <= marker <= 0xD7:
            return None, False  # a stray start, the end, or image data before any frame header
        length = (data[i + 1] << 8) | data[i + 2]
        if marker in _JPEG_FRAMES:
            if i + 8 > n:
                return None, True
            h, w = struct.unpack(">HH", data[i + 4 : i + 8])
            return _positive(w, h), False
        if length < 2:
            return None, False
        i += 1 + length
    return None, False


def _positive(w: int, h: int) -> tuple[int, int] | None:
    return (w, h) if w > 0 and h > 0 else None
