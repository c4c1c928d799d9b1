"""The scale benchmark (``python -m loadtest.bench.scale``), run for real and briefly: both stores,
one small size, its own redis-server, the JSON and the per-command breakdown of the Redis rows."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.bench.scale import CollectorTime
from loadtest.processes import child_env, repo_root

pytestmark = pytest.mark.slow


@pytest.mark.soak
def test_both_stores_run_their_cycles_and_the_redis_rows_say_what_each_command_costs(tmp_path: Path) -> None:
    result = tmp_path / "scale.json"
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.bench.scale", "--sizes", "10:40", "--seconds", "0.4",
         "--bytes-sample", "200", "--commandstats", "--json", str(result)],
        cwd=repo_root(), env=child_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["store"]: row for row in json.loads(result.read_text())["cycles"]}
    assert set(rows) == {"memory", "redis", "redis-batch"}
    for row in rows.values():
        assert (row["tenants"], row["tickets"]) == (10, 40)
        assert row["cycles_per_s"] > 0
        # measured in the steady state: every waiting ticket was granted once before the window
        assert row["warm_complete"] and row["warm_cycles"] >= 40
    assert len(rows["memory"]["collector"]["collections"]) == 3  # per generation, in the window
    assert "collector" in done.stdout
    for store in ("redis", "redis-batch"):
        commands = rows[store]["commands_per_cycle"]
        assert commands["fcall"]["calls"] > 0  # one per operation, or one per batch
        # A grant cycle writes the lease and its ticket's departure, whatever else it does.
        assert commands["hset"]["calls"] >= 1 and commands["hdel"]["calls"] >= 1
        assert rows[store]["redis_cpu_us_per_cycle"] > 0
    assert rows["redis"]["commands_per_cycle"]["fcall"]["calls"] == pytest.approx(
        2, abs=0.2
    )  # release + acquire
    assert "per cycle:" in done.stdout and "commands from the scripts" in done.stdout


async def test_the_redis_driver_on_a_virtual_clock_runs_its_calls_on_that_clock_not_at_redis_time() -> None:
    from redis.asyncio import Redis

    from loadtest.bench import scale
    from loadtest.redis_server import RedisServer

    server = RedisServer().start()
    try:
        row = await scale.redis_cycles(server.url, 10, 40, 0.3, 8, True, "functions", clock_step=0.001)
        assert row["cycles"] > 0
        client = Redis.from_url(server.url, decode_responses=True)
        try:
            clocks = [k async for k in client.scan_iter("{tg:scale-*}:clock")]
            assert len(clocks) == 1
            # The last grant pass ran on the virtual clock: its instant lies past the start by a
            # thousandth of a second per cycle run (Redis' TIME lies some 70 years before it).
            passed = float(str(await client.get(clocks[0]))) - scale.VIRTUAL_START
            assert 0.0 < passed < 3600.0
        finally:
            await client.aclose()
    finally:
        server.stop()


def test_the_collector_timer_counts_the_collections_of_its_window_and_no_others() -> None:
    was_enabled = gc.isenabled()
    gc.disable()  # only the collections this test asks for
    try:
        with CollectorTime() as collector:
            gc.collect(0)  # before the window
            collector.on = True
            gc.collect(0)
            gc.collect(1)
            gc.collect(2)
            collector.on = False
            gc.collect(0)  # after it
        gc.collect(2)  # the timer is gone: not counted
    finally:
        if was_enabled:
            gc.enable()
    assert collector.collections == [1, 1, 1]
    assert collector.seconds[2] > 0
    per = collector.per_cycle(1000)
    assert per["collections"] == [1, 1, 1]
    assert per["us_per_cycle"] == pytest.approx(sum(collector.seconds) / 1000 * 1e6)
    assert 0 < per["longest_ms"][2] <= per["ms"][2] and per["longest_ms"][0] <= per["ms"][0]
