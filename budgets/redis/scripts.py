"""The Redis store's Lua code: one function library on Redis 7 (FCALL), EVALSHA scripts before it.

The sources are ``budgets/redis/lua/*.lua``: ``lib.lua`` (the port of budgets/policy.py) and one
entry file per operation, each defining ``<name>_main(A)``. They run in one of two ways:

* **function library** (Redis >= 7, the default): every file in one library named
  ``tokengate_<digest>``, one function ``tg_<digest>_<name>`` per entry, loaded once with
  ``FUNCTION LOAD`` and run with ``FCALL``. Loaded once, the library's ~100 local functions are
  defined once; an EVAL runs its whole source on every call, which cost ~45 us of Redis CPU per
  call on the development VM before the first line of the operation ran. The source digest in
  both names lets replicas of two versions share one Redis during a rolling upgrade (each calls
  its own library; an old library stays until ``FUNCTION DELETE``).
* **scripts** (Redis 6, or a server that refuses ``FUNCTION``): per entry, ``lib.lua`` + its
  files + the call, one self-contained source with its own SHA1, run with ``EVALSHA``.

Both wrap an entry as ``begin(keys, args); reply = { <name>_main(own_args(args)), LOCAL }; flush()``
(the reply plus the wake-ups for the calling replica, which budgets/redis/replies.py parses; ``flush``
writes the hashes lib.lua writes behind, see its "state").

The runner starts with the library. ``FCALL`` answered "unknown command" (Redis < 7) or NOPERM
(an ACL without it), or a ``FUNCTION LOAD`` refused, switches it to scripts for good. Code Redis has lost (a
restart without persistence, ``FUNCTION FLUSH``, ``SCRIPT FLUSH``) is answered "Function not
found" or ``NOSCRIPT``; nothing ran, so the runner loads the code and sends the call once more.

Two transports: redis-py (``call``) and the store's lean pipelined connection (``call_resp``,
budgets/redis/resp.py), whose ``FCALL <function> 1 <key>`` prefix is encoded once per entry and key.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoPermissionError, NoScriptError, ResponseError

from budgets.redis import resp

_log = logging.getLogger(__name__)

# Entry -> the files it is made of (after lib.lua); each file defines <file>_main(A).
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
    "quota_reserve": ("quota", "quota_reserve"),
    "quota_settle": ("quota", "quota_settle"),
    "quota_beat": ("quota", "quota_beat"),
    "quota_expire": ("quota", "quota_expire"),
    "quota_usage": ("quota", "quota_usage"),
    "quota_reset": ("quota", "quota_reset"),
    "usage_add": ("usage_add",),
    "usage_read": ("usage_read",),
}

FUNCTIONS = "functions"
SCRIPTS = "scripts"


@dataclass(frozen=True, slots=True)
class Script:
    name: str
    source: str
    sha: str


@dataclass(frozen=True, slots=True)
class Library:
    """Every entry as a Redis 7 function library: ``code`` for FUNCTION LOAD, entry -> function name."""

    name: str
    code: str
    functions: dict[str, str]


def _read(name: str) -> str:
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


_CALL = "begin(KEYS, ARGV)\nlocal reply = { %s_main(own_args(ARGV)), LOCAL }\nflush()\nreturn reply\n"

_REGISTER = """redis.register_function('%s', function(keys, args)
  begin(keys, args)
  local reply = { %s_main(own_args(args)), LOCAL }
  flush()
  return reply
end)
"""


def _files(parts: Sequence[str]) -> str:
    return "\n".join(f"-- ==== {part}.lua ====\n{_read(part)}" for part in parts)


def load_scripts() -> dict[str, Script]:
    lib = _read("lib")
    scripts = {}
    for name, parts in ENTRY_SCRIPTS.items():
        source = f"{lib}\n{_files(parts)}\n{_CALL % name}"
        scripts[name] = Script(name, source, hashlib.sha1(source.encode()).hexdigest())
    return scripts


def load_library() -> Library:
    parts = list(dict.fromkeys(part for files in ENTRY_SCRIPTS.values() for part in files))
    body = f"{_read('lib')}\n{_files(parts)}\n"
    digest = hashlib.sha1(body.encode()).hexdigest()[:16]
    functions = {name: f"tg_{digest}_{name}" for name in ENTRY_SCRIPTS}
    registrations = "".join(_REGISTER % (fn, name) for name, fn in functions.items())
    name = f"tokengate_{digest}"
    return Library(name, f"#!lua name={name}\n{body}{registrations}", functions)


def _no_fcall(message: str) -> bool:
    """FCALL cannot run here: Redis < 7 ("ERR unknown command `FCALL`, ...") or an ACL without it
    ("NOPERM ..."). A NOPERM about keys fails the same way as a script and is raised from there."""
    return "unknown command" in message.lower() or message.startswith("NOPERM")


class ScriptRunner:
    """Runs the entries by name, loading the code when Redis does not have it."""

    def __init__(self, scripts: dict[str, Script] | None = None, *, functions: bool = True) -> None:
        self.scripts = scripts if scripts is not None else load_scripts()
        # Custom scripts (tests) have no library; they always run as scripts.
        self.library: Library | None = load_library() if scripts is None and functions else None
        self.reloads = 0  # code loaded again after Redis had lost it (restarted or flushed)
        self._prefixes: dict[tuple[bool, str, str], resp.CommandPrefix] = {}

    @property
    def mode(self) -> str:
        """``functions`` (FCALL of the library) or ``scripts`` (EVALSHA)."""
        return FUNCTIONS if self.library is not None else SCRIPTS

    def _use_scripts(self, why: str) -> None:
        if self.library is not None:
            _log.warning("redis: running the budget code as EVALSHA scripts, not functions (%s)", why)
            self.library = None

    def _resend_after(self, message: str, *, missing: bool, denied: bool = False) -> bool:
        """Whether a call answered with this error ran nothing and should be sent again: the code
        is missing (load it), or FCALL cannot run here (``denied``, or Redis < 7: now scripts)."""
        if missing:
            return True
        if self.library is not None and (denied or _no_fcall(message)):
            self._use_scripts(message)
            return True
        return False

    def must_resend(self, err: BaseException) -> bool:
        """``_resend_after`` for an error of the lean connection; the call is sent again through
        ``call_resp``."""
        if not isinstance(err, resp.ReplyError):
            return False
        return self._resend_after(str(err), missing=isinstance(err, resp.NoScriptError))

    async def _load(self, execute: Callable[..., Awaitable[Any]], name: str) -> None:
        """Load the library (or entry ``name``'s script) with either transport's ``execute``."""
        if self.library is not None:
            try:
                await execute("FUNCTION", "LOAD", self.library.code)
                return
            except (ResponseError, resp.ReplyError) as err:
                if "already exists" in str(err):
                    return  # another replica loaded it first
                self._use_scripts(f"FUNCTION LOAD: {err}")
        await execute("SCRIPT", "LOAD", self.scripts[name].source)

    # ---- redis-py ----

    async def call(self, client: Redis, name: str, keys: Sequence[str], args: Sequence[str]) -> Any:
        try:
            return await self._send(client, name, keys, args)
        except ResponseError as err:
            # redis-py strips the code ("ERR ", "NOPERM ") and has its own classes for some.
            message = str(err)
            missing = isinstance(err, NoScriptError) or message.startswith("Function not found")
            if not self._resend_after(message, missing=missing, denied=isinstance(err, NoPermissionError)):
                raise
            if missing:
                self.reloads += 1
        await self._load(client.execute_command, name)
        return await self._send(client, name, keys, args)

    async def _send(self, client: Redis, name: str, keys: Sequence[str], args: Sequence[str]) -> Any:
        if self.library is not None:
            return await client.fcall(self.library.functions[name], len(keys), *keys, *args)  # type: ignore[misc]
        return await client.evalsha(self.scripts[name].sha, len(keys), *keys, *args)  # type: ignore[misc]

    # ---- the lean connection ----

    def _payload(self, name: str, key: str, args: Sequence[str]) -> bytes:
        functions = self.library is not None
        prefix = self._prefixes.get((functions, name, key))
        if prefix is None:
            if self.library is not None:
                prefix = resp.CommandPrefix("FCALL", self.library.functions[name], "1", key)
            else:
                prefix = resp.CommandPrefix("EVALSHA", self.scripts[name].sha, "1", key)
            self._prefixes[(functions, name, key)] = prefix
        return prefix.build(args)

    def send_resp_nowait(
        self, conn: resp.RespConnection, name: str, key: str, args: Sequence[str]
    ) -> asyncio.Future[Any] | None:
        """The call written at once on an open connection (None when it is not open). The caller
        checks an error with ``must_resend`` and sends again through ``call_resp``."""
        return conn.send_nowait(self._payload(name, key, args))

    async def call_resp(self, conn: resp.RespConnection, name: str, key: str, args: Sequence[str]) -> Any:
        """One call over the lean connection with one declared key; lost code is loaded and the
        call sent once more."""
        try:
            return await conn.request(self._payload(name, key, args))
        except resp.ReplyError as err:
            if not self.must_resend(err):
                raise
            if isinstance(err, resp.NoScriptError):
                self.reloads += 1
        await self._load(conn.execute, name)
        return await conn.request(self._payload(name, key, args))
