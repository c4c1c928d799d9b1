"""A tenant cannot learn, by timing, which texts other tenants sent.

The gateway memoises token counts (a long prompt re-sent, a chat history re-priced each turn: a
memo hit prices a 28,000-token prompt in ~0.1 ms against ~14 ms cold; docs/benchmarks.md). A memo
shared by tenants made that difference another tenant's: sending a guessed document — a leaked
file, a form letter with a guessed name — and timing the answer told whether anyone had sent it
lately, the gateway's own version of the engine prefix-cache leak (CVE-2025-46570) that
``cache_salt: tenant`` closes. The memo is now partitioned by tenant. Over real sockets, counting
what the tokenizer really encodes: a tenant's own repeat is a memo hit, another tenant's same text
is encoded afresh.
"""

from __future__ import annotations

import random
from typing import Any

import httpx
import tiktoken

from tests.adversarial.support import PROSE_WORDS
from tests.conftest import GatewayFactory, StubBackend, stub_pools


class CountingEncoding:
    """The real encoding, recording the length of every text it encodes."""

    def __init__(self, enc: tiktoken.Encoding) -> None:
        self.enc, self.name, self.encoded = enc, enc.name, list[int]()

    def encode_ordinary(self, text: str) -> list[int]:
        self.encoded.append(len(text))
        return self.enc.encode_ordinary(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.enc, name)


def chat(text: str) -> dict[str, Any]:
    return {"model": "stub-model", "max_tokens": 1, "messages": [{"role": "user", "content": text}]}


async def test_another_tenants_same_document_is_encoded_afresh_not_served_from_its_memo(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    _, url = stub_backend
    gw = await gateway_factory(
        {
            "pools": stub_pools(url, capacity=1_000_000),
            "tenants": {
                "memo-victim": {"keys": ["kv"]},
                "memo-prober": {"keys": ["kp"]},
            },  # views of their own
        }
    )
    # (the process's shared cl100k tokenizer: put back as it was afterwards, views included)
    tok = gw.app.pricer._tokenizers.for_model("stub-model")
    counting = CountingEncoding(tok.encoding)
    views = dict(tok._views)
    tok._encoding = counting  # before any request, so every tenant's view shares it
    try:
        await probe(gw, counting)
    finally:
        tok._encoding = counting.enc
        tok._views.clear()
        tok._views.update(views)


async def probe(gw: Any, counting: CountingEncoding) -> None:
    rng = random.Random(7)
    document = " ".join(rng.choice(PROSE_WORDS) for _ in range(12_000))  # ~70,000 characters

    async def send(key: str, text: str) -> int:
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
            r = await c.post(
                "/v1/chat/completions", json=chat(text), headers={"authorization": f"Bearer {key}"}
            )
        assert r.status_code == 200, r.text
        return int(r.headers["x-tokengate-cost"])

    cost = await send("kv", document)
    first = sum(counting.encoded)
    assert first >= len(document)  # every chunk really encoded
    assert await send("kv", document) == cost
    assert sum(counting.encoded) == first  # the victim's own repeat: from its memo
    assert await send("kp", document) == cost  # the same price...
    assert sum(counting.encoded) == 2 * first  # ...counted afresh: nothing of the victim's memo shows
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}
