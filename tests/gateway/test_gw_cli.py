"""The tokengate command's argument handling (the serving itself is covered in tests/e2e)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gateway import cli
from tests.gateway.gw_support import ROOT


def test_config_error_is_printed_with_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("tenants:\n  acme: {keys: [k], budget_tokens: -5}\n")
    assert cli.main(["serve", "--config", str(cfg)]) == 2
    assert (
        "config error: tenants.acme.budget_tokens: expected a positive integer, got -5"
        in capsys.readouterr().err
    )


def test_workers_with_memory_store_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--workers", "4"]) == 2
    err = capsys.readouterr().err
    assert (
        "--workers 4 with store.kind=memory would give every tenant 4x its budget; use store.kind=redis"
        in err
    )


def test_missing_delegate_is_not_available(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(cli._DELEGATES, "demo", ("loadtest.no_such_module", "x"))
    assert cli.main(["demo"]) == 2
    assert "not available" in capsys.readouterr().err


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    for command in ("serve", "backend", "demo", "loadtest"):
        assert command in out


def test_backend_subcommand_takes_the_reference_backend_options() -> None:
    parser = cli.build_parser_for(["backend"])
    args = parser.parse_args(["backend", "--executor", "sim", "--port", "9999", "--no-chunked-prefill"])
    assert args.port == 9999 and args.chunked_prefill is False


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (
            "listen: {port: 8080\ntiers: [\n",
            "not valid YAML: line 2, column 6: expected ',' or '}', but got ':'",
        ),
        ("drain_timeout_s: 2026-13-45\n", "not valid YAML: month must be in 1..12"),
        (b"\xff\xfelisten: {}\n", "not UTF-8 text"),
    ],
)
def test_a_broken_config_file_is_a_config_error_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | bytes, words: str
) -> None:
    cfg = tmp_path / "gw.yaml"
    if isinstance(text, bytes):
        cfg.write_bytes(text)
    else:
        cfg.write_text(text)
    assert cli.main(["serve", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: {cfg}: {words}") and "<unicode string>" not in err


def test_a_busy_port_is_one_clear_error_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = tmp_path / "gw.yaml"
        cfg.write_text(f"listen: {{port: {port}}}\nops: {{port: 0}}\nembedded_backend: {{port: 0}}\n")
        done = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    assert done.returncode == 2, done.stderr
    assert f"tokengate serve: cannot listen on 127.0.0.1:{port} (Address already in use)" in done.stderr
    assert "Traceback" not in done.stderr and "startup complete" not in done.stderr
