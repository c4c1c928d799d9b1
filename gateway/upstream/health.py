"""Active health checks and model discovery, off the hot path (httpx, one background task).

A probe is the backend's ``probe`` setting: by default ``GET /health`` (vLLM, SGLang, the
reference backend), falling back to ``GET /v1/models`` when a backend has no /health; a backend
with ``probe: off`` is never probed (see ``Backend.available`` for how its breaker closes).
Healthy backends are probed every ``interval_s``; those whose breaker is open every
``unhealthy_interval_s``, and a success after the cooldown closes the breaker. A failed probe
counts like a failed connect, except while the backend is busy: with requests in flight that it
was handed or whose answers made progress since its previous probe (``Backend.progressed``), it is
alive. Such a backend is not probed at all (a probe would disturb an engine that runs one request at a time:
llama-cpp-python's server cuts its running stream for any other request), and a probe that waited
behind its work and timed out is not held against it.

``start`` probes every backend once before it returns (bounded by the probe timeout), so /readyz
knows at once whether any backend answers; a failure of that first probe only leaves the backend
``unknown`` (requests and later probes count failures as usual).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from budgets.background import BackgroundTask
from gateway.upstream.pools import Backend

log = logging.getLogger("tokengate.health")


@dataclass(frozen=True, slots=True)
class HealthSettings:
    interval_s: float = 5.0
    unhealthy_interval_s: float = 1.0
    probe_timeout_s: float = 2.0


def _auth_headers(backend: Backend) -> dict[str, str]:
    key = backend.spec.api_key
    return {"Authorization": f"Bearer {key}"} if key else {}


class HealthChecker:
    def __init__(self, backends: Sequence[Backend], settings: HealthSettings = HealthSettings()) -> None:
        self._backends = tuple(backends)
        self._settings = settings
        self._client: httpx.AsyncClient | None = None
        self._prober = BackgroundTask("tokengate-health", self._run, log)
        self._last_probe: dict[int, float] = {}

    def set_backends(self, backends: Sequence[Backend]) -> None:
        """Probe these from now on (after a reconfiguration); a new backend is probed on the next pass."""
        self._backends = tuple(backends)
        live = {id(b) for b in self._backends}
        self._last_probe = {k: v for k, v in self._last_probe.items() if k in live}

    async def start(self) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._settings.probe_timeout_s, trust_env=False)
        await self.first_probe()
        self._prober.start()

    async def first_probe(self) -> None:
        """One probe of every backend at start-up; a success confirms it, a failure changes nothing."""
        backends = [b for b in self._backends if not b.confirmed and b.spec.probe is not None]
        if not backends:
            return
        try:
            async with asyncio.timeout(self._settings.probe_timeout_s):
                results = await asyncio.gather(*(self.probe(b) for b in backends))
        except TimeoutError:
            return  # the periodic probes take over
        now = time.monotonic()
        for b, ok in zip(backends, results, strict=True):
            if ok:
                b.probe_succeeded(now)
            else:
                log.warning("backend %s did not answer its first health probe", b.name)

    async def close(self) -> None:
        await self._prober.stop()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def discover_models(self) -> None:
        """Ask model-agnostic backends what they serve (for GET /v1/models); best effort."""
        await asyncio.gather(*(self._discover(b) for b in self._backends if not b.spec.models))

    async def _discover(self, backend: Backend) -> None:
        assert self._client is not None
        try:
            r = await self._client.get(f"{backend.spec.url}/v1/models", headers=_auth_headers(backend))
            if r.status_code == 200:
                data = r.json().get("data", [])
                backend.discovered_models = tuple(
                    str(m["id"]) for m in data if isinstance(m, dict) and "id" in m
                )
        except (httpx.HTTPError, ValueError, AttributeError, TypeError) as exc:
            log.info("model discovery on %s failed: %s", backend.name, exc)

    async def probe(self, backend: Backend) -> bool:
        assert self._client is not None
        spec = backend.spec.probe
        if spec is None:
            return True  # (never called for it: nothing to ask)
        headers = _auth_headers(backend)
        try:
            r = await self._client.request(spec.method, backend.spec.url + spec.path, headers=headers)
            if r.status_code == 404 and spec.fallback is not None:
                r = await self._client.request(spec.method, backend.spec.url + spec.fallback, headers=headers)
            return r.status_code < 400
        except httpx.HTTPError:
            return False

    async def check_once(self, *, force: bool = False) -> None:
        now = time.monotonic()
        due = []
        for b in self._backends:
            if b.spec.probe is None:
                continue
            period = self._settings.interval_s if b.healthy else self._settings.unhealthy_interval_s
            if not force and now - self._last_probe.get(id(b), 0.0) < period:
                continue
            if b.in_flight_requests > 0 and b.progressed:
                # Answers are arriving from it: it is alive, and a probe would only disturb it (an
                # engine that runs one request at a time, llama-cpp-python's, cuts its running
                # stream for any other request) or wait behind its work and time out.
                self._last_probe[id(b)] = now
                b.progress_seen(now)
                if b.probe_succeeded(now):
                    log.warning("backend %s is healthy again", b.name)
                continue
            due.append(b)
        if not due:
            return
        busy = [b.in_flight_requests > 0 for b in due]
        results = await asyncio.gather(*(self.probe(b) for b in due))
        now = time.monotonic()
        for b, was_busy, ok in zip(due, busy, results, strict=True):
            previous = self._last_probe.get(id(b), 0.0)
            self._last_probe[id(b)] = now
            progressed = b.progress_seen(now) > previous  # answers arrived since its previous probe
            if ok:
                if b.probe_succeeded(now):
                    log.warning("backend %s is healthy again", b.name)
            elif progressed and (was_busy or b.in_flight_requests > 0):
                log.info(
                    "backend %s did not answer its health probe while serving requests that make "
                    "progress; not counted as a failure",
                    b.name,
                )
            elif b.probe_failed(now):
                log.warning("backend %s marked unhealthy (health probe failed)", b.name)

    async def _run(self) -> None:
        # Start probing one period in: at start-up everything is optimistically healthy and the
        # discovery call already touched each backend.
        now = time.monotonic()
        self._last_probe = {id(b): now for b in self._backends}
        for b in self._backends:
            b.progress_seen(now)  # (progress before this counts as none since the previous probe)
        tick = min(self._settings.interval_s, self._settings.unhealthy_interval_s) / 2
        while True:
            await asyncio.sleep(tick)
            try:
                await self.check_once()
            except Exception:  # never let the checker die
                log.exception("health check pass failed")
