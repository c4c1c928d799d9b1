"""API keys -> tenants (plain and sha256-stored), 401s, open mode, tier lowering."""

from __future__ import annotations

import pytest

from gateway.config.loader import hash_key, parse_config
from gateway.request.auth import Authenticator, bearer_key
from gateway.request.errors import ApiError

CFG = parse_config(
    {
        "tenants": {
            "acme": {"keys": ["sk-acme-1", "sk-acme-2"], "tier": "critical"},
            "free": {"keys": [hash_key("sk-free-1")], "tier": "batch"},
        }
    }
)


def test_plain_and_hashed_keys() -> None:
    auth = Authenticator(CFG)
    assert auth.authenticate("sk-acme-1").name == "acme"
    assert auth.authenticate("sk-acme-2").name == "acme"
    assert auth.authenticate("sk-free-1").name == "free"


@pytest.mark.parametrize(
    ("key", "code"), [(None, "missing_api_key"), ("", "missing_api_key"), ("sk-nope", "invalid_api_key")]
)
def test_missing_or_unknown_key_is_401(key: str | None, code: str) -> None:
    with pytest.raises(ApiError) as err:
        Authenticator(CFG).authenticate(key)
    assert err.value.status == 401 and err.value.code == code
    assert "sk-nope" not in err.value.message  # never echo a key


def test_stored_hash_is_not_a_key() -> None:
    with pytest.raises(ApiError):
        Authenticator(CFG).authenticate(hash_key("sk-free-1"))


def test_open_mode_accepts_anything() -> None:
    auth = Authenticator(parse_config({}))
    assert auth.authenticate(None).name == "default"
    assert auth.authenticate("whatever").name == "default"


def test_tier_may_be_lowered_not_raised() -> None:
    auth = Authenticator(CFG)
    acme, free = auth.authenticate("sk-acme-1"), auth.authenticate("sk-free-1")
    assert auth.tier_for(acme, None).name == "critical"
    assert auth.tier_for(acme, "batch").name == "batch"
    assert auth.tier_for(free, "batch").name == "batch"
    with pytest.raises(ApiError) as err:
        auth.tier_for(free, "critical")
    assert err.value.status == 403 and err.value.param == "x-tokengate-tier"
    with pytest.raises(ApiError) as err:
        auth.tier_for(acme, "gold")
    assert err.value.status == 400


def test_bearer_parsing() -> None:
    assert bearer_key("Bearer sk-1") == "sk-1"
    assert bearer_key("bearer   sk-1 ") == "sk-1"
    assert bearer_key("Basic abc") is None
    assert bearer_key("Bearer") is None
