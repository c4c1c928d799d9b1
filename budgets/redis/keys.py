"""Redis key layout of one budget domain, and the flat encodings the Lua scripts read.

Every key of a domain starts with the hash tag ``{tg:<prefix>}``, so all of them live in one
Redis Cluster slot: a grant is atomic across the tenant, backend and class pools it names, and a
script can only be atomic within one slot. The consequence (documented in docs/redis.md): one
budget domain is served by one Redis primary, whatever the cluster size; scale out by splitting
independent domains (prefixes), not pools of one domain.

Keys (``T`` = ``{tg:<prefix>}``):

=========================  ======  ==========================================================
``T:layout``               hash    ``ver`` (int, bumped on change), ``digest``, ``json`` (the
                                   whole layout, for replicas)
``T:spec``                 hash    what the scripts read, one HMGET per call: ``ver``, ``pw``,
                                   ``dw``, ``backfill``, ``ttl``, ``max_scan``, ``idle``, ``qo``
                                   (queue order, max defer, defer per token), ``tiers`` (tier
                                   names in grant order), ``p:<pool>`` = ``"<capacity>|<0/1>"``
                                   (shared), ``t:<tier>`` = ``"<rank>|<ceiling>|<max_wait_s>"``,
                                   ``n:<tenant>`` = ``"<weight>|<max_queue_len>"``
``T:used``                 hash    pool -> tokens in flight (absent when 0)
``T:vtc``                  zset    tenant -> virtual token counter (the score: exact; the
                                   lowest is the first entry)
``T:vb`` / ``T:vl``        zset    counters of backlogged tenants / of tenants with live
                                   leases (the lift rule's bases)
``T:idle``                 zset    tenant -> idle since (no ticket, no lease): forgotten after
                                   ``idle_forget_s``
``T:tleases``              hash    tenant -> live leases (absent when 0)
``T:twait``                hash    tenant -> waiting tickets (absent when 0; = backlogged)
``T:ahead``                hash    ``<pool> SEP <tier>`` -> tokens of waiting tickets (retry-after)
``T:tierq``                hash    tier -> waiting tickets (absent when 0)
``T:rate``                 hash    pool -> ``"<tokens/s EWMA>|<last update>"`` (retry-after)
``T:leases``               hash    lease id -> packed lease (see :func:`pack_demand`)
``T:lexp``                 zset    lease id -> expiry (server time)
``T:gone``                 zset    lease id -> tombstone expiry (release of an unknown lease)
``T:reaped``               zset    lease id -> forget-at (recently reaped: release says False)
``T:seq``                  string  ticket sequence counter (only grows)
``T:tickets``              hash    seq -> packed ticket
``T:q:<n>:<tier>:<tenant>`` list   ticket seqs of one (tier, tenant) in arrival order; n = len(tier)
``T:qo:<n>:<tier>:<tenant>`` zset  shortest_first only: the same seqs by order key (policy.order_key),
                                   member struct-packed seq (ties by seq); the lowest is the head
``T:heads``                hash    ``<tier> SEP <tenant>`` -> that queue's head as the grant pass
                                   indexes it (age class, parked, rank, group, rank seq)
``T:gy|gc|go:<n>:<tier>:<g>`` zset per tier and group ``g`` (the shared pools a demand names):
                                   young heads by rank (``gy``, members ordered bytewise) and by
                                   cost (``gc``), old heads by rank (``go``)
``T:gt:<tier>``, ``T:gtiers`` set  groups with active heads in a tier; tiers with such groups
``T:pv:<pool>``            set     heads naming private pool ``<pool>`` (parked or not)
``T:age``                  zset    young heads by enqueue time (promotion to old)
``T:clock``                string  the latest ``now`` of a grant pass
``T:replicas``             zset    replica id -> liveness expiry (server time)
``T:rtk:<replica>``        set     seqs of that replica's waiting tickets (reaped when it dies)
``T:epoch``                string  random token written by the first replica to find Redis
                                   empty: a different token means Redis lost its data
``T:rejoin``               set     replicas that re-registered their leases after that; expires
                                   after the settle window (written by the store, not scripts)
=========================  ======  ==========================================================

Channels: ``T:wake:<replica>`` (grants and failures of that replica's tickets) and
``T:layout`` (new layout version). Pub/sub is not slot-bound; the names share the tag anyway.

Scripts receive ``T:layout`` as ``KEYS[1]`` (so a cluster client routes them to the domain's
slot) and derive every other name from it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

from budgets import policy
from budgets.types import BudgetLayout, Demand, PolicySpec, PoolSpec, TenantSpec, TierSpec

# Field and list separators of packed records: ASCII unit / record separators never occur in
# configured names (apply_layout rejects names containing control characters).
SEP = "\x1f"
LIST_SEP = "\x1e"


@dataclass(frozen=True, slots=True)
class KeyLayout:
    prefix: str

    @property
    def tag(self) -> str:
        return "{tg:" + self.prefix + "}"

    @property
    def layout(self) -> str:
        return self.tag + ":layout"

    @property
    def epoch(self) -> str:
        return self.tag + ":epoch"

    @property
    def rejoin(self) -> str:
        return self.tag + ":rejoin"

    def wake_channel(self, replica: str) -> str:
        return f"{self.tag}:wake:{replica}"

    @property
    def layout_channel(self) -> str:
        return self.tag + ":layout"

    def all_fixed(self) -> list[str]:
        """Every key name without a variable part (for tests and docs)."""
        names = ["layout", "spec", "used", "vtc", "tleases", "twait", "tierq", "rate"]
        names += ["leases", "lexp", "gone", "reaped", "seq", "tickets", "replicas", "epoch", "rejoin"]
        names += ["vb", "vl", "idle", "ahead", "heads", "age", "gtiers", "clock"]
        return [f"{self.tag}:{n}" for n in names]


def fmt_float(x: float) -> str:
    """Exact round-trip text of a double (Lua writes counters the same way)."""
    return repr(float(x)) if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def check_name(kind: str, name: str) -> None:
    if not name or any(ord(c) < 32 for c in name):
        raise ValueError(f"{kind} name {name!r} must be non-empty and free of control characters")


def pack_demand(demand: Demand) -> list[str]:
    """Script arguments for a demand: tenant, tier, prefill, decode, pools (LIST_SEP-joined).
    ``decode`` is ``<decode>/<decode_limit>`` when the limit is more than the reservation (lib.lua's
    ``demand`` reads both; records written before that field existed hold a plain number)."""
    decode = str(demand.decode)
    if demand.decode_limit > demand.decode:
        decode = f"{decode}/{demand.decode_limit}"
    return [demand.tenant, demand.tier, str(demand.prefill), decode, LIST_SEP.join(demand.pools)]


def usage_arg(actual_decode: int | None) -> str:
    """release.lua's usage argument ('' = unknown).

    A usage report crosses a trust boundary: only a whole number reaches the script; release.lua
    clamps it to the reservation exactly as policy.release does.
    """
    reported = policy.usage_report(actual_decode)
    return "" if reported is None else str(reported)


def layout_json(layout: BudgetLayout) -> str:
    """Canonical JSON of a layout (sorted keys): its digest decides whether anything changed."""
    pol, base = layout.policy, PolicySpec()
    policy: list[object] = [
        pol.prefill_weight,
        pol.decode_weight,
        pol.backfill_limit_s,
        pol.lease_ttl_s,
        pol.max_scan,
        pol.idle_forget_s,
    ]
    order = [pol.tenant_queue_order, pol.max_defer_s, pol.defer_s_per_token]
    if order != [base.tenant_queue_order, base.max_defer_s, base.defer_s_per_token]:
        # Only when set: a layout with the defaults keeps the digest older versions computed, so
        # an upgrade (replicas of both versions at once) does not flip the layout back and forth.
        policy += order
    doc = {
        "pools": {n: [p.capacity, p.shared] for n, p in sorted(layout.pools.items())},
        "tiers": {n: [t.rank, t.ceiling, t.max_queue_wait_s] for n, t in sorted(layout.tiers.items())},
        "tenants": {n: [t.weight, t.max_queue_len] for n, t in sorted(layout.tenants.items())},
        "policy": policy,
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def layout_from_json(text: str) -> BudgetLayout:
    doc = json.loads(text)
    # Later fields are absent from layouts written by older versions: their defaults apply.
    pw, dw, backfill, ttl, max_scan, *rest = doc["policy"]
    base = PolicySpec()
    idle = rest[0] if rest else base.idle_forget_s
    order, max_defer, per_token = base.tenant_queue_order, base.max_defer_s, base.defer_s_per_token
    if len(rest) >= 4:
        order, max_defer, per_token = rest[1], rest[2], rest[3]
    return BudgetLayout(
        pools={n: PoolSpec(n, int(c), bool(s)) for n, (c, s) in doc["pools"].items()},
        tiers={n: TierSpec(n, int(r), float(c), float(w)) for n, (r, c, w) in doc["tiers"].items()},
        tenants={n: TenantSpec(n, float(w), int(q)) for n, (w, q) in doc["tenants"].items()},
        policy=PolicySpec(
            prefill_weight=pw,
            decode_weight=dw,
            backfill_limit_s=backfill,
            lease_ttl_s=ttl,
            max_scan=int(max_scan),
            idle_forget_s=float(idle),
            tenant_queue_order=order,
            max_defer_s=float(max_defer),
            defer_s_per_token=float(per_token),
        ),
    )


def layout_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def layout_args(layout: BudgetLayout) -> list[str]:
    """apply_layout.lua's arguments: digest, json, policy, tier order, queue order (order, max defer,
    defer per token), then the three spec lists.

    Tier order is computed here, by (rank, name) with Python's string order, so Lua never has to
    compare names (its string comparison follows the server's locale).
    """
    for kind, names in (("pool", layout.pools), ("tier", layout.tiers), ("tenant", layout.tenants)):
        for name in names:
            check_name(kind, name)
    text = layout_json(layout)
    p = layout.policy
    order = sorted(layout.tiers.values(), key=lambda t: (t.rank, t.name))
    pools = [f"p:{n}{SEP}{s.capacity}|{int(s.shared)}" for n, s in layout.pools.items()]
    tiers = [
        f"t:{n}{SEP}{t.rank}|{fmt_float(t.ceiling)}|{fmt_float(t.max_queue_wait_s)}"
        for n, t in layout.tiers.items()
    ]
    tenants = [f"n:{n}{SEP}{fmt_float(t.weight)}|{t.max_queue_len}" for n, t in layout.tenants.items()]
    return [
        layout_digest(text),
        text,
        fmt_float(p.prefill_weight),
        fmt_float(p.decode_weight),
        fmt_float(p.backfill_limit_s),
        fmt_float(p.lease_ttl_s),
        str(int(p.max_scan)),
        fmt_float(p.idle_forget_s),
        LIST_SEP.join(t.name for t in order),
        LIST_SEP.join((p.tenant_queue_order, fmt_float(p.max_defer_s), fmt_float(p.defer_s_per_token))),
        LIST_SEP.join(pools),
        LIST_SEP.join(tiers),
        LIST_SEP.join(tenants),
    ]
