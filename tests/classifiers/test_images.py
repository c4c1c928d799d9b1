"""What an image costs: its size read from real image files (made by Pillow, as an engine decodes
them), the dynamic-resolution rule never below the engine's own count, and every header the reader
cannot trust priced at the most."""

from __future__ import annotations

import base64
import io
import math
from urllib.parse import quote_from_bytes

import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from classifiers.images import ImageRule, data_url_size, image_size
from tests.classifiers.support import QWEN


def encoded(fmt: str, size: tuple[int, int], **save: object) -> bytes:
    out = io.BytesIO()
    mode = "RGBA" if save.pop("alpha", False) else "RGB"
    Image.new(mode, size, (200, 30, 30)).save(out, format=fmt, **save)
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def qwen_tokens(width: int, height: int, rule: ImageRule = QWEN) -> int:
    """Qwen2-VL's own count (its processor's ``smart_resize``), the engine's side of the bargain."""
    f = rule.patch_pixels
    h = max(f, round(height / f) * f)
    w = max(f, round(width / f) * f)
    if h * w > rule.max_pixels:
        beta = math.sqrt(height * width / rule.max_pixels)
        h = max(f, math.floor(height / beta / f) * f)
        w = max(f, math.floor(width / beta / f) * f)
    elif h * w < rule.min_pixels:
        beta = math.sqrt(rule.min_pixels / (height * width))
        h = math.ceil(height * beta / f) * f
        w = math.ceil(width * beta / f) * f
    return (h // f) * (w // f) + rule.extra_tokens


FORMATS = [
    ("PNG", {}),
    ("PNG", {"alpha": True}),
    ("GIF", {}),
    ("JPEG", {}),
    ("JPEG", {"progressive": True}),
    ("JPEG", {"exif": b"Exif\x00\x00" + b"\x00" * 60_000}),  # the frame header 60 KB in
    ("JPEG", {"icc_profile": b"\x01" * 200_000}),  # an ICC profile in four segments
    ("WEBP", {"lossless": False}),
    ("WEBP", {"lossless": True}),
    ("WEBP", {"alpha": True, "lossless": False}),  # extended (VP8X)
]


@pytest.mark.parametrize(("fmt", "save"), FORMATS, ids=lambda v: str(v)[:24])
@pytest.mark.parametrize("size", [(1, 1), (37, 1200), (1920, 1080), (4000, 3000)])
def test_the_size_read_from_the_header_is_the_size_the_decoder_sees(
    fmt: str, save: dict[str, object], size: tuple[int, int]
) -> None:
    data = encoded(fmt, size, **dict(save))
    assert Image.open(io.BytesIO(data)).size == size
    assert data_url_size(data_url(data, f"image/{fmt.lower()}")) == size


def test_a_percent_encoded_data_url_is_read_too() -> None:
    data = encoded("PNG", (640, 480))
    assert data_url_size("data:image/png," + quote_from_bytes(data)) == (640, 480)


@given(width=st.integers(1, 20_000), height=st.integers(1, 20_000))
def test_the_dynamic_rule_never_prices_an_image_below_what_the_engine_counts(width: int, height: int) -> None:
    assert QWEN.for_size(width, height) >= qwen_tokens(width, height)
    assert QWEN.for_size(width, height) <= QWEN.most


def test_what_common_sizes_cost_on_a_qwen2_vl_style_model() -> None:
    assert QWEN.most == 16_384 + 2
    assert QWEN.for_size(1920, 1080) == qwen_tokens(1920, 1080) == 69 * 39 + 2
    assert QWEN.for_size(8000, 8000) == 16_384 + 2  # capped at max_pixels
    assert QWEN.for_size(10, 10) == qwen_tokens(10, 10) == 4 + 2  # enlarged to min_pixels
    assert QWEN.for_size(5, 50) == qwen_tokens(5, 50) == 7 + 2  # thin: more blocks than min_pixels holds
    assert ImageRule(tokens=576).for_size(4000, 4000) == 576 == ImageRule(tokens=576).most


def test_an_image_the_gateway_cannot_measure_costs_the_most() -> None:
    png = encoded("PNG", (64, 64))
    assert QWEN.price(data_url(png)) == QWEN.for_size(64, 64) < 100
    for url in [
        "https://example.com/cat.png",  # never fetched
        "file-abc123",
        data_url(encoded("BMP", (64, 64)), "image/bmp"),  # a format not read here
        data_url(png[:20]),  # cut short before the size
        "data:image/png;base64,!!!!not base64!!!!",
        "data:image/png;base64",  # no data at all
        "data:" + "x" * 10_000,  # no comma where a media type ends
    ]:
        assert QWEN.price(url) == QWEN.most, url
    assert QWEN.price(None) == QWEN.price({"url": "x"}) == QWEN.most


def test_a_jpeg_with_bytes_where_a_marker_belongs_is_not_trusted() -> None:
    # Decoders skip junk to the next 0xFF; a reader that did too could be shown a small frame
    # header planted in the junk while the decoder finds the real, larger one after it.
    real = encoded("JPEG", (4000, 3000))
    planted = b"\xff\xc0\x00\x11\x08\x00\x10\x00\x10" + b"\x00" * 8  # a 16 x 16 frame header
    hostile = real[:2] + b"\x00junk" + planted + real[2:]
    assert image_size(hostile) == (None, False)
    assert QWEN.price(data_url(hostile, "image/jpeg")) == QWEN.most


def test_a_zero_sized_header_is_no_size() -> None:
    png = bytearray(encoded("PNG", (8, 8)))
    png[16:24] = b"\x00" * 8
    assert image_size(bytes(png)) == (None, False)


@pytest.mark.parametrize(
    "kwargs",
    [{"tokens": -1}, {"patch_pixels": 0}, {"min_pixels": 0}, {"max_pixels": 100}, {"extra_tokens": -1}],
)
def test_a_rule_that_cannot_price_is_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        ImageRule(**kwargs)


PREFIXES = [
    b"\x89PNG\r\n\x1a\n",
    b"GIF89a",
    b"RIFF\x00\x00\x00\x00WEBPVP8X",
    b"RIFF\x00\x00\x00\x00WEBPVP8L",
    b"\xff\xd8",
]


@given(prefix=st.sampled_from(PREFIXES), rest=st.binary(max_size=200))
def test_any_bytes_after_a_known_signature_give_a_size_or_none_never_an_error(
    prefix: bytes, rest: bytes
) -> None:
    size, _ = image_size(prefix + rest)
    assert size is None or (size[0] > 0 and size[1] > 0)
    assert QWEN.price(data_url(prefix + rest)) <= QWEN.most


@given(text=st.text(max_size=300))
def test_any_text_as_a_data_url_prices_without_an_error(text: str) -> None:
    for url in ("data:image/png;base64," + text, "data:image/png," + text, "data:" + text):
        assert 0 < QWEN.price(url) <= QWEN.most


def test_a_jpeg_of_thousands_of_empty_segments_is_not_walked_to_its_end() -> None:
    # Reading a size must not become a long loop on the event loop: past 256 segments, the most.
    real = encoded("JPEG", (64, 64))
    padded = real[:2] + b"\xff\xfe\x00\x02" * 5000 + real[2:]  # 5,000 empty comment segments
    assert Image.open(io.BytesIO(padded)).size == (64, 64)  # a decoder reads it
    assert image_size(padded) == (None, False)
    assert QWEN.price(data_url(padded, "image/jpeg")) == QWEN.most
    few = real[:2] + b"\xff\xfe\x00\x02" * 200 + real[2:]
    assert image_size(few) == ((64, 64), False)
