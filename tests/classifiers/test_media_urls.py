"""`MediaUrls`: which URLs a media part may make an engine fetch (classifiers/media_urls.py)."""

from __future__ import annotations

import pytest

from classifiers import InvalidRequest, Pricer, PricingSettings, TokenizerRegistry
from classifiers.media_urls import MediaUrls, TooManyElements, may_name_media, media_urls_in

PUBLIC = [
    "https://upload.wikimedia.org/wikipedia/commons/cat.png",
    "HTTPS://Img.Example.COM/cat.png?size=large#top",
    "http://img.example.com:8080/cat.png",
    "https://xn--bcher-kva.example/cat.png",
    "http://8.8.8.8/cat.png",
    "http://[2606:4700:4700::1111]/cat.png",
    "http://[::ffff:8.8.8.8]/cat.png",
    "https://img.example.com.",
    "data:image/png;base64,AAAA",
]

# (url, a word the reason holds)
REFUSED = [
    ("http://127.0.0.1/", "not a public address"),
    ("http://127.1/", "not a public address"),
    ("http://2130706433/", "not a public address"),
    ("http://0x7f000001/", "not a public address"),
    ("http://0x7f.0.0.1/", "not a public address"),
    ("http://0177.0.0.1/", "not a public address"),
    ("http://0/", "not a public address"),
    ("http://0.0.0.0/", "not a public address"),
    ("http://10.1.2.3/", "not a public address"),
    ("http://172.16.0.1/", "not a public address"),
    ("http://192.168.1.1/", "not a public address"),
    ("http://100.64.0.1/", "not a public address"),  # carrier-grade NAT
    ("http://169.254.169.254/latest/meta-data/", "not a public address"),
    ("http://224.0.0.251/", "not a public address"),
    ("http://255.255.255.255/", "not a public address"),
    ("http://[::1]/", "not a public address"),
    ("http://[::]/", "not a public address"),
    ("http://[fe80::1]/", "not a public address"),
    ("http://[fd00::1]/", "not a public address"),
    ("http://[::ffff:127.0.0.1]/", "private address 127.0.0.1"),
    ("http://[::ffff:7f00:1]/", "private address 127.0.0.1"),
    ("http://[64:ff9b::a9fe:a9fe]/", "private address 169.254.169.254"),  # NAT64
    ("http://[2002:c0a8:101::]/", "private address 192.168.1.1"),  # 6to4
    ("http://[::127.0.0.1]/", "private address 127.0.0.1"),  # IPv4-compatible (deprecated)
    ("http://[::ffff:0:a9fe:a9fe]/", "private address 169.254.169.254"),  # IPv4-translated
    ("http://localhost/", "single-label"),
    ("http://LocalHost./", "single-label"),
    ("http://redis:6379/", "single-label"),
    ("http://a.localhost/", "internal name"),
    ("http://metadata.google.internal/", "internal name"),
    ("http://printer.local/", "internal name"),
    ("http://api.default.svc/", "internal name"),
    ("http://nas.home.arpa/", "internal name"),
    ("http://1.2.3.4.5/", "not a valid address"),
    ("http://08.1.1.1/", "not a valid address"),
    ("http://a.b.1/", "not a valid address"),
    ("http://256.1.1.1/", "not a valid address"),
    ("http://1.2.3.16777216/", "not a valid address"),
    ("http://" + "9" * 5000 + "/", "not a valid address"),  # (int() would raise past 4,300 digits)
    ("http://0000000000000000000177.0.0.1/", "not a valid address"),
    ("http://a..example.com/", "empty label"),
    ("http://img.example.com@127.0.0.1/", "user info"),
    ("http://127.0.0.1\\@img.example.com/", "backslash"),
    ("http://127.0.0.1/\t", "without spaces"),
    ("http://127。0。0。1/", "printable ASCII"),
    ("http://ex ample.com/", "without spaces"),
    ("http:/127.0.0.1/", "written http://"),
    ("http:127.0.0.1/", "written http://"),
    ("http:///127.0.0.1/", "not a plain name"),
    ("http://%31%32%37.0.0.1/", "not a plain name"),
    ("http://[fe80::1%25eth0]/", "not a plain name"),
    ("http://[v1.x]/", "not a plain name"),
    ("http://img.example.com:/", "not a plain name"),
    ("http://img.example.com:99999/", "above 65535"),
    ("file:///etc/passwd", "scheme file:"),
    ("gopher://127.0.0.1:6379/_INFO", "scheme gopher:"),
    ("ftp://ftp.example.com/cat.png", "scheme ftp:"),
    ("/etc/passwd.png", "not a URL with a scheme"),
    ("cat.png", "not a URL with a scheme"),
    (" http://img.example.com/", "not a URL with a scheme"),
    ("", "not a URL with a scheme"),
]


@pytest.mark.parametrize("url", PUBLIC)
def test_public_and_inline_media_are_allowed_by_default(url: str) -> None:
    assert MediaUrls().problem(url) is None


@pytest.mark.parametrize(("url", "why"), REFUSED)
def test_paths_other_schemes_unplain_urls_and_private_hosts_are_refused_by_default(
    url: str, why: str
) -> None:
    problem = MediaUrls().problem(url)
    assert problem is not None and why in problem, problem


def test_listed_hosts_are_the_only_ones_fetched_whatever_they_are() -> None:
    policy = MediaUrls(hosts=("10.0.0.5", "*.img.example.com", "CDN.Example.com."))
    for ok in (
        "http://10.0.0.5/a",
        "https://eu.img.example.com/a",
        "https://a.b.img.example.com/a",
        "https://cdn.example.com/",
        "https://cdn.example.com./",
    ):
        assert policy.problem(ok) is None, ok
    for bad in (
        "http://167772165/a",
        "https://img.example.com/a",
        "https://evilimg.example.com/",
        "https://example.com/",
        "https://cdn.example.com../",
    ):
        assert policy.problem(bad) is not None, bad
    assert policy.problem("data:image/png;base64,AAAA") is None


def test_data_only_refuses_every_fetch_and_no_schemes_refuses_every_url() -> None:
    assert MediaUrls(schemes=("data",)).problem("https://img.example.com/cat.png") is not None
    assert MediaUrls(schemes=("DATA",)).problem("data:image/png;base64,AAAA") is None
    assert "allowed: none" in (MediaUrls(schemes=()).problem("data:,x") or "")


def test_private_hosts_allowed_keeps_the_schemes_and_the_plain_writing() -> None:
    policy = MediaUrls(private_hosts=True)
    assert policy.problem("http://127.0.0.1:8000/cat.png") is None
    assert policy.problem("http://redis/cat.png") is None
    for bad in ("file:///etc/passwd", "http://a@127.0.0.1/", "http:/127.0.0.1/", "http://127。0。0。1/"):
        assert policy.problem(bad) is not None, bad


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schemes": ("ht tp",)}, "not a URL scheme"),
        ({"hosts": ("",)}, "not a host name"),
        ({"hosts": ("a.example:80",)}, "not a host name"),
        ({"hosts": ("*.",)}, "not a host name"),
    ],
)
def test_a_policy_that_is_not_one_is_refused_when_built(
    kwargs: dict[str, tuple[str, ...]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        MediaUrls(**kwargs)  # type: ignore[arg-type]


async def test_pricing_checks_every_url_carrying_part_and_names_it() -> None:
    pricer = Pricer(TokenizerRegistry())
    limits = {"default_max_tokens": 16, "max_tokens_limit": None, "context_length": 8192}
    bad = "http://169.254.169.254/"

    def chat(part: dict[str, object]) -> dict[str, object]:
        return {"model": "m", "messages": [{"role": "user", "content": [part]}]}

    cases = [
        (chat({"type": "image_url", "image_url": {"url": bad}}), "messages[0].content[0].image_url.url"),
        (chat({"type": "image_url", "image_url": bad}), "messages[0].content[0].image_url"),
        (chat({"type": "video_url", "video_url": {"url": bad}}), "messages[0].content[0].video_url.url"),
        (chat({"type": "audio_url", "audio_url": {"url": bad}}), "messages[0].content[0].audio_url.url"),
    ]
    for body, param in cases:
        with pytest.raises(InvalidRequest) as err:
            await pricer.aprice_chat(body, **limits)
        assert (err.value.param, err.value.code) == (param, "media_url_not_allowed")
        assert "169.254.169.254" in err.value.message and "data: URL" in err.value.message
    with pytest.raises(InvalidRequest) as err:
        await pricer.aprice_chat(
            chat({"type": "image_url", "image_url": {"url": ["http://a.example"]}}), **limits
        )
    assert (
        err.value.param == "messages[0].content[0].image_url.url"
        and "must be a string URL" in err.value.message
    )
    # A part without a URL (a file id, a cached uuid) is the engine's to judge.
    assert (
        await pricer.aprice_chat(chat({"type": "image_url", "image_url": {"uuid": "abc"}}), **limits)
    ).prefill > 0
    responses = {
        "model": "m",
        "input": [{"role": "user", "content": [{"type": "input_file", "file_url": bad}]}],
    }
    with pytest.raises(InvalidRequest) as err:
        await pricer.aprice_responses(responses, **limits)
    assert err.value.param == "input[0].content[0].file_url"
    # The operator's policy is the pricer's.
    open_pricer = Pricer(TokenizerRegistry(), PricingSettings(media_urls=MediaUrls(private_hosts=True)))
    assert (await open_pricer.aprice_chat(cases[0][0], **limits)).prefill > 0


def test_media_references_are_found_in_a_body_of_any_shape() -> None:
    body = {
        "query": {"content": [{"type": "image_url", "image_url": {"url": "http://a.example/q.png"}}]},
        "documents": [
            {"content": [{"type": "video_url", "video_url": {"url": "http://b.example/v.mp4"}}]},
            {"type": "image_url", "image_url": "http://c.example/d.png"},
            "plain text",
        ],
        "image_data": ["data:,x", {"url": "http://d.example/e.png"}, None],
        "audio_data": "/var/audio.wav",
        "input_image": {"not": "a media key"},
        "url": "http://not-a-media-key.example/",
    }
    assert sorted(media_urls_in(body, 0)) == [
        ("audio_data", "/var/audio.wav"),
        ("documents[0].content[0].video_url.url", "http://b.example/v.mp4"),
        ("documents[1].image_url", "http://c.example/d.png"),
        ("image_data[0]", "data:,x"),
        ("image_data[1].url", "http://d.example/e.png"),
        ("query.content[0].image_url.url", "http://a.example/q.png"),
    ]
    assert may_name_media(b'{"image_data": []}') and not may_name_media(b'{"documents": ["an image"]}')
    # A key spelled with escapes is the same key to the engine's parser: such bodies are walked.
    assert may_name_media(b'{"image\\u005furl": "http://127.0.0.1/"}')
    assert may_name_media(b'{"\\u0069mage\\u005f\\u0075rl": 1}')


def test_the_walk_for_media_is_bounded_by_the_elements_it_looks_at() -> None:
    # The object and its one key, then the list and its numbers: 2 + 1 + 97 = 100.
    assert media_urls_in({"documents": [1] * 97}, 100) == []
    with pytest.raises(TooManyElements):
        media_urls_in({"documents": [1] * 98}, 100)
    with pytest.raises(TooManyElements):
        media_urls_in([[[[[]]]]] * 30, 100)
    assert media_urls_in({"documents": [1] * 10_000}, 0) == []  # 0: no bound
