"""Model -> pool resolution, backend choice by free capacity, the passive circuit breaker."""

from __future__ import annotations

import pytest

from gateway.upstream.pools import BackendPoolSpec, BackendSpec, BreakerSettings, NoBackend, Router


def router(breaker: BreakerSettings = BreakerSettings()) -> Router:
    return Router(
        [
            BackendPoolSpec(
                "short",
                (
                    BackendSpec("http://a", 1000, models=("m1",)),
                    BackendSpec("http://b", 2000, models=("m1", "m2")),
                ),
            ),
            BackendPoolSpec("long", (BackendSpec("http://c", 5000, models=("m1", "m3")),)),
        ],
        breaker,
    )


def test_unknown_model_is_404_naming_served_models() -> None:
    r = router()
    with pytest.raises(NoBackend) as err:
        r.choose_pool("gpt-9", None, None)
    assert err.value.unknown_model
    assert "m1, m2, m3" in err.value.message


def test_home_pool_and_class_pool() -> None:
    r = router()
    assert r.choose_pool("m1", None, None) == "short"
    assert r.choose_pool("m3", None, None) == "long"
    assert r.choose_pool("m1", "long", None) == "long"
    with pytest.raises(NoBackend) as err:
        r.choose_pool("m3", "short", None)  # the class routes where the model isn't served
    assert err.value.unknown_model and "long" in err.value.message


def test_overflow_when_primary_has_no_healthy_backend() -> None:
    r = router(BreakerSettings(failure_threshold=1, cooldown_s=0))
    for b in r.pools["long"].backends:
        b.record_connect_failure()
    assert r.choose_pool("m1", "long", "short") == "short"
    with pytest.raises(NoBackend) as err:
        r.choose_pool("m1", "long", None)
    assert not err.value.unknown_model


def test_pick_most_free_capacity_and_skip_unhealthy() -> None:
    r = router(BreakerSettings(failure_threshold=2, cooldown_s=10))
    pool = r.pools["short"]
    a, b = pool.backends
    assert pool.pick("m1") is b  # 2000 free vs 1000
    b.in_flight_tokens = 1500
    assert pool.pick("m1") is a  # 500 free vs 1000
    assert pool.pick("m2") is b  # only b serves m2
    b.record_connect_failure(now=0.0)
    assert b.healthy
    assert b.record_connect_failure(now=0.0)  # threshold reached: breaker opens
    assert not b.healthy and pool.pick("m2") is None
    assert not b.probe_succeeded(now=5.0)  # still cooling down
    assert b.probe_succeeded(now=10.5)
    assert b.healthy and b.consecutive_failures == 0


def test_success_resets_consecutive_failures() -> None:
    r = router(BreakerSettings(failure_threshold=2, cooldown_s=0))
    b = r.pools["long"].backends[0]
    b.record_connect_failure()
    b.record_success()
    b.record_connect_failure()
    assert b.healthy


def test_models_listing_merges_configured_and_discovered() -> None:
    r = Router(
        [BackendPoolSpec("p", (BackendSpec("http://a", 10, models=("x",)), BackendSpec("http://b", 10)))]
    )
    assert r.known_model("anything")  # b serves every model
    list(r.backends)[1].discovered_models = ("y", "x")
    assert r.served_models() == ["x", "y"]


class FakeLoad:
    def __init__(self, saturated: bool, penalty: float) -> None:
        self.saturated = saturated
        self._penalty = penalty

    def penalty(self) -> float:
        return self._penalty


def test_load_signal_penalises_and_avoids_saturated() -> None:
    pool = router().pools["short"]
    a, b = pool.backends  # b has more free tokens
    b.load = FakeLoad(False, 0.9)  # 2000 * 0.1 = 200 < a's 1000
    assert pool.pick("m1") is a
    b.load = FakeLoad(False, 0.0)
    a.load = FakeLoad(True, 1.0)
    assert pool.pick("m1") is b
    b.load = FakeLoad(True, 1.0)
    assert pool.pick("m1") is not None  # all saturated: still served
    assert pool.pick("m2") is b
