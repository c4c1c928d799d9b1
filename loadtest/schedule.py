"""Turns a workload spec into a seeded, time-ordered list of planned requests (the open-loop plan)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.distributions import LengthDist
from loadtest.spec import ClassSpec, WorkloadSpec, class_rng
from loadtest.traces import TraceRecord


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    index: int
    at_s: float  # send time, seconds after the run starts
    cls: str
    group: str
    tenant: str
    api_key: str
    prompt_tokens: int
    output_tokens: int
    seed: int  # varies the prompt text per request


def poisson_arrivals(rng: random.Random, start_s: float, end_s: float, rate: float) -> list[float]:
    """Arrival times of a homogeneous Poisson process on [start_s, end_s).

    Piecewise-constant rates are exact when each piece restarts the process at its start, because
    exponential gaps are memoryless.
    """
    times: list[float] = []
    if rate <= 0:
        return times
    t = start_s
    while True:
        t += rng.expovariate(rate)
        if t >= end_s:
            return times
        times.append(t)


def constant_arrivals(start_s: float, end_s: float, rate: float) -> list[float]:
    if rate <= 0:
        return []
    gap = 1.0 / rate
    times: list[float] = []
    while start_s + len(times) * gap < end_s - 1e-9:
        times.append(start_s + len(times) * gap)
    return times


@dataclass(frozen=True, slots=True)
class _Draft:
    at_s: float
    prompt_tokens: int
    output_tokens: int


def _sized(times: list[float], prompt: LengthDist, output: LengthDist, rng: random.Random) -> list[_Draft]:
    return [_Draft(t, prompt.sample(rng), output.sample(rng)) for t in times]


def _class_drafts(spec: WorkloadSpec, cls: ClassSpec, rng: random.Random) -> list[_Draft]:
    if cls.trace is not None:
        source = cls.trace
        if source.records is not None:
            recs: list[TraceRecord] = source.window.apply(list(source.records), spec.duration_s, rng)
            return [_Draft(r.at_s, r.prompt_tokens, r.output_tokens) for r in recs]
        assert source.fit is not None  # the parser guarantees a fit when the file is absent
        fit = source.window.synthetic_fit(source.fit)
        times = poisson_arrivals(rng, 0.0, spec.duration_s, fit.rate_per_s)
        return _sized(times, fit.prompt, fit.output, rng)
    assert cls.prompt is not None and cls.output is not None
    times = []
    for start, end, rate in cls.segments(spec.duration_s):
        if cls.process == "constant":
            times.extend(constant_arrivals(start, end, rate))
        else:
            times.extend(poisson_arrivals(rng, start, end, rate))
    return _sized(times, cls.prompt, cls.output, rng)


def build_schedule(spec: WorkloadSpec) -> list[PlannedRequest]:
    """The whole run's requests in send order; identical for identical specs (seeded per class)."""
    entries: list[tuple[float, int, _Draft, ClassSpec, str, int]] = []
    for order, cls in enumerate(spec.classes):
        rng = class_rng(spec.seed, cls.name)
        keys = spec.tenants[cls.tenant].keys
        for draft in _class_drafts(spec, cls, rng):
            key = keys[rng.randrange(len(keys))] if len(keys) > 1 else keys[0]
            entries.append((draft.at_s, order, draft, cls, key, rng.getrandbits(32)))
    entries.sort(key=lambda e: (e[0], e[1]))
    if spec.max_requests is not None:
        entries = entries[: spec.max_requests]
    return [
        PlannedRequest(
            index=i,
            at_s=at,
            cls=cls.name,
            group=cls.group,
            tenant=cls.tenant,
            api_key=key,
            prompt_tokens=draft.prompt_tokens,
            output_tokens=draft.output_tokens,
            seed=seed,
        )
        for i, (at, _, draft, cls, key, seed) in enumerate(entries)
    ]
