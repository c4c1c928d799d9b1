"""Media parts: what an image costs, and which URLs the engine may be sent to fetch.

An image costs what the model's image rule says (``Pricer(images=)``, classifiers/images.py: by the
image's size, or the most); a request's ``mm_processor_kwargs`` ``min_pixels`` / ``max_pixels``
replace the rule's bounds, other processor settings are refused. An image whose size its data: URL
shows is at most ``max_image_pixels``. A media part's URL (chat ``image_url`` / ``audio_url`` /
``video_url``, Responses ``input_image`` / ``input_file``), which the engine fetches itself, is a
string that ``media_urls`` allows (classifiers/media_urls.py: no paths, no schemes but the allowed
ones, no private hosts); otherwise a 400 ``media_url_not_allowed``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from classifiers.images import ImageRule, data_url_size
from classifiers.media_urls import TooManyElements, may_name_media, media_urls_in
from classifiers.pricing.cost import InvalidRequest
from classifiers.pricing.settings import PricingSettings, Rules
from classifiers.pricing.values import MAX_TOKEN_ID, kind, show_value


def image_rule(rules: Rules, body: Mapping[str, Any]) -> ImageRule:
    """The image rule of the body's model (its envelope is checked: it names one), with the
    request's own processor settings where they change what an image costs (below)."""
    rule = rules.images.get(body["model"])
    if body.get("mm_processor_kwargs") is not None or body.get("media_io_kwargs") is not None:
        rule = _requested_image_rule(body, rule)
    return rule


def _requested_image_rule(body: Mapping[str, Any], rule: ImageRule) -> ImageRule:
    """vLLM hands a request's ``mm_processor_kwargs`` to the model's processor: ``max_pixels`` there
    (or ``size.longest_edge``, the newer name) lets one image of a dynamic-resolution model become
    as many tokens as the request likes. Those bounds are priced (they replace the model rule's);
    any other setting, and any setting on a model whose images are priced at a fixed count, is
    refused: what it does to an image's cost is not known here. ``media_io_kwargs`` (how media are
    loaded: a video's frame count) likewise."""
    io = body.get("media_io_kwargs")
    if io is not None and io != {}:
        raise InvalidRequest(
            "'media_io_kwargs' is not accepted here: it changes how many tokens a video or image "
            "becomes, which the gateway cannot price before the request runs; remove it",
            param="media_io_kwargs",
            code="unsupported_parameter",
        )
    kwargs = body.get("mm_processor_kwargs")
    if kwargs is None or kwargs == {}:
        return rule
    if not isinstance(kwargs, dict):
        raise InvalidRequest(
            f"'mm_processor_kwargs' must be an object, got {kind(kwargs)}", param="mm_processor_kwargs"
        )
    if rule.tokens is not None:
        raise InvalidRequest(
            f"'mm_processor_kwargs' is not accepted for model {show_value(body['model'])}: its images are "
            f"priced at {rule.tokens} tokens each, and processor settings can change that; remove it",
            param="mm_processor_kwargs",
            code="unsupported_parameter",
        )
    bounds = {"min_pixels": rule.min_pixels, "max_pixels": rule.max_pixels}
    for key, value in kwargs.items():
        if key == "size" and isinstance(value, dict):
            for edge, name in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
                if edge in value:
                    bounds[name] = _pixels(value[edge], f"mm_processor_kwargs.size.{edge}")
            extra = [k for k in value if k not in ("shortest_edge", "longest_edge")]
            if not extra:
                continue
            key = f"size.{extra[0]}"
        elif key in bounds:
            bounds[key] = _pixels(value, f"mm_processor_kwargs.{key}")
            continue
        raise InvalidRequest(
            f"'mm_processor_kwargs.{show_value(key)}' is not accepted here: only min_pixels and max_pixels "
            "(or size.shortest_edge / size.longest_edge) are, since the gateway prices what they do to "
            "an image; remove it",
            param="mm_processor_kwargs",
            code="unsupported_parameter",
        )
    try:
        return dataclasses.replace(rule, **bounds)
    except ValueError:
        raise InvalidRequest(
            f"'mm_processor_kwargs': max_pixels ({bounds['max_pixels']}) must be at least min_pixels "
            f"({bounds['min_pixels']}) and one {rule.patch_pixels} x {rule.patch_pixels} block",
            param="mm_processor_kwargs",
        ) from None


def _pixels(value: object, where: str) -> int:
    if type(value) is not int or value < 1 or value > MAX_TOKEN_ID:
        raise InvalidRequest(
            f"'{where}' must be a positive whole number of pixels, got {show_value(value)}", param=where
        )
    return value


def image_tokens(settings: PricingSettings, url: object, images: ImageRule, param: str) -> int:
    """What an image costs (the model's rule: by the size its data: URL's header gives, else the
    most; a file id or a remote URL: the most), once its size is within ``max_image_pixels``."""
    size = data_url_size(url) if isinstance(url, str) else None
    most = settings.max_image_pixels
    if size is not None and most and size[0] * size[1] > most:
        raise InvalidRequest(
            f"{param} is a {size[0]} x {size[1]} image ({size[0] * size[1]:,} pixels), above the "
            f"limit of {most:,} (pricing.max_image_pixels): the engine decodes every pixel before "
            "it resizes; scale it down (the model sees a few million pixels at most)",
            param=param,
            code="image_too_large",
        )
    return images.price_size(size)


def check_media_url(settings: PricingSettings, url: object, param: str) -> None:
    """A media part's URL, which the engine fetches from inside its network, is one the gateway
    allows (classifiers/media_urls.py); absent (a file id, a cached uuid) is the engine's to judge."""
    if url is None:
        return
    if not isinstance(url, str):
        raise InvalidRequest(f"{param} must be a string URL, got {kind(url)}", param=param)
    why = settings.media_urls.problem(url)
    if why is not None:
        raise InvalidRequest(
            f"{param} {why}; send the media inline as a data: URL (pricing.media_urls)",
            param=param,
            code="media_url_not_allowed",
        )


def check_passthrough_media(settings: PricingSettings, raw: bytes, body: Mapping[str, Any]) -> None:
    """A pass-through JSON body (``raw``, parsed as ``body``) names only media the engine may
    fetch: every media key anywhere in it (`media_urls.MEDIA_KEYS`: a multimodal score, rerank or
    pooling request's content parts, SGLang's ``image_data``) holds an allowed URL. The walk
    visits at most ``max_items`` elements, and only bodies whose text holds a media key."""
    if not may_name_media(raw):
        return
    try:
        found = media_urls_in(body, settings.max_items)
    except TooManyElements:
        raise InvalidRequest(
            f"the request names media and holds more than {settings.max_items} elements, above "
            "this deployment's limit (pricing.max_items); send fewer, or split the request"
        ) from None
    for where, url in found:
        check_media_url(settings, url, where)
