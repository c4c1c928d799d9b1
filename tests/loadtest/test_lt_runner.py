import asyncio
import dataclasses
import statistics

import pytest

from loadtest.processes import free_port
from loadtest.prompts import PromptFactory
from loadtest.records import RequestRecord
from loadtest.runner import RunOptions, Target, run_plan
from loadtest.schedule import PlannedRequest
from loadtest.spec import SendMaxTokens
from tests.loadtest.conftest import StubFactory


def _plan(
    n: int, gap_s: float, *, tenant: str = "a", output: int = 10, start: float = 0.0
) -> list[PlannedRequest]:
    return [
        PlannedRequest(
            index=i,
            at_s=start + i * gap_s,
            cls="c",
            group="c",
            tenant=tenant,
            api_key=f"sk-{tenant}",
            prompt_tokens=40,
            output_tokens=output,
            seed=i,
        )
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def prompts() -> PromptFactory:
    return PromptFactory()


async def test_ttft_itl_and_e2e_match_the_stub_delays(
    stub_factory: StubFactory, prompts: PromptFactory
) -> None:
    stub = await stub_factory(first_token_delay_s=0.12, inter_token_delay_s=0.02)
    result = await run_plan(_plan(8, 0.05), Target("stub", (stub.url,)), prompts, RunOptions())
    assert all(r.ok for r in result.records), [r.error for r in result.records]
    ttfts = [r.ttft_s for r in result.records if r.ttft_s is not None]
    assert len(ttfts) == 8
    # Lower bound is exact (the stub sleeps at least that long); the upper one leaves room for a busy CI box.
    assert min(ttfts) >= 0.12
    assert statistics.median(ttfts) == pytest.approx(0.12, abs=0.06)
    gaps = [g for r in result.records for g in r.inter_token_gaps()]
    assert statistics.median(gaps) == pytest.approx(0.02, abs=0.015)
    for r in result.records:
        assert r.completion_tokens == 10 and len(r.token_times) == 10
        assert r.prompt_tokens == 40 - 7  # chat overhead subtracted from the content
        assert r.e2e_s is not None and r.e2e_s >= 0.12 + 9 * 0.02


async def test_errors_are_counted_by_status(stub_factory: StubFactory, prompts: PromptFactory) -> None:
    stub = await stub_factory(
        first_token_delay_s=0.0, inter_token_delay_s=0.0, fail_keys={"sk-b": 429, "sk-c": 500}
    )
    plan = _plan(3, 0.01, tenant="a") + _plan(2, 0.01, tenant="b") + _plan(4, 0.01, tenant="c")
    result = await run_plan(plan, Target("stub", (stub.url,)), prompts, RunOptions())
    errors = [r.error for r in result.records]
    assert errors.count(None) == 3
    assert errors.count("http_429") == 2
    assert errors.count("http_500") == 4
    assert all(
        r.status == 500 and "stub failure" in (r.detail or "") for r in result.records if r.tenant == "c"
    )


async def test_connection_refused_is_an_error_not_a_crash(prompts: PromptFactory) -> None:
    port = free_port()  # nothing listens there
    result = await run_plan(
        _plan(2, 0.01), Target("dead", (f"http://127.0.0.1:{port}",)), prompts, RunOptions()
    )
    assert [r.error for r in result.records] == ["connect", "connect"]


async def test_round_robin_over_base_urls(stub_factory: StubFactory, prompts: PromptFactory) -> None:
    a = await stub_factory(first_token_delay_s=0.0, inter_token_delay_s=0.0)
    b = await stub_factory(first_token_delay_s=0.0, inter_token_delay_s=0.0)
    result = await run_plan(_plan(10, 0.005), Target("rr", (a.url, b.url)), prompts, RunOptions())
    assert a.requests == 5 and b.requests == 5
    assert all(r.ok for r in result.records)


async def test_open_loop_sends_on_schedule_while_earlier_requests_are_slow(
    stub_factory: StubFactory, prompts: PromptFactory
) -> None:
    stub = await stub_factory(first_token_delay_s=1.0, inter_token_delay_s=0.0)
    result = await run_plan(_plan(10, 0.05, output=2), Target("slow", (stub.url,)), prompts, RunOptions())
    lateness = [r.sent_s - r.scheduled_s for r in result.records]
    assert max(lateness) < 0.2  # a closed-loop client would have waited ~1 s per request
    sends = [r.sent_s for r in result.records]
    assert sends[-1] - sends[0] < 1.0
    assert all(r.ok for r in result.records)


async def test_bounded_by_count_time_and_drain(stub_factory: StubFactory, prompts: PromptFactory) -> None:
    stub = await stub_factory(first_token_delay_s=0.0, inter_token_delay_s=0.0)
    result = await run_plan(_plan(50, 0.01), Target("s", (stub.url,)), prompts, RunOptions(max_requests=7))
    assert len(result.records) == 7 and result.planned == 7
    result = await run_plan(_plan(50, 0.01), Target("s", (stub.url,)), prompts, RunOptions(duration_s=0.095))
    assert len(result.records) == 10

    slow = await stub_factory(first_token_delay_s=5.0, inter_token_delay_s=0.0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    result = await run_plan(
        _plan(3, 0.01), Target("s", (slow.url,)), prompts, RunOptions(drain_timeout_s=0.3)
    )
    assert loop.time() - started < 2.0
    assert [r.error for r in result.records] == ["cancelled"] * 3


async def test_gateway_headers_and_non_streaming(stub_factory: StubFactory, prompts: PromptFactory) -> None:
    headers = {"x-tokengate-class": "short", "x-tokengate-cost": "123", "x-tokengate-queue-ms": "4.5"}
    stub = await stub_factory(first_token_delay_s=0.05, inter_token_delay_s=0.0, headers=headers)
    result = await run_plan(_plan(2, 0.01), Target("gw", (stub.url,)), prompts, RunOptions(stream=False))
    rec: RequestRecord = result.records[0]
    assert rec.ok and rec.gateway_class == "short" and rec.gateway_cost == 123 and rec.gateway_queue_ms == 4.5
    assert rec.completion_tokens == 10
    assert rec.ttft_s is not None and rec.ttft_s >= 0.05


async def test_completions_endpoint(stub_factory: StubFactory, prompts: PromptFactory) -> None:
    stub = await stub_factory(first_token_delay_s=0.0, inter_token_delay_s=0.0)
    options = RunOptions(endpoint="completions", chat_overhead_tokens=0)
    result = await run_plan(_plan(2, 0.01), Target("c", (stub.url,)), prompts, options)
    assert all(r.ok and r.prompt_tokens == 40 and r.url.endswith("/v1/completions") for r in result.records)


@pytest.mark.parametrize(
    ("send", "sent"),
    [("planned", [7, 9]), (4096, [4096, 4096]), ("none", [None, None])],
)
async def test_what_a_request_sends_as_max_tokens_while_the_planned_output_still_comes_back(
    stub_factory: StubFactory, prompts: PromptFactory, send: SendMaxTokens, sent: list[int | None]
) -> None:
    stub = await stub_factory(first_token_delay_s=0.0, inter_token_delay_s=0.0)
    plan = _plan(2, 0.05)
    plan = [dataclasses.replace(plan[0], output_tokens=7), dataclasses.replace(plan[1], output_tokens=9)]
    result = await run_plan(plan, Target("s", (stub.url,)), prompts, RunOptions(send_max_tokens=send))
    stop_after = [None, None] if send == "planned" else [7, 9]
    # The oracle header always says the planned output; the stub records what it received.
    assert stub.limits == list(zip(sent, stop_after, ["7", "9"], strict=True))
    assert [(r.max_tokens, r.planned_output_tokens, r.completion_tokens) for r in result.records] == [
        (sent[0], 7, 7),
        (sent[1], 9, 9),
    ]
