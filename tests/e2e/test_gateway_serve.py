"""`tokengate serve` as a process: embedded backends, real requests, JSON logs, SIGTERM drains and exits."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from tests.e2e.support import ROOT
from tests.support import eventually

pytestmark = pytest.mark.slow


async def test_serve_with_embedded_backend_and_sigterm(tmp_path: Path) -> None:
    port, ops_port = free_port(), free_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        f"listen: {{port: {port}}}\nops: {{port: {ops_port}}}\n"
        "embedded_backend: {port: 0, time_scale: 0.0}\ndrain_timeout_s: 5\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg),
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:

            async def ready() -> bool:
                try:
                    return (await c.get("/readyz")).status_code == 200
                except httpx.TransportError:
                    return False

            await eventually(ready, timeout_s=30, interval_s=0.1, message="gateway did not become ready")
            models = (await c.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["tokengate-sim"]
            r = await c.post(
                "/v1/chat/completions",
                json={
                    "model": "tokengate-sim",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                },
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            assert (
                r.headers["x-tokengate-class"] == "short"
                and uuid.UUID(r.headers["x-request-id"]).version == 4
            )
            assert (await c.get("/metrics")).status_code == 404  # operator data is not on the API port
            ops = await c.get(f"http://127.0.0.1:{ops_port}/metrics")
            assert ops.status_code == 200 and "tokengate_requests_total" in ops.text
            # The start-up heap is frozen out of full collections, which are counted.
            assert 'python_gc_collections_total{generation="2"}' in ops.text
            frozen = next(x for x in ops.text.splitlines() if x.startswith("tokengate_gc_frozen_objects "))
            assert float(frozen.split()[1]) > 10_000
            # ... and the collector runs on the config's thresholds (gc: defaults), not Python's.
            assert 'tokengate_gc_threshold{generation="0"} 10000.0' in ops.text
            assert 'tokengate_gc_threshold{generation="2"} 100.0' in ops.text
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(proc.communicate(), 20)
        # uvicorn re-raises the signal it handled once the graceful shutdown is done.
        assert proc.returncode in (0, -signal.SIGTERM), err.decode()
        # Every line is one JSON object: ours, uvicorn's and the access log's.
        logs = [json.loads(line) for line in err.decode().splitlines()]
        assert all({"timestamp", "level", "logger", "message"} <= set(x) for x in logs)
        said = {(x["logger"], x["message"]) for x in logs}
        assert ("uvicorn.error", "Application startup complete.") in said
        assert ("uvicorn.error", "Application shutdown complete.") in said
        # Two listeners, one process: its start and end are said once.
        started = [
            x for x in logs if x["message"].startswith(("Started server process", "Finished server process"))
        ]
        assert len(started) == 2, started
        ready = next(x for x in logs if x["message"].startswith("tokengate is ready"))
        assert ready["api"] == f"{url}/v1" and ready["dashboard"] == f"http://127.0.0.1:{ops_port}/dashboard"
        assert (
            ready["open_tenant"] is True
            and ready["doctor"] == f"tokengate doctor http://127.0.0.1:{ops_port}"
        )
        lines = [json.loads(line) for line in out.decode().splitlines()]  # one per request
        assert [x["path"] for x in lines] == ["/v1/models", "/v1/chat/completions", "/metrics"]
        access = lines[1]
        assert access["status"] == 200 and access["class"] == "short" and access["pool"] == "short"
        assert access["logger"] == "tokengate.access" and access["request_id"] == r.headers["x-request-id"]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
