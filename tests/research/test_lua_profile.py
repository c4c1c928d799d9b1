"""The Lua profiler (``python -m research.lua_profile``): what it adds to the library, how it
names lines, and what it says to a stock redis-server, which takes ``debug`` away."""

from __future__ import annotations

from pathlib import Path

import pytest

from budgets.redis.scripts import Library, load_library
from loadtest.bench import scale
from loadtest.redis_server import RedisServer
from research import lua_profile

LUA = Path(lua_profile.__file__).resolve().parents[1] / "budgets" / "redis" / "lua"


def test_every_registered_function_samples_from_its_begin_to_its_return_and_the_lines_stay_put() -> None:
    lib = load_library()
    prof = lua_profile.profiled_library(lib, every=50)
    first = lib.code.index("redis.register_function(")
    assert prof.code[:first] == lib.code[:first]  # the entry files' lines keep their numbers
    assert prof.code.count("debug.sethook(profile_hook, '', 50)\n  begin(keys, args)") == len(lib.functions)
    assert prof.code.count("flush()\n  debug.sethook()\n  return reply") == len(lib.functions)
    assert f"redis.register_function('{lua_profile.DUMP}'" in prof.code
    assert (prof.name, prof.functions) == (lib.name, lib.functions)


def test_a_library_of_another_shape_is_refused_rather_than_half_patched() -> None:
    lib = load_library()
    odd = Library(
        lib.name, lib.code.replace("  begin(keys, args)\n", "  begin(keys, args) \n", 1), lib.functions
    )
    with pytest.raises(ValueError, match="not the shape"):
        lua_profile.profiled_library(odd, every=100)


def test_a_sampled_line_is_named_by_its_file_its_line_there_and_its_function() -> None:
    code = load_library().code
    where = lua_profile.places(code)
    lines = code.split("\n")
    lib_lines = (LUA / "lib.lua").read_text().split("\n")
    split_at = next(i for i, t in enumerate(lib_lines, start=1) if t.startswith("local function split("))
    n = lines.index(lib_lines[split_at]) + 1  # the line after split's header, numbered as Lua does
    assert where[n - 1] == lua_profile.Place("lib.lua", split_at + 1, "split", lib_lines[split_at].strip())
    acq = (LUA / "acquire.lua").read_text().split("\n")
    main_at = next(i for i, t in enumerate(acq, start=1) if t.startswith("local function acquire_main("))
    n = lines.index(acq[main_at + 1]) + 1
    assert (where[n - 1].file, where[n - 1].line, where[n - 1].function) == (
        "acquire.lua",
        main_at + 2,
        "acquire_main",
    )
    assert where[0].line == 0  # the #!lua header is no file's line


def test_samples_are_summed_by_function() -> None:
    code = load_library().code
    where = lua_profile.places(code)
    split_lines = [i for i, p in enumerate(where, start=1) if p.function == "split"][:2]
    totals = lua_profile.by_function({split_lines[0]: 3, split_lines[1]: 4, len(where) + 5: 1}, where)
    assert totals["split"] == 7 and totals["?"] == 1


def test_a_stock_redis_server_is_named_as_the_reason_it_cannot_run() -> None:
    with pytest.raises(SystemExit, match=r"refused the profiled library .*'debug'.*see --help"):
        lua_profile.main(["--sizes", "10:20", "--seconds", "0.1"])


def test_a_redis_server_path_that_is_not_there_is_named_in_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        lua_profile.main(["--redis-server", str(tmp_path / "redis-server")])
    assert exit_.value.code == 2
    assert "no such executable" in capsys.readouterr().err


async def test_the_scale_driver_loads_the_library_it_is_given_and_marks_the_measured_window() -> None:
    lib = load_library()
    probe = "redis.register_function('tg_probe_fn', function(keys, args) return 1 end)\n"
    given = Library(lib.name, lib.code + probe, lib.functions)
    marks: list[bool] = []
    loaded: list[int] = []

    async def window(client: object, started: bool) -> None:
        marks.append(started)
        loaded.append(await client.execute_command("FCALL", "tg_probe_fn", 0))  # type: ignore[attr-defined]

    server = RedisServer().start()
    try:
        row = await scale.redis_cycles(
            server.url, 4, 12, 0.2, 4, True, "functions", clock_step=0.001, library=given, window_marks=window
        )
    finally:
        server.stop()
    assert marks == [True, False]
    assert loaded == [1, 1]
    assert row["cycles"] > 0
