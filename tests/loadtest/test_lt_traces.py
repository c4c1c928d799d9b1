import argparse
import random
import statistics
from pathlib import Path

import pytest

from loadtest import demo
from loadtest.distributions import SpecError
from loadtest.scenario import load_scenario
from loadtest.schedule import build_schedule
from loadtest.spec import parse_workload
from loadtest.traces import TRACES_ENV, TraceWindow, default_traces_dir, load_trace, use_traces_dir

REPO = Path(__file__).resolve().parents[2]
SHARED_TRACES = REPO.parent / "shared" / "traces"
CONV = SHARED_TRACES / "azure_llm_2023_conv.csv"
CODE = SHARED_TRACES / "azure_llm_2023_code.csv"
needs_traces = pytest.mark.skipif(
    not CONV.is_file() or not CODE.is_file(), reason="shared traces not present"
)

SMALL = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2224670,879,55
2023-11-16 18:15:56.6805900,1000,10
2023-11-16 18:16:06.6805900,2000,20
"""


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.csv"
    path.write_text(SMALL)
    return path


def test_parse_relative_times_and_sizes(small_trace: Path) -> None:
    recs = load_trace(small_trace)
    assert [r.at_s for r in recs] == pytest.approx([0.0, 4.314579, 4.541877, 10.0, 20.0], abs=1e-6)
    assert (recs[0].prompt_tokens, recs[0].output_tokens) == (374, 44)


def test_time_and_size_scaling_and_window(small_trace: Path) -> None:
    recs = load_trace(small_trace)
    window = TraceWindow(start_s=4.0, time_scale=2.0, size_scale=0.5, max_prompt_tokens=400)
    out = window.apply(recs, duration_s=4.0, rng=random.Random(0))  # trace seconds [4, 12)
    assert [r.at_s for r in out] == pytest.approx([0.1572895, 0.2709385, 3.0])
    assert [r.prompt_tokens for r in out] == [198, 400, 400]
    assert [r.output_tokens for r in out] == [54, 28, 5]


def test_sampling_thins_the_trace(small_trace: Path) -> None:
    recs = load_trace(small_trace) * 200
    kept = TraceWindow(sample=0.25).apply(sorted(recs, key=lambda r: r.at_s), 100, random.Random(1))
    assert len(kept) == pytest.approx(250, rel=0.2)


def test_trace_class_uses_the_file(small_trace: Path) -> None:
    raw = {
        "seed": 1,
        "duration_s": 30,
        "tenants": {"t": {}},
        "classes": {"bg": {"tenant": "t", "trace": {"file": str(small_trace), "time_scale": 1}}},
    }
    plan = build_schedule(parse_workload(raw))
    assert [r.prompt_tokens for r in plan] == [374, 396, 879, 1000, 2000]


def test_missing_known_trace_falls_back_to_synthetic_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TRACES_ENV, str(tmp_path / "nowhere"))
    raw = {
        "seed": 1,
        "duration_s": 400,
        "tenants": {"t": {}},
        "classes": {"bg": {"tenant": "t", "trace": {"file": "azure_llm_2023_conv.csv", "time_scale": 1}}},
    }
    spec = parse_workload(raw)
    assert spec.classes[0].trace is not None and spec.classes[0].trace.records is None
    plan = build_schedule(spec)
    assert len(plan) == pytest.approx(5.5 * 400, rel=0.08)
    assert statistics.median(r.prompt_tokens for r in plan) == pytest.approx(1020, rel=0.1)
    assert statistics.median(r.output_tokens for r in plan) == pytest.approx(129, rel=0.1)


@needs_traces
def test_real_traces_match_their_readme_figures() -> None:
    conv, code = load_trace(CONV), load_trace(CODE)
    assert len(conv) == 19366 and len(code) == 8819
    assert conv[-1].at_s == pytest.approx(3502, abs=2)
    assert statistics.median(r.prompt_tokens for r in conv) == pytest.approx(1020, abs=5)
    assert statistics.median(r.output_tokens for r in conv) == pytest.approx(129, abs=3)
    assert max(r.prompt_tokens for r in conv) == 14050


@needs_traces
def test_real_trace_time_scaling_multiplies_the_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRACES_ENV, str(SHARED_TRACES))
    raw = {
        "seed": 1,
        "duration_s": 60,
        "tenants": {"t": {}},
        "classes": {
            "slow": {"tenant": "t", "trace": {"file": "azure_llm_2023_conv.csv", "start_s": 600}},
            "fast": {
                "tenant": "t",
                "trace": {"file": "azure_llm_2023_conv.csv", "start_s": 600, "time_scale": 4},
            },
        },
    }
    plan = build_schedule(parse_workload(raw))
    slow = [r for r in plan if r.cls == "slow"]
    fast = [r for r in plan if r.cls == "fast"]
    assert len(fast) == pytest.approx(4 * len(slow), rel=0.25)
    assert all(r.at_s < 60 for r in fast)
    # the first 60 s of the fast replay are the slow replay's first 15 s, compressed 4x
    assert [r.prompt_tokens for r in fast[:5]] == [r.prompt_tokens for r in slow[:5]]
    assert [r.at_s * 4 for r in fast[:5]] == pytest.approx([r.at_s for r in slow[:5]])


def test_traces_are_looked_up_only_where_the_user_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_trace: Path
) -> None:
    monkeypatch.setenv(TRACES_ENV, "")  # unset, and restored after the test (use_traces_dir sets it)
    assert default_traces_dir() is None  # no guessed folder outside the project
    raw = {
        "seed": 1,
        "duration_s": 30,
        "tenants": {"t": {}},
        "classes": {"bg": {"tenant": "t", "trace": {"file": "azure_llm_2023_conv.csv"}}},
    }
    assert parse_workload(raw).classes[0].trace.records is None  # type: ignore[union-attr]
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "azure_llm_2023_conv.csv").write_text(small_trace.read_text())
    use_traces_dir(folder)
    trace = parse_workload(raw).classes[0].trace
    assert trace is not None and trace.records is not None and len(trace.records) == 5
    with pytest.raises(SpecError, match="no such folder"):
        use_traces_dir(tmp_path / "nowhere")


def test_the_demo_says_how_to_replay_the_trace_files(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRACES_ENV, "")
    scenario = load_scenario("noisy_neighbour")
    args = argparse.Namespace(synthetic=False)
    words = demo._traffic_source(scenario, args)
    assert "--traces DIR" in words and "shared" not in words
