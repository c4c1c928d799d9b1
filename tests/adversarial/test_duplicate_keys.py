"""A key sent twice cannot make the backend run a request other than the one priced.

JSON parsers disagree on duplicate keys: orjson and Python's ``json`` (so the gateway, vLLM and
SGLang) keep the last value, others the first, some refuse the body. The gateway prices the last,
so it sends the body as it parsed it: every key once, with the value it priced. Checked on the
bytes the backend received, over real sockets.
"""

from __future__ import annotations

import httpx
import orjson

from tests.adversarial.support import WORDS
from tests.adversarial.support import rerank_config as config
from tests.conftest import GatewayFactory, StubBackend


async def post_raw(url: str, path: str, raw: bytes) -> httpx.Response:
    async with httpx.AsyncClient(
        headers={"authorization": "Bearer k", "content-type": "application/json"}
    ) as c:
        return await c.post(url + path, content=raw)


async def test_the_backend_reads_each_key_once_with_the_value_that_was_priced(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(config(url))
    # A first-wins parser would run 100,000 output tokens and a 30k-token prompt; 5 and "hi" were priced.
    raw = (
        b'{"model":"stub-model","max_tokens":100000,"messages":[{"role":"user","content":"'
        + WORDS.encode()
        + b'","content":"hi"}],"max_tokens":5}'
    )
    r = await post_raw(gw.url, "/v1/chat/completions", raw)
    assert r.status_code == 200 and int(r.headers["x-tokengate-cost"]) < 100
    sent = stub.requests[-1].raw
    assert sent.count(b'"max_tokens"') == 1 and b"100000" not in sent and b"word" not in sent
    assert orjson.loads(sent)["max_tokens"] == 5

    # The same for an allowed pass-through route (priced by its body and the output limit it names),
    # also when the JSON starts with whitespace.
    raw = b' \n{"model":"stub-model","query":"q","documents":["a"],"max_tokens":150000,"max_tokens":1}'
    r = await post_raw(gw.url, "/v1/rerank", raw)
    assert r.status_code == 200
    sent = stub.requests[-1].raw
    assert sent.count(b'"max_tokens"') == 1 and orjson.loads(sent)["max_tokens"] == 1
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}


async def test_json_too_deep_to_write_back_is_a_400_before_anything_waits(
    stub_backend: tuple[StubBackend, str], gateway_factory: GatewayFactory
) -> None:
    # The parser takes ~1,000 levels, the writer 254: a deep field pricing never reads (metadata)
    # must be a clear 400 at pricing, not a 500 when the body is sent.
    stub, url = stub_backend
    gw = await gateway_factory(config(url))
    deep = b'{"a":' * 299 + b"{}" + b"}" * 299
    chat = (
        b'{"model":"stub-model","max_tokens":5,"messages":[{"role":"user","content":"hi"}],"metadata":'
        + deep
        + b"}"
    )
    rerank = b'{"model":"stub-model","query":"q","documents":["a"],"extra":' + deep + b"}"
    for path, raw in (("/v1/chat/completions", chat), ("/v1/rerank", rerank)):
        r = await post_raw(gw.url, path, raw)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_json" and "254 levels" in r.json()["error"]["message"]
    # A priced field that deep keeps pricing's own 400, which names the field.
    tools = b'{"model":"stub-model","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function",'
    tools += b'"function":{"name":"f","parameters":' + deep + b"}}]}"
    r = await post_raw(gw.url, "/v1/chat/completions", tools)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tools")
    assert stub.requests == []
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}
