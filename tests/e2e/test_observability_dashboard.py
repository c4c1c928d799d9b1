"""The built-in /dashboard in headless Chromium, against a running gateway under load.

Chromium is Debian's ``chromium`` package, driven over the DevTools protocol (a websocket, with
aiohttp) — no playwright, no browser download. The test checks that the page renders, that the
charts fill and keep updating from /stats (the output reservations', quotas' and shadow limits' tables
too), and saves a screenshot to ``artifacts/dashboard.png``.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import pytest

from tests.e2e.support import ROOT
from tests.e2e.test_observability_hol import Traffic, gateway_config, reference_backends, running_gateway

ARTIFACTS = ROOT / "artifacts"
CHROMIUM = next(
    (p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None
)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--mute-audio",
    "--hide-scrollbars",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="chromium not installed (Debian: apt-get install chromium; see scripts/bootstrap.sh)",
    ),
]


class Browser:
    """Headless Chromium with one page, spoken to over the DevTools protocol."""

    def __init__(self, exe: str) -> None:
        self.exe = exe
        self._ids = itertools.count(1)

    async def __aenter__(self) -> Browser:
        self.dir = tempfile.mkdtemp(prefix="tokengate-chromium-")
        self.proc = await asyncio.create_subprocess_exec(
            self.exe,
            *FLAGS,
            f"--user-data-dir={self.dir}",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            "about:blank",
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            port = await self._devtools_port()
            self.http = aiohttp.ClientSession()
            async with self.http.get(f"http://127.0.0.1:{port}/json/list") as r:
                targets = await r.json()
            page = next(t for t in targets if t["type"] == "page")
            self.ws = await self.http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        except BaseException:
            await self._stop_process()
            raise
        return self

    async def _devtools_port(self) -> int:
        # Chromium writes the port it picked (port 0 = any free one) into the profile directory.
        f = Path(self.dir) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while True:
            if f.exists():
                lines = f.read_text().splitlines()
                if lines and lines[0].isdigit():
                    return int(lines[0])
            if self.proc.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError("chromium did not start")
            await asyncio.sleep(0.05)

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        i = next(self._ids)
        await self.ws.send_json({"id": i, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json(timeout=30)
            if msg.get("id") == i:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                result: dict[str, Any] = msg["result"]
                return result

    async def eval(self, expression: str) -> Any:
        r = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        return r["result"].get("value")

    async def _stop_process(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.ws.close()
        await self.http.close()
        await self._stop_process()


@pytest.mark.soak
async def test_dashboard_renders_and_updates_under_load() -> None:
    assert CHROMIUM is not None
    async with reference_backends(2) as backends, aiohttp.ClientSession() as session:
        config = gateway_config([b.url for b in backends], split=False)
        # a quota and a shadow budget, for the page's quota and shadow-mode tables
        config["tenants"]["chat"]["quotas"] = [{"name": "daily", "tokens": 100_000_000, "window": "day"}]
        config["tenants"]["noisy"]["budget_enforce"] = False
        async with running_gateway(config) as (_gw, served, ops):
            # The load runs until the page has seen the charts grow and at least 14 s have passed
            # (the head-of-line finding needs that many windows): a page that fills late, on a busy
            # machine, still sees windows with requests in them close after it filled.
            stop = asyncio.Event()
            started = time.monotonic()
            traffic = Traffic(served.url, session).run(duration_s=60.0, short_rps=10.0, stop=stop)
            load = asyncio.create_task(traffic)
            try:
                async with Browser(CHROMIUM) as b:
                    await b.send(
                        "Emulation.setDeviceMetricsOverride",
                        width=1400,
                        height=1600,
                        deviceScaleFactor=1,
                        mobile=False,
                    )
                    await b.send("Page.enable")
                    await b.send("Page.navigate", url=ops.url + "/dashboard")
                    first_updates = None
                    points: list[int] = []
                    deadline = time.monotonic() + 55
                    while time.monotonic() < deadline:
                        await asyncio.sleep(1.0)
                        updates = await b.eval("Number(document.body.dataset.updates || 0)")
                        points = await b.eval(
                            "[...document.querySelectorAll('canvas')].map(c => Number(c.dataset.points || 0))"
                        )
                        if first_updates is None and updates and all(points):
                            first_updates, first_points = updates, points
                        elif (
                            first_updates is not None
                            and updates >= first_updates + 3
                            and points[0] > first_points[0]
                            and time.monotonic() - started >= 14.0
                        ):
                            break
                    stop.set()
                    await load
                    assert first_updates is not None, f"charts never filled: {points}"
                    assert updates >= first_updates + 3, "the page stopped polling /stats"
                    # the per-window charts grew while the page was open: they really update
                    assert points[0] > first_points[0], (first_points, points)
                    rows = await b.eval(
                        "[...document.querySelectorAll('#classes tbody tr td:first-child')].map(td => td.textContent)"
                    )
                    assert set(rows) >= {"short", "long"}
                    backends_rows = await b.eval("document.querySelectorAll('#backends tbody tr').length")
                    assert backends_rows == 2
                    # output reservations: used / reserved per class and tenant, capacity held per pool
                    reserved_rows = await b.eval(
                        "[...document.querySelectorAll('#reservations tbody tr')].map(tr => "
                        "[tr.cells[0].textContent, tr.querySelectorAll('.hist span').length])"
                    )
                    assert {c for c, _ in reserved_rows} >= {"short", "long"}, reserved_rows
                    assert all(bars == 15 for _, bars in reserved_rows)  # 14 edges and the rest
                    pool_rows = await b.eval(
                        "document.querySelectorAll('#reservation-pools tbody tr').length"
                    )
                    assert pool_rows >= 1
                    quota_rows = await b.eval(
                        "[...document.querySelectorAll('#quotas tbody tr')].map(tr => [tr.cells[0].textContent, "
                        "tr.cells[1].textContent, tr.cells[3].textContent])"
                    )
                    assert [r[:2] for r in quota_rows] == [["chat", "daily"]], quota_rows
                    assert quota_rows[0][2].endswith("/ 100.0M tokens") and not quota_rows[0][2].startswith(
                        "0 "
                    )
                    shadow_rows = await b.eval(
                        "[...document.querySelectorAll('#shadow tbody tr')].map(tr => tr.cells[1].textContent)"
                    )
                    assert shadow_rows == ["noisy"], shadow_rows
                    status = await b.eval("document.getElementById('status').className")
                    assert status == "dot live"
                    findings = await b.eval("document.getElementById('findings').textContent")
                    assert "head-of-line" in findings
                    shot = await b.send("Page.captureScreenshot", format="png")
                    ARTIFACTS.mkdir(exist_ok=True)
                    png = base64.b64decode(shot["data"])
                    (ARTIFACTS / "dashboard.png").write_bytes(png)
                    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
            finally:
                stop.set()
                await load
