"""An image cannot make the engine decode more pixels than ``pricing.max_image_pixels``.

An engine decodes an image's every pixel in its API server before it resizes it to what the model
sees, so what an image costs there is its width times height, not its bytes and not its tokens (the
KV cost is capped by the model's ``max_pixels``). A PNG of one colour is a few hundred KB for 144
million pixels: vLLM decodes up to 178,956,970 (``VLLM_MAX_IMAGE_PIXELS``, PR #47010) and Pillow only
warns below that; SGLang decoded a 12,000 x 12,000 PNG into ~1 GB and ~2 minutes of a core
(#28588). Over real sockets: such an image is a 400 before anything is held or forwarded."""

from __future__ import annotations

import base64
import io
import struct
import warnings
import zlib
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.adversarial.support import AUTH
from tests.adversarial.support import image_chat as chat
from tests.conftest import GatewayFactory, StubBackend, stub_pools


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bomb(side: int) -> bytes:
    """A valid grey PNG of ``side`` x ``side`` black pixels (~1 KB per million)."""
    z = zlib.compressobj(9)
    row = b"\x00" * (side + 1)
    idat = b"".join(z.compress(row) for _ in range(side)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def big() -> str:
    return "data:image/png;base64," + base64.b64encode(bomb(12_000)).decode()


def small() -> str:
    out = io.BytesIO()
    Image.new("RGB", (64, 64)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def responses(url: str) -> dict[str, Any]:
    parts = [{"type": "input_text", "text": "what is this?"}, {"type": "input_image", "image_url": url}]
    return {"model": "stub-model", "max_output_tokens": 5, "input": [{"role": "user", "content": parts}]}


def config(url: str, **pricing: Any) -> dict[str, Any]:
    return {
        "pools": stub_pools(url, capacity=200_000),
        "tenants": {"t": {"keys": ["k"], "budget_tokens": 50_000}},
        **({"pricing": pricing} if pricing else {}),
    }


def test_the_bomb_is_real_small_on_the_wire_and_pillow_would_decode_it(big: str) -> None:
    raw = base64.b64decode(big.split(",", 1)[1])
    assert len(raw) < 200_000
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        image = Image.open(io.BytesIO(raw))  # a warning, not an error: decoding would go ahead
    assert image.size == (12_000, 12_000)
    assert [w.category for w in caught] == [Image.DecompressionBombWarning]


async def test_an_image_of_too_many_pixels_is_a_400_on_chat_and_responses_before_anything_is_held(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, big: str
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(config(url))
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=30) as c:
        for route, body, param in (
            ("/v1/chat/completions", chat(big), "messages[0].content[1].image_url"),
            ("/v1/responses", responses(big), "input[0].content[1].image_url"),
        ):
            r = await c.post(route, json=body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert (error["code"], error["param"]) == ("image_too_large", param), error
            assert "12000 x 12000" in error["message"] and "pricing.max_image_pixels" in error["message"]
        assert stub.requests == []
        for route, body in (("/v1/chat/completions", chat(small())), ("/v1/responses", responses(small()))):
            assert (await c.post(route, json=body)).status_code == 200
    assert len(stub.requests) == 2
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}


async def test_an_operator_sets_the_bound_or_turns_it_off(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory, big: str
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(config(url, max_image_pixels=0))
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=30) as c:
        assert (await c.post("/v1/chat/completions", json=chat(big))).status_code == 200
    gw = await gateway_factory(config(url, max_image_pixels=4_000))
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json=chat(small()))
        assert r.status_code == 400 and "4,096 pixels" in r.json()["error"]["message"], r.text
    assert len(stub.requests) == 1
