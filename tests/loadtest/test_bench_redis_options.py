"""What the benchmarks that start their own Redis accept as its settings (``--redis-option``); the
instruction counting itself needs valgrind and minutes: a benchmark, run by hand."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from loadtest.bench import scale
from loadtest.redis_server import config_args
from research import redis_instructions


def test_name_value_settings_become_redis_server_arguments() -> None:
    assert config_args(None) == []
    assert config_args(["zset-max-listpack-entries=0", "hz=100"]) == [
        "--zset-max-listpack-entries",
        "0",
        "--hz",
        "100",
    ]


@pytest.mark.parametrize("main", [redis_instructions.main, scale.main], ids=["instructions", "scale"])
@pytest.mark.parametrize("bad", ["zset-max-listpack-entries", "=0"])
def test_a_setting_without_name_or_value_is_refused_before_anything_starts(
    main: Callable[[list[str]], int], bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--redis-option", bad, "--sizes", "10:100"])
    assert exc.value.code == 2
    assert "expected NAME=VALUE" in capsys.readouterr().err


def test_the_scale_benchmark_will_not_set_up_a_redis_it_did_not_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        scale.main(["--url", "redis://127.0.0.1:1/0", "--redis-option", "hz=100"])
    assert exc.value.code == 2
    assert "not with --url" in capsys.readouterr().err
