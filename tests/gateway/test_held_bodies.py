"""`HeldBodies`: bytes of request bodies held per tenant and in all (gateway/request/held_bodies.py)."""

from __future__ import annotations

import pytest

from gateway.request.errors import ApiError
from gateway.request.held_bodies import HeldBodies


def test_a_tenant_over_its_share_gets_a_429_and_anyone_over_the_whole_a_503() -> None:
    held = HeldBodies(most=100, most_per_tenant=60)
    held.take("a", 60)
    with pytest.raises(ApiError) as err:
        held.take("a", 1)
    assert (err.value.status, err.value.code) == (429, "too_many_body_bytes")
    held.take("b", 40)
    with pytest.raises(ApiError) as err:
        held.take("c", 1)
    assert (err.value.status, err.value.code) == (503, "overloaded")
    assert (held.total, held.by_tenant) == (100, {"a": 60, "b": 40})  # a refusal takes nothing


def test_resizing_and_giving_back_return_to_zero_and_zero_means_no_bound() -> None:
    held = HeldBodies(most=100, most_per_tenant=60)
    held.take("a", 60)
    held.resize("a", 60, 10)  # a chunked body, read: its real size
    held.take("a", 50)
    held.give_back("a", 10)
    held.give_back("a", 50)
    assert (held.total, held.by_tenant) == (0, {})
    free = HeldBodies(most=0, most_per_tenant=0)
    free.take("a", 10**12)
    assert free.total == 10**12


def test_in_open_mode_the_one_tenant_is_everyone_so_only_the_whole_is_bounded() -> None:
    held = HeldBodies(most=100, most_per_tenant=60)
    held.take("default", 90, open_mode=True)
    with pytest.raises(ApiError) as err:
        held.take("default", 20, open_mode=True)
    assert err.value.status == 503
