"""Every shipped scenario loads (with and without the trace files), plans requests, and generates gateway
configs that the gateway's own loader accepts."""

from pathlib import Path

import pytest

from loadtest.distributions import SpecError
from loadtest.gateway_config import deep_merge, gateway_config
from loadtest.scenario import SCENARIOS_DIR, load_scenario, parse_scenario
from loadtest.schedule import build_schedule

SHIPPED = sorted(p.stem for p in SCENARIOS_DIR.glob("*.yaml"))


def test_the_five_scenarios_are_shipped() -> None:
    assert {"noisy_neighbour", "priority_inversion", "pool_split", "fairness", "reservations"} <= set(SHIPPED)


def test_the_reservations_arms_share_a_backend_whose_kv_cache_is_the_pools_capacity() -> None:
    config_loader = pytest.importorskip("gateway.config.loader")
    scenario = load_scenario("reservations", synthetic=True)
    setup = scenario.setup
    assert setup is not None and scenario.workload.send_max_tokens == 4096
    args = list(setup.backend_args)
    kv_tokens = int(args[args.index("--num-blocks") + 1]) * 16  # the backend's default block size
    context = int(args[args.index("--max-model-len") + 1])
    modes = {}
    for t in setup.targets:
        if t.same_as:
            continue
        raw = gateway_config(
            scenario.workload, setup.gateway_base, t.gateway, ["http://127.0.0.1:9000"], 18080
        )
        config = config_loader.parse_config(raw)
        assert [b.capacity_tokens for p in config.pools for b in p.backends] == [kv_tokens]
        assert config.models[0].context_length == context
        modes[t.name] = (
            config.reservation.settings.mode,
            config.reservation.oracle_header,
            config.fairness.tenant_queue_order,
        )
    assert modes == {
        "max_tokens": ("max_tokens", False, "fifo"),
        "learned": ("learned", False, "fifo"),
        "learned-ordered": ("learned", False, "shortest_first"),
        "oracle": ("max_tokens", True, "fifo"),
    }
    measured = {t.name: t.phase for t in setup.targets}
    assert measured == {
        "max_tokens": "measured",
        "learned-warmup": "warmup",
        "learned": "measured",
        "learned-ordered-warmup": "warmup",
        "learned-ordered": "measured",
        "oracle": "measured",
    }
    # Every request fits the context with max_tokens 4096 (the gateway would refuse it otherwise).
    assert max(r.prompt_tokens for r in build_schedule(scenario.workload)) + 4096 <= context


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("synthetic", [False, True])
def test_shipped_scenario_loads_and_plans(name: str, synthetic: bool) -> None:
    scenario = load_scenario(name, synthetic=synthetic)
    plan = build_schedule(scenario.workload)
    assert plan, "the scenario plans requests"
    assert {r.group for r in plan} == set(scenario.workload.groups)
    assert max(r.at_s for r in plan) < scenario.workload.duration_s
    assert scenario.setup is not None and scenario.checks
    target_names = {t.name for t in scenario.setup.targets}
    assert all(c.target in target_names for c in scenario.checks)


@pytest.mark.parametrize("name", SHIPPED)
def test_generated_gateway_configs_pass_the_gateway_loader(name: str) -> None:
    config_loader = pytest.importorskip("gateway.config.loader")
    scenario = load_scenario(name, synthetic=True)
    assert scenario.setup is not None
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(scenario.setup.backend_count)]
    for target in scenario.setup.targets:
        if target.direct or target.same_as:
            continue
        raw = gateway_config(scenario.workload, scenario.setup.gateway_base, target.gateway, urls, 18080)
        config = config_loader.parse_config(raw)
        assert config.listen.port == 18080
        assert {t.name for t in config.tenants} == set(scenario.workload.tenants)
        backend_urls = {b.url for pool in config.pools for b in pool.backends}
        assert backend_urls <= set(urls) and backend_urls


def test_gateway_config_merges_tenants_and_resolves_backends() -> None:
    scenario = parse_scenario(
        {
            "duration_s": 5,
            "tenants": {
                "a": {"key": "sk-a", "weight": 2, "tier": "batch", "gateway": {"budget_tokens": 100}}
            },
            "classes": {"c": {"tenant": "a", "rate": 1, "prompt_tokens": 10, "output_tokens": 5}},
            "setup": {
                "backends": {"count": 2},
                "gateway": {"classes": [{"name": "c", "pool": "p"}]},
                "targets": [
                    {
                        "name": "gw",
                        "gateway": {
                            "pools": {"p": {"backends": [{"backend": 1, "capacity_tokens": 5000}]}},
                            "tenants": {"a": {"budget_tokens": 300}},
                        },
                    }
                ],
            },
        }
    )
    assert scenario.setup is not None
    target = scenario.setup.targets[0]
    cfg = gateway_config(
        scenario.workload, scenario.setup.gateway_base, target.gateway, ["http://x:1", "http://y:2"], 7
    )
    assert cfg["listen"] == {"host": "127.0.0.1", "port": 7}
    assert cfg["tenants"] == {"a": {"keys": ["sk-a"], "weight": 2.0, "tier": "batch", "budget_tokens": 300}}
    assert cfg["pools"] == {"p": {"backends": [{"capacity_tokens": 5000, "url": "http://y:2"}]}}
    assert cfg["classes"] == [{"name": "c", "pool": "p"}]
    assert deep_merge({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}, "d": 4}) == {"a": {"b": 1, "c": 3}, "d": 4}


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        ([{"name": "x"}], "exactly one of"),
        ([{"name": "x", "direct": True}, {"name": "x", "direct": True}], "unique"),
        ([{"name": "x", "same_as": "nope"}], "same_as"),
        ([{"name": "x", "direct": True, "without": ["nope"]}], "unknown class"),
        ([{"name": "x", "direct": True, "phase": "nope"}], "is not a phase"),
        ([{"name": "x", "direct": True, "backends": [3]}], "backend indices"),
    ],
)
def test_bad_setups_name_the_problem(targets: list[dict[str, object]], message: str) -> None:
    raw = {
        "duration_s": 5,
        "tenants": {"a": {}},
        "classes": {"c": {"tenant": "a", "rate": 1, "prompt_tokens": 10, "output_tokens": 5}},
        "setup": {"backends": {"count": 1}, "targets": targets},
    }
    with pytest.raises(SpecError) as err:
        parse_scenario(raw)
    assert message in str(err.value)


def test_unknown_scenario_lists_the_shipped_ones(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as err:
        load_scenario(str(tmp_path / "nope.yaml"))
    assert "noisy_neighbour" in str(err.value)


def _with_backends(backends: dict[str, object]) -> dict[str, object]:
    return {
        "duration_s": 5,
        "tenants": {"a": {"key": "sk-a"}},
        "classes": {"c": {"tenant": "a", "rate": 1, "prompt_tokens": 10, "output_tokens": 5}},
        "setup": {"backends": backends, "targets": [{"name": "d", "direct": True}]},
    }


def test_backend_variants_give_each_backend_the_common_args_and_its_own() -> None:
    scenario = parse_scenario(_with_backends({"args": ["--x", "1"], "variants": [[], ["--y", "2"]]}))
    assert scenario.setup is not None
    assert scenario.setup.backend_count == 2
    assert scenario.setup.args_of(0) == ("--x", "1")
    assert scenario.setup.args_of(1) == ("--x", "1", "--y", "2")
    plain = parse_scenario(_with_backends({"count": 2, "args": ["--x", "1"]}))
    assert plain.setup is not None and plain.setup.args_of(1) == ("--x", "1")
    with pytest.raises(SpecError, match="one per backend"):
        parse_scenario(_with_backends({"count": 3, "variants": [[], []]}))
    with pytest.raises(SpecError, match="variants"):
        parse_scenario(_with_backends({"variants": ["--y"]}))


def test_one_server_scenario_compares_each_arm_with_the_victim_alone_on_its_engine() -> None:
    scenario = load_scenario("one_server", synthetic=True)
    assert scenario.setup is not None and scenario.workload.isolation is not None
    iso = scenario.workload.isolation
    backends_of = {t.name: t.backends for t in scenario.setup.targets if t.direct}
    engine_of = {
        t.name: t.gateway["pools"]["one"]["backends"][0]["backend"]
        for t in scenario.setup.targets
        if not t.direct
    }
    for arm, solo in iso.solo.items():
        engine = backends_of[arm][0] if backends_of.get(arm) else engine_of[arm]
        assert backends_of[solo] == (engine,), (arm, solo)
    assert {"--long-prefill-token-threshold"} <= set(scenario.setup.args_of(3))


def test_one_server_sustained_runs_every_arm_on_vllms_priority_scope_but_the_step_arm() -> None:
    scenario = load_scenario("one_server_sustained", synthetic=True)
    setup, iso = scenario.setup, scenario.workload.isolation
    assert setup is not None and iso is not None
    engine_of = {
        t.name: (
            t.backends[0] if t.direct and t.backends else t.gateway["pools"]["one"]["backends"][0]["backend"]
        )
        for t in setup.targets
    }
    scope = {}
    for name, backend in engine_of.items():
        args = list(setup.args_of(backend))
        scope[name] = args[args.index("--priority-scope") + 1] if "--priority-scope" in args else None
        assert args[args.index("--time-scale") + 1] == "2.5"
    assert {n for n, s in scope.items() if s == "step"} == {"recipe-step", "solo-recipe-step"}
    assert all(scope[n] == "queue" for n in ("recipe", "recipe-tight", "solo-recipe"))
    for arm, solo in iso.solo.items():
        assert engine_of[arm] == engine_of[solo], (arm, solo)
    gates = {
        t.name: t.gateway["pools"]["one"].get("prefill_gate_reserve_tokens")
        for t in setup.targets
        if not t.direct
    }
    assert gates == {"budgets": None, "recipe": 12_000, "recipe-tight": 12_000, "recipe-step": 12_000}
    # Sustained: long prompts throughout the run, beside at least 150 s of the chat trace.
    plan = build_schedule(scenario.workload)
    noisy = [r.at_s for r in plan if r.group == "noisy"]
    assert scenario.workload.duration_s >= 150 and max(noisy) > 0.8 * scenario.workload.duration_s
