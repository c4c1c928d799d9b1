"""Benchmarks, each runnable on its own (``--help`` for knobs; results and the commands that
produced them: docs/benchmarks.md):

* ``python -m loadtest.bench.overhead`` (``make bench``): direct vs a bare proxy vs tokengate,
  latency, throughput and CPU per request; ``--redis`` adds the gateway on the Redis store;
* ``python -m loadtest.bench.redis``: the Redis budget store's grant+release latency and throughput
  against the memory store;
* ``python -m loadtest.bench.pricing``: the time to price a ~28k-token chat prompt.
* ``python -m loadtest.bench.scale``: admission at scale: one saturated pool, 10 to 100,000
  waiting tenants and up to 1,000,000 waiting tickets, both stores (cycles/s, grant-pass and
  script-call p99, memory per tenant, ticket and lease).

* ``python -m loadtest.bench.envoy``: tokengate behind Envoy (``tokengate extproc``) against Envoy
  alone and ``tokengate serve``: CPU per request of every process on the path, added latency,
  ext_proc messages per request.
* ``python -m loadtest.bench.held_memory``: the gateway's memory against the request bodies it holds.
* ``python -m loadtest.bench.vllm_closed_loop``: a real vLLM saturated, direct and through tokengate.

``servers`` holds the stub backend and the bare proxy the overhead benchmark measures against.
Unlike the rest of ``loadtest``, which talks to tokengate only over HTTP, the store and pricing
benchmarks call the library directly: they measure it in-process. Instruments for research
(instruction counts, Lua profiles) are in ``research/``, outside the package.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.observe.percentile import percentile


def percentile_ms(seconds: Iterable[float], p: float) -> float:
    """The p-th percentile of durations in seconds, in milliseconds; NaN when there are none."""
    value = percentile(seconds, p)
    return float("nan") if value is None else value * 1e3


def latency_summary(agg: dict[str, Any]) -> dict[str, Any]:
    """A target's load runs added up (``latencies`` of the measured windows, ``errors``,
    ``seconds`` measured): requests, errors, p50/p99 in ms, requests/s."""
    lat = agg["latencies"]
    return {
        "requests": len(lat),
        "errors": agg["errors"],
        "p50_ms": percentile_ms(lat, 50),
        "p99_ms": percentile_ms(lat, 99),
        "rps": len(lat) / agg["seconds"],
    }
