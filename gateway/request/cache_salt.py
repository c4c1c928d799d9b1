"""The prefix-cache salt a request carries to a backend that keeps tenants' caches apart.

An engine with prefix caching serves a prompt whose first blocks it has cached faster: another
tenant can time its own requests to learn whether a guessed prefix (a system prompt, a document,
the start of someone's question) is cached, and so what others sent (CVE-2025-46570; nearly
perfectly distinguishable at 8 tokens). vLLM's ``cache_salt`` enters the hash of a request's first
block, so only requests with the same salt share cached blocks (SGLang reads the same field for
its radix cache), and a caller that sets a salt shares with whoever sets the same one: the salt
must come from the serving stack, not the caller.

On a backend with ``cache_salt: tenant`` the gateway sets it on every JSON body to the value
below: a function of the authenticated tenant (so all of a tenant's requests share their cache,
across every replica, and no other tenant's ever do) and of the salt the client sent, if any (so a
tenant can still keep some of its requests apart from its others). Nothing a client sends can make
its salt equal another tenant's short of a SHA-256 collision; no secret is needed for that, only
that tenants reach backends through the gateway.
"""

from __future__ import annotations

import hashlib

import orjson

_DOMAIN = b"tokengate cache_salt v1\x00"


def tenant_cache_salt(tenant: str, client_salt: object = None) -> str:
    """``tg-`` + 32 hex digits (128 bits) of SHA-256 over the tenant's name (length-prefixed, so no
    two (tenant, client salt) pairs write the same bytes) and the client's own salt."""
    h = hashlib.sha256(_DOMAIN)
    name = tenant.encode("utf-8", "surrogatepass")
    h.update(len(name).to_bytes(4, "big"))
    h.update(name)
    if client_salt is not None:
        own = client_salt if isinstance(client_salt, str) else orjson.dumps(client_salt).decode()
        h.update(own.encode("utf-8", "surrogatepass"))
    return "tg-" + h.hexdigest()[:32]
