"""Images priced per model: a dynamic-resolution model's image costs what its size costs there, an
image the gateway cannot measure the most, a model without a rule ``pricing.image_tokens``; in chat
and the Responses API, inline and off the event loop alike."""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
from PIL import Image

from classifiers import InvalidRequest, Pricer, PricingSettings, TokenizerRegistry
from classifiers.images import ImageRule
from tests.classifiers.support import QWEN

LIMITS: dict[str, Any] = {"default_max_tokens": 16, "max_tokens_limit": None, "context_length": 200_000}
PRICER = Pricer(
    TokenizerRegistry(),
    PricingSettings(image_tokens=765, encode_threads=0),
    [("Qwen/Qwen2.5-VL-*", QWEN), ("llava-*", ImageRule(tokens=576))],
)


def png_url(width: int, height: int) -> str:
    out = io.BytesIO()
    Image.new("RGB", (width, height)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def chat(model: str, *images: Any) -> dict[str, Any]:
    parts = [{"type": "text", "text": "what is this?"}] + [
        {"type": "image_url", "image_url": i} for i in images
    ]
    return {"model": model, "messages": [{"role": "user", "content": parts}]}


def responses(model: str, *images: Any) -> dict[str, Any]:
    parts = [{"type": "input_text", "text": "what is this?"}]
    parts += [{"type": "input_image", **i} for i in images]
    return {"model": model, "input": [{"role": "user", "content": parts}]}


async def image_cost(body_of: Any, model: str, *images: Any) -> int:
    price = PRICER.aprice_responses if body_of is responses else PRICER.aprice_chat
    return (await price(body_of(model, *images), **LIMITS)).prefill - (
        await price(body_of(model), **LIMITS)
    ).prefill


async def test_a_dynamic_resolution_models_image_costs_what_its_size_costs_there() -> None:
    model = "Qwen/Qwen2.5-VL-7B-Instruct"
    assert await image_cost(chat, model, {"url": png_url(1920, 1080)}) == QWEN.for_size(1920, 1080) == 2693
    assert await image_cost(chat, model, png_url(64, 64)) == QWEN.for_size(64, 64)  # the string form
    assert await image_cost(responses, model, {"image_url": png_url(1920, 1080)}) == 2693
    two = await image_cost(chat, model, {"url": png_url(64, 64)}, {"url": png_url(4000, 4000)})
    assert two == QWEN.for_size(64, 64) + QWEN.for_size(4000, 4000)


async def test_an_image_the_gateway_cannot_measure_costs_the_models_most() -> None:
    model = "Qwen/Qwen2.5-VL-72B-Instruct"
    assert await image_cost(chat, model, {"url": "https://example.com/huge.png"}) == QWEN.most == 16_386
    assert await image_cost(responses, model, {"image_url": "https://example.com/huge.png"}) == QWEN.most
    assert await image_cost(responses, model, {"file_id": "file-123"}) == QWEN.most


async def test_a_fixed_rule_and_the_default_price_every_image_the_same() -> None:
    big = {"url": png_url(4000, 4000)}
    assert await image_cost(chat, "llava-1.5-7b", big) == 576
    assert (
        await image_cost(chat, "gpt-4o", big)
        == await image_cost(chat, "gpt-4o", {"url": "https://img.example.com/a.png"})
        == 765
    )
    assert await image_cost(responses, "gpt-4o", {"image_url": big["url"]}) == 765


async def test_off_the_event_loop_the_price_is_the_same() -> None:
    pricer = Pricer(
        TokenizerRegistry(),
        PricingSettings(encode_threads=2, inline_max_chars=0),
        [("Qwen/*", QWEN)],
    )
    try:
        bodies = [chat("Qwen/Qwen2-VL-2B", {"url": png_url(1920, 1080)}), chat("Qwen/Qwen2-VL-2B")]
        for body in bodies:
            body["messages"][0]["content"][0]["text"] = "a longer question " * 500  # encoded in the pool
        with_image, without = [await pricer.aprice_chat(body, **LIMITS) for body in bodies]
        assert with_image == await pricer.aprice_chat(bodies[0], **LIMITS)
        assert with_image.prefill - without.prefill == 2693
    finally:
        pricer.close()


async def test_a_requests_own_pixel_bounds_are_what_its_images_are_priced_with() -> None:
    # vLLM hands mm_processor_kwargs to the model's processor: max_pixels there is the engine's.
    model, remote = "Qwen/Qwen2.5-VL-7B-Instruct", {"url": "https://example.com/huge.png"}
    raised = {"mm_processor_kwargs": {"max_pixels": 50_000_000}}
    assert await image_cost(lambda m, *i: chat(m, *i) | raised, model, remote) == 50_000_000 // 784 + 2
    lowered = {"mm_processor_kwargs": {"size": {"shortest_edge": 3136, "longest_edge": 200_704}}}
    assert await image_cost(lambda m, *i: chat(m, *i) | lowered, model, remote) == 256 + 2
    big = {"url": png_url(1920, 1080)}
    assert await image_cost(lambda m, *i: chat(m, *i) | lowered, model, big) == 256 + 2  # capped lower
    for nothing in ({"mm_processor_kwargs": None}, {"mm_processor_kwargs": {}}, {"media_io_kwargs": {}}):
        assert await image_cost(lambda m, *i, n=nothing: chat(m, *i) | n, model, remote) == QWEN.most


@pytest.mark.parametrize(
    ("model", "extra", "param"),
    [
        ("Qwen/Qwen2.5-VL-7B", {"mm_processor_kwargs": {"do_resize": False}}, "mm_processor_kwargs"),
        ("Qwen/Qwen2.5-VL-7B", {"mm_processor_kwargs": {"size": {"height": 9000}}}, "mm_processor_kwargs"),
        (
            "Qwen/Qwen2.5-VL-7B",
            {"mm_processor_kwargs": {"max_pixels": "lots"}},
            "mm_processor_kwargs.max_pixels",
        ),
        ("Qwen/Qwen2.5-VL-7B", {"mm_processor_kwargs": {"max_pixels": 0}}, "mm_processor_kwargs.max_pixels"),
        (
            "Qwen/Qwen2.5-VL-7B",
            {"mm_processor_kwargs": {"min_pixels": 10**6, "max_pixels": 10**5}},
            "mm_processor_kwargs",
        ),
        ("Qwen/Qwen2.5-VL-7B", {"mm_processor_kwargs": [1]}, "mm_processor_kwargs"),
        (
            "llava-1.5-7b",
            {"mm_processor_kwargs": {"max_pixels": 10**6}},
            "mm_processor_kwargs",
        ),  # fixed count
        (
            "gpt-4o",
            {"mm_processor_kwargs": {"max_pixels": 10**6}},
            "mm_processor_kwargs",
        ),  # the default count
        ("Qwen/Qwen2.5-VL-7B", {"media_io_kwargs": {"video": {"num_frames": 10_000}}}, "media_io_kwargs"),
    ],
)
async def test_processor_settings_the_gateway_cannot_price_are_refused(
    model: str, extra: dict[str, Any], param: str
) -> None:
    for body in (
        chat(model, {"url": "https://x/a.png"}) | extra,
        responses(model, {"image_url": "https://x"}) | extra,
    ):
        price = PRICER.aprice_chat if "messages" in body else PRICER.aprice_responses
        with pytest.raises(InvalidRequest) as info:
            await price(body, **LIMITS)
        assert info.value.param == param, info.value.message
        assert len(info.value.message) < 300


async def test_an_image_over_max_image_pixels_is_refused_whatever_the_models_rule() -> None:
    # The engine decodes every pixel before it resizes: a fixed token price does not bound that.
    pricer = Pricer(TokenizerRegistry(), PricingSettings(max_image_pixels=10_000, encode_threads=0))
    for model in ("gpt-4o", "llava-1.5", "Qwen/Qwen2.5-VL-7B"):
        with pytest.raises(InvalidRequest) as err:
            await pricer.aprice_chat(chat(model, {"url": png_url(101, 100)}), **LIMITS)
        assert (err.value.code, err.value.param) == ("image_too_large", "messages[0].content[1].image_url")
        assert "101 x 100 image (10,100 pixels)" in err.value.message
        assert (await pricer.aprice_chat(chat(model, {"url": png_url(100, 100)}), **LIMITS)).prefill > 0
    # A size the gateway cannot read (a remote URL) is not refused: it is priced at the most.
    assert (
        await pricer.aprice_chat(chat("gpt-4o", {"url": "https://img.example.com/a.png"}), **LIMITS)
    ).prefill > 765
    assert PricingSettings().max_image_pixels == 89_478_485  # Pillow's decompression-bomb warning
