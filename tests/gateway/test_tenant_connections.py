"""`TenantConnections`: client connections counted per tenant (gateway/request/tenant_connections.py)."""

from __future__ import annotations

import pytest

from gateway.process.signals import Connection
from gateway.request.errors import ApiError
from gateway.request.tenant_connections import TenantConnections


def test_a_tenant_past_its_share_gets_a_429_that_closes_the_connection() -> None:
    conns = TenantConnections(most=2)
    a, b, c = Connection(), Connection(), Connection()
    conns.claim(a, "t")
    conns.claim(a, "t")  # its next request on the same connection: nothing new
    conns.claim(b, "t")
    with pytest.raises(ApiError) as err:
        conns.claim(c, "t")
    assert (err.value.status, err.value.code, err.value.close) == (429, "too_many_connections", True)
    assert (b"connection", b"close") in err.value.headers()
    assert conns.by_tenant == {"t": 2} and c.owner is None


def test_a_connection_moves_to_the_tenant_of_its_latest_request_and_closing_gives_it_back() -> None:
    conns = TenantConnections(most=2)
    shared = Connection()
    conns.claim(shared, "t")
    conns.claim(shared, "u")
    assert conns.by_tenant == {"u": 1} and shared.owner == "u"
    shared.closed()
    shared.closed()  # once only
    assert conns.by_tenant == {} and conns.total == 0


def test_a_client_gone_before_its_request_is_counted_holds_nothing() -> None:
    # The protocol closes the connection while the app is still on its way to the claim: counted
    # then, it would never be given back, and the tenant's share would shrink for good.
    conns = TenantConnections(most=1)
    gone = Connection()
    gone.closed()
    conns.claim(gone, "t")
    assert conns.by_tenant == {}
    conns.claim(Connection(), "t")  # the tenant's one connection is still there to take
    assert conns.by_tenant == {"t": 1}


def test_zero_means_no_share() -> None:
    conns = TenantConnections(most=0)
    for _ in range(10_000):
        conns.claim(Connection(), "t")
    assert conns.total == 10_000
