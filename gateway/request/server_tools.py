"""Which server-run tools a tenant may have the engine run for a Responses request.

An engine with a tool server (vLLM ``--tool-server``: its demo browser and Python tools, or MCP
servers) runs a Responses request's built-in tools itself: ``web_search_preview`` queries the search
service on the operator's account, ``code_interpreter`` runs code in the tool server's containers,
and an ``mcp`` tool with a ``server_label`` calls whichever MCP server the engine was given under that
label — one every tenant of the endpoint can name, though it may be meant for one. A tenant's
``server_tools`` lists what it may use: tool types (``web_search_preview``, ``code_interpreter``,
...), ``mcp:<server_label>`` for one MCP server, ``mcp:*`` for any; ``[]`` allows none, and null
(the default) whatever the engine runs. Function and custom tools are the client's own and always
allowed. A request naming another is refused before anything is held or forwarded.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from classifiers.pricing import CLIENT_TOOLS
from gateway.request.errors import ApiError, show_value

_ENTRY = re.compile(r"[a-z][a-z0-9_]*|mcp:(?:\*|[^\s*]+)")


def entry_problem(entry: str) -> str | None:
    """Why ``entry`` is not a ``server_tools`` entry (None when it is one)."""
    if _ENTRY.fullmatch(entry) is None:
        return "is not a tool type (e.g. code_interpreter), 'mcp:<server_label>' or 'mcp:*'"
    return None


def server_tools(body: Mapping[str, Any]) -> list[tuple[int, str]]:
    """(index in ``tools``, name) of each tool the server would run: its type, or ``mcp:<label>``."""
    tools = body.get("tools")
    out: list[tuple[int, str]] = []
    if not isinstance(tools, list):
        return out
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            continue
        kind = tool.get("type")
        if kind in CLIENT_TOOLS:
            continue
        if kind == "mcp":
            label = tool.get("server_label")
            out.append((i, f"mcp:{label}" if isinstance(label, str) else "mcp:"))
        else:
            out.append((i, kind if isinstance(kind, str) else repr(kind)))
    return out


def check(allowed: Sequence[str] | None, body: Mapping[str, Any]) -> None:
    """A 403 ``tool_not_allowed`` for the first server-run tool ``allowed`` does not list."""
    if allowed is None:
        return
    for i, name in server_tools(body):
        if name in allowed or (name.startswith("mcp:") and "mcp:*" in allowed):
            continue
        may = ", ".join(allowed) or "none"
        raise ApiError(
            403,
            f"This API key may not use the server-run tool {show_value(name)}; server-run tools it may "
            f"use: {may}. Function tools are always allowed.",
            param=f"tools[{i}]",
            code="tool_not_allowed",
        )
