"""Active health checks and model discovery, off the hot path (httpx, one background task).

A probe is ``GET /health`` (vLLM, SGLang, the reference backend), falling back to
``GET /v1/models`` when a backend has no /health. Healthy backends are probed every
``interval_s``; those whose breaker is open every ``unhealthy_interval_s``, and a success after
the cooldown closes the breaker. A failed probe counts like a failed connect.

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
        backends = [b for b in self._backends if not b.confirmed]
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
        headers = _auth_headers(backend)
        try:
            r = await self._client.get(f"{backend.spec.url}/health", headers=headers)
            if r.status_code == 404:
                r = await self._client.get(f"{backend.spec.url}/v1/models", headers=headers)
            return r.status_code < 400
        except httpx.HTTPError:
            return False

    async def check_once(self, *, force: bool = False) -> None:
        now = time.monotonic()
        due = []
        for b in self._backends:
            period = self._settings.interval_s if b.healthy else self._settings.unhealthy_interval_s
            if force or now - self._last_probe.get(id(b), 0.0) >= period:
                due.append(b)
        if not due:
            return
        results = await asyncio.gather(*(self.probe(b) for b in due))
        now = time.monotonic()
        for b, ok in zip(due, results, strict=True):
            self._last_probe[id(b)] = now
            if ok:
                if b.probe_succeeded(now):
                    log.warning("backend %s is healthy again", b.name)
            elif b.probe_failed(now):
                log.warning("backend %s marked unhealthy (health probe failed)", b.name)

    async def _run(self) -> None:
        # Start probing one period in: at start-up everything is optimistically healthy and the
        # discovery call already touched each backend.
        self._last_probe = {id(b): time.monotonic() for b in self._backends}
        tick = min(self._settings.interval_s, self._settings.unhealthy_interval_s) / 2
        while True:
            await asyncio.sleep(tick)
            try:
                await self.check_once()
            except Exception:  # never let the checker die
                log.exception("health check pass failed")
