"""Admin tokens and their roles: ``admin`` may change things, ``read`` may only look.

Tokens come from the environment (``TOKENGATE_ADMIN_TOKEN``, ``TOKENGATE_READONLY_TOKEN``) and/or a
file named by ``admin.tokens_file`` with one ``<role> <token>`` per line (``#`` comments). With no
token at all the admin API is off (404), never open. Tokens are kept only as SHA-256 digests and
compared with ``hmac.compare_digest`` against every known digest, so a lookup takes the same time
whichever token (or none) matches.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ADMIN_ENV = "TOKENGATE_ADMIN_TOKEN"
READONLY_ENV = "TOKENGATE_READONLY_TOKEN"
METRICS_ENV = "TOKENGATE_METRICS_TOKEN"


class Role(enum.Enum):
    READ = "read"
    ADMIN = "admin"
    METRICS = "metrics"  # may read /metrics only (a token for Prometheus)

    def allows(self, needed: Role) -> bool:
        if self is Role.ADMIN:
            return True
        if self is Role.READ:
            return needed in (Role.READ, Role.METRICS)
        return needed is Role.METRICS


@dataclass(frozen=True, slots=True)
class Caller:
    role: Role
    fingerprint: str  # first 8 hex digits of the token's digest: names the actor in the audit log


class AdminTokens:
    def __init__(self, tokens: Mapping[str, Role]) -> None:
        self._digests = [(hashlib.sha256(t.encode()).digest(), r) for t, r in tokens.items() if t]

    @property
    def enabled(self) -> bool:
        """Whether any admin or read-only token exists (else the admin API is off)."""
        return any(r in (Role.ADMIN, Role.READ) for _, r in self._digests)

    @property
    def metrics_token_set(self) -> bool:
        return any(r is Role.METRICS for _, r in self._digests)

    def caller(self, authorization: str | None) -> Caller | None:
        """The caller of an ``Authorization: Bearer <token>`` header, or None."""
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        digest = hashlib.sha256(token.encode()).digest()
        found: Role | None = None
        for known, role in self._digests:  # no early exit: the same work whatever matches
            if hmac.compare_digest(known, digest) and found is None:
                found = role
        return None if found is None else Caller(found, digest.hex()[:8])


def load_tokens(tokens_file: str | None, environ: Mapping[str, str] | None = None) -> AdminTokens:
    """Tokens from the environment and ``tokens_file``; a bad file raises ValueError naming the line."""
    env = os.environ if environ is None else environ
    tokens: dict[str, Role] = {}
    for name, role in ((ADMIN_ENV, Role.ADMIN), (READONLY_ENV, Role.READ), (METRICS_ENV, Role.METRICS)):
        value = env.get(name, "").strip()
        if value:
            tokens[value] = role
    if tokens_file:
        path = Path(tokens_file)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ValueError(f"admin.tokens_file: cannot read {path}: {exc.strerror or exc}") from None
        for n, line in enumerate(lines, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            role_name, _, token = text.partition(" ")
            try:
                role = Role(role_name)
            except ValueError:
                raise ValueError(
                    f"admin.tokens_file: {path}:{n}: expected '<role> <token>' with role admin, read or metrics"
                ) from None
            if not token.strip():
                raise ValueError(f"admin.tokens_file: {path}:{n}: the token is missing")
            tokens[token.strip()] = role
    return AdminTokens(tokens)
