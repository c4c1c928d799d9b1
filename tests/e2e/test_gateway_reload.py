"""SIGHUP re-reads the config file of a running `tokengate serve` and applies it live; a bad file is
logged and changes nothing."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import StubBackend, free_port, serve_asgi
from tests.e2e.support import ROOT


def config(port: int, ops_port: int, backend: str, budget: int) -> str:
    return (
        f"listen: {{port: {port}}}\nops: {{port: {ops_port}}}\n"
        f"pools: {{default: {{backends: [{{url: {backend}, capacity_tokens: 100000}}]}}}}\n"
        f"tenants: {{t: {{keys: [k], budget_tokens: {budget}}}}}\ndrain_timeout_s: 2\n"
    )


@pytest.mark.slow
async def test_sighup_reloads_the_file_live_and_refuses_a_bad_one(tmp_path: Path) -> None:
    stub = await serve_asgi(StubBackend())
    port, ops_port = free_port(), free_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(config(port, ops_port, stub.url, budget=500))
    log = (tmp_path / "gw.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), cwd=ROOT, stdout=log, stderr=log
    )
    body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 900}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if (await c.get("/readyz")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "gateway did not become ready"
                await asyncio.sleep(0.1)

            async def status() -> int:
                r = await c.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer k"})
                return r.status_code

            assert await status() == 413  # 900 tokens can never fit a 500-token budget
            cfg.write_text(config(port, ops_port, stub.url, budget=5000))
            proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while await status() != 200:
                assert time.monotonic() < deadline, "SIGHUP did not apply the new budget"
                await asyncio.sleep(0.1)
            cfg.write_text("tenants: {t: {budget_tokens: -1}}\n")
            proc.send_signal(signal.SIGHUP)
            await asyncio.sleep(1.0)
            assert proc.returncode is None  # SIGHUP no longer kills the process
            assert await status() == 200  # the running config is unchanged
        text = (tmp_path / "gw.log").read_text()
        assert "reload refused" in text and "budget_tokens" in text
    finally:
        if proc.returncode is None:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 20)
        log.close()
        await stub.stop()
