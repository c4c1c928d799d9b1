"""Where the budget scripts' Lua spends its work, by function and line: a sampling profile in Redis.

Run: ``python -m research.lua_profile --redis-server PATH [--sizes 10:100,10000:100000]``

Redis' own counters see a script call whole (``INFO commandstats``, ``SLOWLOG``), and callgrind
(``research.redis_instructions``) sees the Lua interpreter's C functions, not the Lua lines
they run: in a batched cycle the interpreter is about half of what Redis executes. This tool loads
the store's function library with a count hook in every function (``debug.sethook``, one sample
every ``--every`` Lua VM instructions, counting the line it interrupts), runs the scale benchmark's
cycles (``loadtest.bench.scale``: one saturated pool, ``tenants`` tenants, ``tickets`` waiting
tickets, warmed to the steady state first), and prints samples per cycle by function and by line
over the measured window; with two sizes or more, also how each function grew from the first size
to the last.

Samples count VM instructions, not time: a ``redis.call`` is one instruction however long its
command runs (the commands' time is ``loadtest.bench.scale --commandstats``), and neither the
collector nor ``malloc`` shows here (callgrind does). The hook slows the calls, so rates printed
here are not the benchmark's.

Redis takes the ``debug`` global away once its scripting engine is set up, so this needs a
redis-server built without that line, for profiling only, never to run a gateway against:

    curl -O http://deb.debian.org/debian/pool/main/r/redis/redis_7.0.15.orig.tar.gz
    tar xzf redis_7.0.15.orig.tar.gz && cd redis-7.0.15
    sed -i 's/"debug = nil\\\\n"/"\\\\n"/' src/function_lua.c src/eval.c
    make -j2 BUILD_TLS=no          # then --redis-server redis-7.0.15/src/redis-server

A stock Redis answers the profiler's first call with "nonexistent global variable 'debug'"; the
tool says so and stops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from budgets.redis.scripts import Library, load_library
from loadtest.bench import scale
from loadtest.redis_server import REDIS_SERVER, RedisServer, add_redis_option, config_args

DUMP = "tg_profile_dump"  # (the name _PROFILER registers)

# Lua put before the library's registrations: the sample counts (line -> samples, kept across
# calls while the library is loaded) and the function that returns and clears them.
_PROFILER = """
local PROFILE = {}
local function profile_hook()
  local info = debug.getinfo(2, 'l')
  if info then
    local line = info.currentline
    PROFILE[line] = (PROFILE[line] or 0) + 1
  end
end
redis.register_function('tg_profile_dump', function(keys, args)
  local _ = debug.sethook -- (fails here, on the first call, in a Redis that took ``debug`` away)
  local out = {}
  for line, n in next, PROFILE do -- (`pairs` is a library local, bound by begin)
    out[#out + 1] = line
    out[#out + 1] = n
  end
  PROFILE = {}
  return out
end)
"""


def profiled_library(lib: Library, every: int) -> Library:
    """``lib`` with the hook on from each registered function's ``begin`` to its return, and
    ``tg_profile_dump`` (returns line, samples, ... and clears them). Line numbers stay those of
    ``lib.code``: everything is added after the last line of the entry files."""
    code = lib.code
    first = code.index("redis.register_function(")
    begin = "  begin(keys, args)\n"
    end = "  flush()\n  return reply\n"
    registrations = code[first:]
    n = registrations.count(begin)
    if n != len(lib.functions) or registrations.count(end) != n:
        raise ValueError("the library's registrations are not the shape this profiler patches")
    registrations = registrations.replace(begin, f"  debug.sethook(profile_hook, '', {every})\n{begin}")
    registrations = registrations.replace(end, "  flush()\n  debug.sethook()\n  return reply\n")
    return Library(lib.name, code[:first] + _PROFILER + registrations, lib.functions)


@dataclass(frozen=True, slots=True)
class Place:
    file: str  # lib.lua, acquire.lua, ...
    line: int  # in that file
    function: str  # the enclosing ``local function`` (or the file, outside any)
    text: str


def places(code: str) -> list[Place]:
    """Each line of a library's code (1-based, as Lua numbers them: ``places(code)[n - 1]``), with
    its file, the line in that file and the function it belongs to."""
    out: list[Place] = []
    file, start, function = "lib.lua", 2, "lib.lua"  # (line 1 is the library's #!lua header)
    for n, text in enumerate(code.split("\n"), start=1):
        if text.startswith("-- ==== ") and text.endswith(" ===="):
            file, start, function = text[8:-5], n + 1, text[8:-5]
        elif text.startswith("redis.register_function("):
            file, start, function = "(registrations)", n, "(registrations)"
        elif text.startswith("local function "):
            function = text[len("local function ") :].split("(")[0]
        out.append(Place(file, n - start + 1 if n >= start else 0, function, text.strip()))
    return out


def by_function(samples: dict[int, int], where: list[Place]) -> Counter[str]:
    out: Counter[str] = Counter()
    for line, n in samples.items():
        out[where[line - 1].function if 0 < line <= len(where) else "?"] += n
    return out


async def profile_point(
    url: str, lib: Library, tenants: int, tickets: int, seconds: float, window: int, warm_rounds: float
) -> dict[str, Any]:
    samples: dict[int, int] = {}

    async def marks(client: Redis, started: bool) -> None:
        reply = await client.execute_command("FCALL", DUMP, 0)  # clears what the warm-up left
        if not started:
            samples.update({int(reply[i]): int(reply[i + 1]) for i in range(0, len(reply), 2)})

    row = await scale.redis_cycles(
        url,
        tenants,
        tickets,
        seconds,
        window,
        True,
        "functions",
        warm_rounds=warm_rounds,
        library=lib,
        window_marks=marks,
    )
    return {"tenants": tenants, "tickets": tickets, "cycles": row["cycles"], "samples": samples}


def report(points: list[dict[str, Any]], where: list[Place], top: int) -> None:
    for p in points:
        cycles = max(1, p["cycles"])
        total = sum(p["samples"].values()) / cycles
        print(
            f"\n{p['tenants']} tenants, {p['tickets']} tickets: {total:.1f} samples per cycle ({p['cycles']} cycles)"
        )
        for name, n in by_function(p["samples"], where).most_common(top):
            print(f"  {n / cycles:7.2f}  {name}")
        print("  lines:")
        for line, n in sorted(p["samples"].items(), key=lambda kv: -kv[1])[:top]:
            at = where[line - 1] if 0 < line <= len(where) else Place("?", line, "?", "")
            print(f"  {n / cycles:7.2f}  {at.file}:{at.line:<5} {at.text[:80]}")
    if len(points) >= 2:
        a, b = points[0], points[-1]
        fa, fb = by_function(a["samples"], where), by_function(b["samples"], where)
        ca, cb = max(1, a["cycles"]), max(1, b["cycles"])
        print(f"\ngrowth per cycle, {a['tenants']} -> {b['tenants']} tenants:")
        growth = sorted(set(fa) | set(fb), key=lambda f: -(fb[f] / cb - fa[f] / ca))
        for name in growth[:top]:
            print(f"  {fa[name] / ca:7.2f} -> {fb[name] / cb:7.2f}  {name}")


async def run(args: argparse.Namespace, server_args: list[str]) -> list[dict[str, Any]]:
    lib = profiled_library(load_library(), args.every)
    server = RedisServer(extra_args=server_args, executable=args.redis_server).start()
    try:
        client = Redis.from_url(server.url)
        try:
            await client.function_load(lib.code, replace=True)
            await client.execute_command("FCALL", DUMP, 0)
        except ResponseError as e:  # no `debug`: a stock redis-server
            raise SystemExit(f"{args.redis_server} refused the profiled library ({e}); see --help") from None
        finally:
            await client.aclose()
        points = []
        for tenants, tickets in scale.sizes(args.sizes):
            points.append(
                await profile_point(
                    server.url, lib, tenants, tickets, args.seconds, args.window, args.warm_rounds
                )
            )
        return points
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m research.lua_profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--redis-server", default=REDIS_SERVER, help="a redis-server that keeps `debug` (see above)"
    )
    p.add_argument("--sizes", default="10:100,10000:100000", help="tenants:tickets,... (default %(default)s)")
    p.add_argument("--seconds", type=float, default=4.0, help="measured seconds per point")
    p.add_argument("--window", type=int, default=32, help="cycles per batch call (default %(default)s)")
    p.add_argument("--warm-rounds", type=float, default=1.0, help="as loadtest.bench.scale's")
    p.add_argument("--every", type=int, default=100, help="Lua VM instructions per sample")
    p.add_argument("--top", type=int, default=25, help="functions and lines listed per point")
    add_redis_option(p)
    p.add_argument("--json", help="write the samples here")
    args = p.parse_args(argv)
    if shutil.which(args.redis_server) is None:
        p.error(f"--redis-server {args.redis_server!r}: no such executable (see --help for how to build one)")
    try:
        server_args = config_args(args.redis_option)
    except ValueError as e:
        p.error(str(e))
    points = asyncio.run(run(args, server_args))
    report(points, places(load_library().code), args.top)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(points, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
