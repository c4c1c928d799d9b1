"""What one ``redis.call`` costs inside a Redis function, against the same work in fewer, wider calls.

Run: ``python -m research.redis_call_cost [--fields 10000] [--calls 3200] [--rounds 200]``

The budget scripts' cycle is some 46 Redis commands a cycle (``loadtest.bench.scale
--commandstats``). Whether batching them (one ``HMGET`` or ``ZADD`` of many fields where a call makes
one command per operation) pays depends on how much of a command is the call itself (the Lua to
Redis bridge: argument objects, command lookup, the reply converted back to Lua) and how much the
work per field (a lookup in a hash or sorted set the CPU caches do not hold). This loads a function
library that does the same field work three ways on a hash and a sorted set of ``--fields`` entries:

* ``noop``: the loop and the field names alone (what the other rows carry besides their commands);
* ``hget`` / ``zadd``: one command per field;
* ``hmget`` / ``zadd_many``: one command per 32 fields;

and prints Redis' CPU (``INFO cpu``) per field for each, on a throw-away ``redis-server`` with every
hash and sorted set in its table form (``--redis-option`` as in the scale benchmark, by default the
options the scale tables used). Field names are spread over the whole key space (``i * 7919 mod
fields``), so lookups land where the previous one did not.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import redis

from loadtest.redis_server import RedisServer, add_redis_option, config_args, used_cpu_seconds

LIBRARY = """#!lua name=tg_call_cost
local function name(i, n) return 't' .. ((i * 7919) % n) end
local function names(n, fields)
  local out = {}
  for i = 1, n do out[i] = name(i, fields) end
  return out
end
redis.register_function('noop', function(keys, args)
  local n, fields = tonumber(args[1]), tonumber(args[2])
  local f = names(n, fields)
  return #f
end)
redis.register_function('hget', function(keys, args)
  local n, fields = tonumber(args[1]), tonumber(args[2])
  local f = names(n, fields)
  for i = 1, n do redis.call('HGET', keys[1], f[i]) end
  return n
end)
redis.register_function('hmget', function(keys, args)
  local n, fields = tonumber(args[1]), tonumber(args[2])
  local f = names(n, fields)
  for j = 1, n, 32 do redis.call('HMGET', keys[1], unpack(f, j, math.min(n, j + 31))) end
  return n
end)
redis.register_function('zadd', function(keys, args)
  local n, fields = tonumber(args[1]), tonumber(args[2])
  local f = names(n, fields)
  for i = 1, n do redis.call('ZADD', keys[2], i, f[i]) end
  return n
end)
redis.register_function('zadd_many', function(keys, args)
  local n, fields = tonumber(args[1]), tonumber(args[2])
  local f = names(n, fields)
  local pairs_ = {}
  for i = 1, n do pairs_[2 * i - 1] = i; pairs_[2 * i] = f[i] end
  for j = 1, 2 * n, 64 do redis.call('ZADD', keys[2], unpack(pairs_, j, math.min(2 * n, j + 63))) end
  return n
end)
"""

WAYS = ("noop", "hget", "hmget", "zadd", "zadd_many")
DEFAULT_OPTIONS = ("zset-max-listpack-entries=0", "hash-max-listpack-entries=0")


def fill(client: Any, fields: int) -> None:
    """A hash and a sorted set of ``fields`` entries each, named as the library names them."""
    client.delete("h", "z")
    for start in range(0, fields, 5000):
        chunk = range(start, min(fields, start + 5000))
        client.hset("h", mapping={f"t{i}": i for i in chunk})
        client.zadd("z", {f"t{i}": i for i in chunk})


def per_field_us(client: Any, way: str, calls: int, fields: int, rounds: int) -> float:
    """Redis CPU per field, in microseconds, of ``rounds`` function calls of ``calls`` fields each."""
    cpu0 = used_cpu_seconds(client)
    for _ in range(rounds):
        client.fcall(way, 2, "h", "z", calls, fields)
    return (used_cpu_seconds(client) - cpu0) / (calls * rounds) * 1e6


def measure(url: str, fields: int, calls: int, rounds: int, repeat: int = 2) -> dict[str, list[float]]:
    """Each way ``repeat`` times, alternated (a shared VM's speed drifts between runs)."""
    client = redis.Redis.from_url(url)
    try:
        client.function_load(LIBRARY, replace=True)
        fill(client, fields)
        out: dict[str, list[float]] = {way: [] for way in WAYS}
        for _ in range(repeat):
            for way in WAYS:
                out[way].append(per_field_us(client, way, calls, fields, rounds))
        return out
    finally:
        client.close()


def report(rows: dict[str, list[float]]) -> list[str]:
    """One line per way: its runs, and what it adds to ``noop`` per field (the commands' share)."""
    base = min(rows["noop"])
    lines = []
    for way, runs in rows.items():
        shown = " / ".join(f"{r:.3f}" for r in runs)
        extra = "" if way == "noop" else f"   (+{min(runs) - base:.3f} over noop)"
        lines.append(f"{way:10s} {shown} us per field{extra}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m research.redis_call_cost", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--fields", type=int, default=10_000, help="entries of the hash and the sorted set")
    ap.add_argument("--calls", type=int, default=3200, help="fields per function call")
    ap.add_argument("--rounds", type=int, default=200, help="function calls per measurement")
    ap.add_argument("--repeat", type=int, default=2, help="measurements per way, alternated")
    add_redis_option(ap, "a redis-server setting (repeatable; default: every hash and sorted set a table)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    if min(args.fields, args.calls, args.rounds, args.repeat) < 1:
        ap.error("--fields, --calls, --rounds and --repeat must be at least 1")
    try:
        extra = config_args(args.redis_option if args.redis_option is not None else DEFAULT_OPTIONS)
    except ValueError as exc:
        ap.error(str(exc))
    server = RedisServer(extra_args=extra).start()
    try:
        rows = measure(server.url, args.fields, args.calls, args.rounds, args.repeat)
    finally:
        server.stop()
    print("\n".join(report(rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
