"""A tenant has the engine run only the server-side tools it may use.

An engine with a tool server (vLLM ``--tool-server``) runs a Responses request's built-in tools
itself, and an ``mcp`` tool calls whichever MCP server it knows under the ``server_label`` the
request names: every tenant could name a server meant for one, or spend the operator's search
account. Over real sockets: with ``server_tools`` set, any other server-run tool is a 403 before
anything is held or forwarded; function tools always pass."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.config.fields import ConfigError
from gateway.config.loader import parse_config
from tests.conftest import GatewayFactory, StubBackend, stub_pools

FUNCTION = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
SEARCH = {"type": "web_search_preview"}
PYTHON = {"type": "code_interpreter", "container": {"type": "auto"}}
DOCS = {"type": "mcp", "server_label": "docs", "server_url": "http://docs.internal/mcp"}
PAYROLL = {"type": "mcp", "server_label": "payroll-db"}


def config(url: str) -> dict[str, Any]:
    return {
        "pools": stub_pools(url, capacity=200_000),
        "tenants": {
            "untrusted": {"keys": ["ku"], "budget_tokens": 50_000, "server_tools": []},
            "docs-team": {
                "keys": ["kd"],
                "budget_tokens": 50_000,
                "server_tools": ["mcp:docs", "web_search_preview"],
            },
            "platform": {
                "keys": ["kp"],
                "budget_tokens": 50_000,
                "server_tools": ["mcp:*", "code_interpreter"],
            },
            "legacy": {"keys": ["kl"], "budget_tokens": 50_000},  # unset: whatever the engine runs
        },
    }


def responses(*tools: dict[str, Any]) -> dict[str, Any]:
    return {"model": "stub-model", "input": "find it", "max_output_tokens": 16, "tools": list(tools)}


@pytest.mark.parametrize(
    ("key", "allowed", "refused"),
    [
        ("ku", [], [SEARCH, PYTHON, DOCS, PAYROLL]),
        ("kd", [DOCS, SEARCH], [PYTHON, PAYROLL]),
        ("kp", [DOCS, PAYROLL, PYTHON], [SEARCH]),
        ("kl", [SEARCH, PYTHON, DOCS, PAYROLL], []),
    ],
)
async def test_server_run_tools_outside_a_tenants_list_are_a_403_before_anything_is_held(
    stub_backend: tuple[StubBackend, str],
    gateway_factory: GatewayFactory,
    key: str,
    allowed: list[dict[str, Any]],
    refused: list[dict[str, Any]],
) -> None:
    stub, url = stub_backend
    gw = await gateway_factory(config(url))
    async with httpx.AsyncClient(base_url=gw.url, headers={"authorization": f"Bearer {key}"}) as c:
        for tool in refused:
            r = await c.post("/v1/responses", json=responses(FUNCTION, tool))
            assert r.status_code == 403, (tool, r.text)
            error = r.json()["error"]
            assert (error["code"], error["param"]) == ("tool_not_allowed", "tools[1]"), error
            assert "Function tools are always allowed" in error["message"]
        assert stub.requests == []
        for tool in [FUNCTION, *allowed]:
            assert (await c.post("/v1/responses", json=responses(tool))).status_code == 200, tool
    assert len(stub.requests) == 1 + len(allowed)
    assert await gw.wait_idle() == {name: 0 for name in await gw.in_flight()}


def test_an_entry_that_is_no_tool_is_refused_at_load() -> None:
    for bad, message in [
        (["Web Search"], "tenants.t.server_tools[0]: 'Web Search' is not a tool type"),
        (["mcp:"], "tenants.t.server_tools[0]: 'mcp:' is not a tool type"),
        ("code_interpreter", None),  # one string is a list of one
    ]:
        data = {"tenants": {"t": {"keys": ["k"], "server_tools": bad}}}
        if message is None:
            assert parse_config(data).tenants[0].server_tools == ("code_interpreter",)
            continue
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse_config(data)
    assert parse_config({"tenants": {"t": {"keys": ["k"], "server_tools": []}}}).tenants[0].server_tools == ()
    assert parse_config({"tenants": {"t": {"keys": ["k"]}}}).tenants[0].server_tools is None
