"""``tokengate loadtest`` against a stub backend running as a child process (real sockets)."""

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from loadtest.cli import add_arguments, main, parse_target, prepare_scenario
from loadtest.distributions import SpecError
from loadtest.processes import ProcessGroup, free_port, wait_ready

SCENARIO = {
    "name": "cli-mini",
    "seed": 1,
    "duration_s": 1.5,
    "drain_timeout_s": 10,
    "tenants": {"t": {"key": "sk-t"}},
    "classes": {"c": {"tenant": "t", "rate": 8, "prompt_tokens": 50, "output_tokens": 4}},
}


@pytest.fixture(scope="module")
def stub_urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    logs = tmp_path_factory.mktemp("stub-logs")
    with ProcessGroup() as group:
        urls = []
        children = []
        for i in range(2):
            port = free_port()
            argv = [sys.executable, "-m", "loadtest.stub_backend", str(port), "0.01", "0.001"]
            children.append(
                (group.start(f"stub{i}", argv, logs / f"stub{i}.log"), [f"http://127.0.0.1:{port}/health"])
            )
            urls.append(f"http://127.0.0.1:{port}")
        wait_ready(children, timeout_s=30)
        yield urls


def test_parse_target() -> None:
    t = parse_target("direct=http://a:1,http://b:2/", 0)
    assert t.name == "direct" and t.base_urls == ("http://a:1", "http://b:2")
    assert parse_target("http://a:1", 2).name == "target3"
    with pytest.raises(SpecError):
        parse_target("direct=ftp://a", 0)


@pytest.mark.slow  # spawned backends
def test_cli_compares_targets_and_writes_outputs(
    stub_urls: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = tmp_path / "mini.yaml"
    scenario.write_text(yaml.safe_dump(SCENARIO))
    out = tmp_path / "out"
    rc = main(
        [str(scenario), "--target", f"one={stub_urls[0]}", "--target", f"both={stub_urls[0]},{stub_urls[1]}",
         "--out", str(out), "--quiet", "--no-plots", "--pause", "0"]
    )  # fmt: skip
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert [t["name"] for t in data["targets"]] == ["one", "both"]
    assert all(t["totals"]["ok"] == t["totals"]["requests"] > 5 for t in data["targets"])
    assert "| both | c |" in capsys.readouterr().out


def test_cli_reports_spec_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = tmp_path / "bad.yaml"
    scenario.write_text(yaml.safe_dump({**SCENARIO, "duration_s": -1}))
    assert main([str(scenario), "--target", "http://127.0.0.1:9"]) == 2
    assert "duration_s" in capsys.readouterr().err
    assert main([str(tmp_path / "bad.yaml")]) == 2  # neither --target nor --spawn
    scenario.write_text(yaml.safe_dump(SCENARIO))
    assert main([str(scenario), "--target", "http://127.0.0.1:9", "--send-max-tokens", "lots"]) == 2
    assert "--send-max-tokens: expected planned, none or a positive integer" in capsys.readouterr().err


def test_the_send_max_tokens_flag_overrides_the_scenario(tmp_path: Path) -> None:
    scenario = tmp_path / "mini.yaml"
    scenario.write_text(yaml.safe_dump({**SCENARIO, "send_max_tokens": 4096}))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert prepare_scenario(parser.parse_args([str(scenario)])).workload.send_max_tokens == 4096
    flagged = parser.parse_args([str(scenario), "--send-max-tokens", "none"])
    assert prepare_scenario(flagged).workload.send_max_tokens == "none"
