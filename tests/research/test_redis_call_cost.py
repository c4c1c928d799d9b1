"""The per-``redis.call`` cost benchmark: every way does the same field work against a real Redis,
and its report says what each adds to the loop alone. (The figures are a benchmark's, run by hand.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from loadtest.redis_server import RedisServer
from research import redis_call_cost


def test_each_way_touches_the_same_fields_as_the_others() -> None:
    server = RedisServer().start()
    try:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        client.function_load(redis_call_cost.LIBRARY, replace=True)
        redis_call_cost.fill(client, 100)
        assert client.hlen("h") == 100 and client.zcard("z") == 100
        for way in redis_call_cost.WAYS:
            redis_call_cost.fill(client, 100)
            assert client.fcall(way, 2, "h", "z", 70, 100) == 70
            if way.startswith("zadd"):  # the i-th name (spread over the key space) scored i, both ways
                assert [client.zscore("z", f"t{i * 7919 % 100}") for i in range(1, 71)] == list(range(1, 71))
        client.close()
    finally:
        server.stop()


def test_the_report_names_each_ways_cost_over_the_bare_loop() -> None:
    rows = {"noop": [0.3, 0.25], "hget": [0.7, 0.65], "hmget": [0.5, 0.45], "zadd": [1.0], "zadd_many": [0.6]}
    lines = redis_call_cost.report(rows)
    assert lines[0].startswith("noop") and "over noop" not in lines[0]
    assert "(+0.400 over noop)" in lines[1]  # hget: its best run against noop's best
    assert len(lines) == len(rows)


def test_a_small_run_end_to_end_writes_its_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cost.json"
    args = ["--fields", "200", "--calls", "64", "--rounds", "3", "--repeat", "1", "--json", str(out)]
    assert redis_call_cost.main(args) == 0
    rows = json.loads(out.read_text())
    assert set(rows) == set(redis_call_cost.WAYS)
    assert all(len(v) == 1 and v[0] >= 0 for v in rows.values())
    assert "hmget" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--calls", "0"], ["--redis-option", "hz"]])
def test_bad_arguments_are_a_usage_error(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        redis_call_cost.main(bad)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err
