"""The tokengate command's argument handling (the serving itself is covered in tests/e2e)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway import cli


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
