"""The Redis store's Lua scripts: loaded once from package data, run with EVALSHA, reloaded on NOSCRIPT.

The sources are ``budgets/redis/lua/*.lua``. Redis scripts cannot include each other, so
``lib.lua`` (the port of budgets/policy.py) is prepended to every entry script here and a call of
its ``<name>_main(A)`` appended, returning ``{ reply, LOCAL }`` (the reply plus the wake-ups for
the calling replica; budgets/redis/replies.py parses the replies); each result is one
self-contained source with its own SHA1. A restarted Redis has an empty script cache: the first
EVALSHA then answers NOSCRIPT, the runner loads the source and retries once (NOSCRIPT means
nothing ran, so the retry cannot apply an operation twice).

Two transports: redis-py (``call``) and the store's lean pipelined connection (``call_resp``,
budgets/redis/resp.py), whose ``EVALSHA <sha> 1 <key>`` prefix is encoded once per script and key.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from budgets.redis import resp

# Entry script -> the files it is made of (after lib.lua); each file defines <file>_main(A).
ENTRY_SCRIPTS: dict[str, tuple[str, ...]] = {
    "acquire": ("acquire",),
    "release": ("release",),
    "batch": ("acquire", "release", "batch"),
    "withdraw": ("withdraw",),
    "status": ("status",),
    "heartbeat": ("heartbeat",),
    "extend": ("extend",),
    "restore": ("restore",),
    "reap": ("reap",),
    "apply_layout": ("apply_layout",),
}


@dataclass(frozen=True, slots=True)
class Script:
    name: str
    source: str
    sha: str


def _read(name: str) -> str:
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


_CALL = """
local A = {}
for i = 3, #ARGV do
  A[#A + 1] = ARGV[i]
end
return { %s_main(A), LOCAL }
"""


def load_scripts() -> dict[str, Script]:
    lib = _read("lib")
    scripts = {}
    for name, parts in ENTRY_SCRIPTS.items():
        bodies = "\n".join(f"-- ==== {part}.lua ====\n{_read(part)}" for part in parts)
        source = f"{lib}\n{bodies}{_CALL % name}"
        scripts[name] = Script(name, source, hashlib.sha1(source.encode()).hexdigest())
    return scripts


class ScriptRunner:
    def __init__(self, scripts: dict[str, Script] | None = None) -> None:
        self.scripts = scripts if scripts is not None else load_scripts()
        self.reloads = 0  # NOSCRIPT answers seen (a restarted or flushed Redis)
        self._prefixes: dict[tuple[str, str], resp.CommandPrefix] = {}

    async def call(self, client: Redis, name: str, keys: Sequence[str], args: Sequence[str]) -> Any:
        script = self.scripts[name]
        try:
            return await client.evalsha(script.sha, len(keys), *keys, *args)  # type: ignore[misc]
        except NoScriptError:
            self.reloads += 1
            await client.script_load(script.source)
            return await client.evalsha(script.sha, len(keys), *keys, *args)  # type: ignore[misc]

    def _payload(self, name: str, key: str, args: Sequence[str]) -> bytes:
        prefix = self._prefixes.get((name, key))
        if prefix is None:
            prefix = resp.CommandPrefix("EVALSHA", self.scripts[name].sha, "1", key)
            self._prefixes[(name, key)] = prefix
        return prefix.build(args)

    def send_resp_nowait(
        self, conn: resp.RespConnection, name: str, key: str, args: Sequence[str]
    ) -> asyncio.Future[Any] | None:
        """EVALSHA written at once on an open connection (None when it is not open). The caller
        handles NOSCRIPT (nothing ran) by going through ``call_resp``."""
        return conn.send_nowait(self._payload(name, key, args))

    async def call_resp(self, conn: resp.RespConnection, name: str, key: str, args: Sequence[str]) -> Any:
        """EVALSHA over the lean connection with one declared key; NOSCRIPT -> SCRIPT LOAD + retry."""
        payload = self._payload(name, key, args)
        try:
            return await conn.request(payload)
        except resp.NoScriptError:
            self.reloads += 1
            await conn.execute("SCRIPT", "LOAD", self.scripts[name].source)
            return await conn.request(payload)
