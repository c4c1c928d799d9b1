"""Per-model prompt overhead through the gateway: the config keys, prices corrected by what engines
report, /stats' ``pricing`` section, the Prometheus gauge, and the doctor's finding."""

from __future__ import annotations

import io
from typing import Any

import httpx
import pytest

from classifiers.prompt_overhead import MIN_SAMPLES
from gateway.config.fields import ConfigError
from gateway.config.loader import parse_config
from gateway.observe import doctor
from gateway.observe.diagnose import diagnose
from tests.conftest import GatewayFactory, StubBackend, serve_asgi, stub_pools

PRICED = 8  # the "hello" chat below, as the gateway prices it (cl100k_base)
REPORTED = 47  # what the engine reports for it: its chat template adds 39 tokens
MAX_TOKENS = 5


def hello(**extra: object) -> dict[str, object]:
    return {
        "model": "stub-model",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": MAX_TOKENS,
        **extra,
    }


class TemplatedEngine:
    """The stub backend, reporting prompt_tokens as an engine applying a chat template would (the
    stub's usage says 11; same width, so no content-length changes)."""

    def __init__(self, stub: StubBackend, prompt_tokens: int) -> None:
        self.stub = stub
        self.usage = f'"prompt_tokens":{prompt_tokens}'.encode()
        assert len(self.usage) == len(b'"prompt_tokens":11')

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def rewrite(message: Any) -> None:
            if message["type"] == "http.response.body":
                message = {
                    **message,
                    "body": message.get("body", b"").replace(b'"prompt_tokens":11', self.usage),
                }
            await send(message)

        await self.stub(scope, receive, rewrite)


@pytest.fixture
async def engine() -> Any:
    served = await serve_asgi(TemplatedEngine(StubBackend(), REPORTED))
    try:
        yield served.url
    finally:
        await served.stop()


# ---- config ----


def test_model_keys_parse() -> None:
    cfg = parse_config(
        {
            "models": {
                "llama-*": {"prompt_overhead_tokens": 23, "context_length": 8192},
                "qwen-*": {"learn_prompt_overhead": False},
                "other": {},
            }
        }
    )
    got = [(m.prompt_overhead_tokens, m.learn_prompt_overhead) for m in cfg.models]
    assert got == [(23, True), (None, False), (None, True)]


@pytest.mark.parametrize(
    ("models", "message"),
    [
        (
            {"prompt_overhead_tokens": -3},
            "models.m*.prompt_overhead_tokens: expected a non-negative integer, got -3",
        ),
        (
            {"prompt_overhead_tokens": "23"},
            "models.m*.prompt_overhead_tokens: expected a non-negative integer, got '23'",
        ),
        (
            {"prompt_overhead_tokens": True},
            "models.m*.prompt_overhead_tokens: expected a non-negative integer",
        ),
        (
            {"prompt_overhead_tokens": 4096, "context_length": 4096},
            "models.m*.prompt_overhead_tokens: 4096 is not below the model's context_length (4096)",
        ),
        (
            {"learn_prompt_overhead": "yes"},
            "models.m*.learn_prompt_overhead: expected true or false, got 'yes'",
        ),
        (
            {"prompt_overhead_token": 3},
            "models.m*.prompt_overhead_token: unknown key (did you mean 'prompt_overhead_tokens'?)",
        ),
    ],
)
def test_model_key_errors_name_the_field(models: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"models": {"m*": models}})
    assert message in str(info.value)


# ---- pricing, end to end ----


async def test_prices_rise_by_the_learned_overhead_and_stats_and_metrics_show_it(
    engine: str, gateway_factory: GatewayFactory
) -> None:
    gw = await gateway_factory({"pools": stub_pools(engine)})
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        costs = []
        for i in range(MIN_SAMPLES):  # half streamed: the usage event of a stream counts too
            r = await c.post("/v1/chat/completions", json=hello(stream=i % 2 == 1))
            assert r.status_code == 200
            costs.append(int(r.headers["x-tokengate-cost"]))
        assert costs == [PRICED + MAX_TOKENS] * MIN_SAMPLES  # as priced, while it learns
        r = await c.post("/v1/chat/completions", json=hello())
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == REPORTED
        assert int(r.headers["x-tokengate-cost"]) == REPORTED + MAX_TOKENS  # priced 8 + learned 39
        # Another route of the same model has its own overhead (no chat template: nothing yet).
        r = await c.post("/v1/completions", json={"model": "stub-model", "prompt": "hello", "max_tokens": 5})
        assert r.status_code == 200 and int(r.headers["x-tokengate-cost"]) < REPORTED
    async with httpx.AsyncClient(base_url=gw.ops_url, timeout=30) as ops:
        pricing = (await ops.get("/stats")).json()["pricing"]
        assert pricing["min_samples"] == MIN_SAMPLES and pricing["half_life_requests"] > 0
        row = next(m for m in pricing["models"] if m["route"] == "chat")
        assert row["model"] == "stub-model" and row["samples"] == MIN_SAMPLES + 1
        assert (row["mean_priced"], row["mean_reported"]) == (PRICED, REPORTED)
        assert row["learned_overhead"] == row["applied_overhead"] == REPORTED - PRICED
        assert row["configured_overhead"] is None and row["pattern"] is None
        assert row["error_before"] == REPORTED - PRICED and row["error_after"] < row["error_before"]
        metrics = (await ops.get("/metrics")).text
        assert 'tokengate_prompt_overhead_tokens{model="stub-model",route="chat"} 39.0' in metrics


async def test_a_configured_overhead_prices_chat_at_once_and_learning_can_be_off(
    engine: str, gateway_factory: GatewayFactory
) -> None:
    gw = await gateway_factory(
        {
            "pools": stub_pools(engine),
            "models": {"stub-*": {"prompt_overhead_tokens": 20, "learn_prompt_overhead": False}},
        }
    )
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        for _ in range(MIN_SAMPLES + 1):
            r = await c.post("/v1/chat/completions", json=hello())
            assert int(r.headers["x-tokengate-cost"]) == PRICED + 20 + MAX_TOKENS  # configured, not learned
        completion = {"model": "stub-model", "prompt": "hello", "max_tokens": 5}
        first = int((await c.post("/v1/completions", json=completion)).headers["x-tokengate-cost"])
        for _ in range(MIN_SAMPLES):
            r = await c.post("/v1/completions", json=completion)
        assert int(r.headers["x-tokengate-cost"]) == first  # no template there, and learning is off
    async with httpx.AsyncClient(base_url=gw.ops_url, timeout=30) as ops:
        st = (await ops.get("/stats")).json()
    chat = next(m for m in st["pricing"]["models"] if m["route"] == "chat")
    assert (chat["configured_overhead"], chat["applied_overhead"], chat["learning"]) == (20, 20, False)
    assert chat["learned_overhead"] == REPORTED - PRICED and chat["pattern"] == "stub-*"
    assert chat["error_after"] == REPORTED - PRICED - 20
    (f,) = [f for f in st["findings"] if f["topic"] == "pricing" and "(chat)" in f["text"]]
    assert f["level"] == "warn" and "models.stub-*.prompt_overhead_tokens: 39" in f["text"]


# ---- the doctor ----


def _row(**over: object) -> dict[str, object]:
    row: dict[str, object] = {
        "model": "llama",
        "route": "chat",
        "pattern": None,
        "samples": 50,
        "rejected": 0,
        "mean_priced": 16.0,
        "mean_reported": 39.0,
        "learned_overhead": 23,
        "configured_overhead": None,
        "learning": False,
        "applied_overhead": 0,
        "error_before": 23.0,
        "error_after": 23.0,
    }
    row.update(over)
    return row


def _stats(*rows: dict[str, object]) -> dict[str, object]:
    return {
        "pricing": {
            "half_life_requests": 64,
            "min_samples": 8,
            "max_models": 256,
            "untracked": 0,
            "models": list(rows),
        }
    }


def test_a_large_pricing_error_is_a_finding_naming_the_model_and_the_key_to_set() -> None:
    (f,) = [f for f in diagnose(_stats(_row())) if f.topic == "pricing"]
    assert f.level == "warn" and "model llama (chat)" in f.text and "off by 23 tokens" in f.text
    assert "overhead applied +0 (learning off)" in f.text
    assert "models.llama.prompt_overhead_tokens: 23" in f.text
    # A configured overhead that is wrong: named as such.
    (f,) = [
        f
        for f in diagnose(
            _stats(_row(pattern="llama-*", configured_overhead=5, applied_overhead=5, error_after=18.0))
        )
        if f.topic == "pricing"
    ]
    assert "(configured)" in f.text and "models.llama-*.prompt_overhead_tokens: 23" in f.text
    # Corrected on average, yet far off request by request: the tokenizer is not the model's.
    varies = _row(
        learning=True, applied_overhead=23, error_after=30.0, error_before=35.0, mean_reported=100.0
    )
    (f,) = [f for f in diagnose(_stats(varies)) if f.topic == "pricing"]
    assert f.level == "warn" and "models.llama.tokenizer" in f.text


def test_small_errors_too_few_samples_and_a_working_correction() -> None:
    small = _row(error_before=6.0, error_after=6.0)  # under 8 tokens
    relative = _row(mean_reported=4000.0, error_before=300.0, error_after=300.0)  # under 20 %
    early = _row(samples=7)
    assert [f for f in diagnose(_stats(small, relative, early)) if f.topic == "pricing"] == []
    working = _row(learning=True, applied_overhead=23, error_after=1.0)
    (f,) = [f for f in diagnose(_stats(working)) if f.topic == "pricing"]
    assert f.level == "info" and "learned overhead corrects it (mean error 23 -> 1 tokens)" in f.text
    assert "models.llama.prompt_overhead_tokens: 23" in f.text


def test_the_doctor_prints_the_pricing_table() -> None:
    stats = _stats(_row(learning=True, applied_overhead=23, error_after=1.0))
    out = io.StringIO()
    doctor.report(stats, diagnose(stats), "http://gw", out)
    table = out.getvalue().split("Prompt pricing")[1]
    assert "llama" in table and "+23 (learned)" in table and "23 / 1" in table
