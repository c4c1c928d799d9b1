"""The pricing benchmark's hostile shapes (``--tiny N``): bodies the gateway really accepts, each of
``N`` texts, priced the way the gateway prices them. (The figures are a benchmark's, run by hand.)"""

from __future__ import annotations

from typing import Any

import pytest

from classifiers import Pricer, TokenizerRegistry
from loadtest.bench import pricing

LIMITS: dict[str, Any] = {"default_max_tokens": 1, "max_tokens_limit": None, "context_length": 10**8}


@pytest.mark.parametrize("shape", pricing.TINY_SHAPES)
async def test_each_tiny_shape_is_a_valid_body_of_n_new_texts(shape: str) -> None:
    pricer = Pricer(TokenizerRegistry())
    body = pricing.tiny_body(shape, 500, seed=3)
    price = pricer.aprice_completion if shape == "prompts" else pricer.aprice_chat
    assert (await price(body, **LIMITS)).prefill >= 500  # every text counted
    assert pricing.tiny_body(shape, 500, seed=4) != body  # another seed: texts no memo has seen


def test_a_small_tiny_run_reports_every_shape(capsys: pytest.CaptureFixture[str]) -> None:
    rows = pricing.tiny(300)
    assert [r["shape"] for r in rows] == list(pricing.TINY_SHAPES)
    assert all(r["texts"] == 300 and r["kb"] > 0 and r["wall_ms"] > 0 and r["stall_ms"] > 0 for r in rows)
    pricing.main(["--tiny", "50"])
    assert capsys.readouterr().out.count("longest loop stall") == 3


def test_tiny_below_one_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        pricing.main(["--tiny", "0"])
    assert exc.value.code == 2 and "--tiny" in capsys.readouterr().err


def test_a_body_above_max_items_is_reported_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert all(r["refused"] for r in pricing.tiny(60, max_items=50))
    assert not any(r["refused"] for r in pricing.tiny(60, max_items=0))
    pricing.main(["--tiny", "60", "--max-items", "50"])
    assert capsys.readouterr().out.count("refused (pricing.max_items)") == 3


def test_the_media_run_prices_remote_and_inline_parts_and_refuses_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # (its remote hosts are all public: the run times checks that pass, never a refusal)
    m = pricing.media(20, 2)
    assert m["remote_us"] > 0 and m["inline_us"] > 0
    pricing.main(["--media", "20", "--rounds", "2"])
    assert "us per remote-URL part" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        pricing.main(["--media", "0"])
    assert exc.value.code == 2 and "--media" in capsys.readouterr().err


def test_the_flood_run_reports_the_victim_alone_fair_and_fifo_and_refuses_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    f = pricing.flood(2, 40_000, 2_000, 1)
    assert set(f) == {"alone", "fair", "fifo", "flood_fair", "flood_fifo"} and all(v > 0 for v in f.values())
    pricing.main(["--flood", "2", "--flood-chars", "40000", "--tokens", "2000", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "fair (tenants apart)" in out and "in one FIFO queue" in out
    with pytest.raises(SystemExit) as exc:
        pricing.main(["--flood", "0"])
    assert exc.value.code == 2 and "--flood" in capsys.readouterr().err


def test_the_memo_run_reports_never_same_and_other_tenant(capsys: pytest.CaptureFixture[str]) -> None:
    [row] = pricing.memo((20_000,), 2)
    assert row["chars"] == 20_000 and row["same"] < row["never"]
    pricing.main(["--memo", "--rounds", "1"])
    assert "sent before by another tenant" in capsys.readouterr().out
