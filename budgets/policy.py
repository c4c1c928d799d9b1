"""The grant policy: pure, synchronous, deterministic. No asyncio, no clock, no I/O.

Both stores make exactly these decisions (the Redis store re-implements them in Lua), so the rules
are written out here and kept simple. ``now`` is always passed in.

State
-----
- ``in_flight[pool]``: tokens held by live leases (integers).
- Waiting tickets, each ``(seq, demand, enqueued_at)``; ``seq`` is a store-wide counter that only
  grows. Tickets wait in one FIFO per ``(tier, tenant)``; the *head* of a FIFO is its lowest seq.
- ``counters[tenant]``: the virtual token counter (VTC), a float >= 0.
- ``leases_by_tenant[tenant]``: number of live leases (only used by the lift rule).
- A tenant is *backlogged* while it has at least one waiting ticket, in any tier.

Limits
------
``limit(pool, tier)`` = ``capacity`` for a private pool (``shared=False``), and
``floor(ceiling(tier) * capacity)`` for a shared pool. A demand *fits* when, for every pool it names,
``in_flight[pool] + cost <= limit(pool, tier)``. ``NeverFits`` is raised up front when
``cost > limit(pool, tier)`` for some pool (it could not fit even with the pool empty).

Service charged (VTC: service is what was served, never what was reserved)
-----------------------------------------------------------------------------
- On grant, the prompt: ``counters[t] += prefill_weight * prefill / weight(t)``.
- On release, the output actually served:
  ``counters[t] += decode_weight * served_output(decode, actual_decode) / weight(t)``
  (skipped when the tenant is no longer in the layout), where ``served_output`` is

  - the reported completion tokens clamped to ``[0, decode]``: the backend was told
    ``max_tokens = decode``, so a report above the reservation is a lie that cannot have been
    served, and a negative one cannot refund anything;
  - the whole reservation ``decode`` when the report is missing or is not a whole number
    (``None``, a bool, NaN, ``2.5``; an integral float such as ``4.0`` counts as 4): an
    unmeasured request is assumed to have used what it reserved, so withholding usage never
    buys priority. Reaped leases are charged this way too;
  - ``0`` for a grant that never reached its caller (the waiter was cancelled as it was granted):
    nothing was served.

Counters therefore only grow, and never hold reservations that were not served. The reason is the
lift rule below: a newcomer is lifted to a busy tenant's counter; if that counter held the busy
tenant's in-flight reservations and each release refunded the unserved part, the busy tenant would
drop back below the newcomer at every release and keep the pool (issue 9: a newcomer waited behind
all 27 queued requests of a tenant reserving 1,992 output tokens and using 4). With service counted
as served, a newcomer whose demand fits is granted at the first release after its arrival that
serves the busy tenant any output; a release reporting 0 leaves the two counters equal, the tie goes
to the earlier ticket (the busy tenant's), whose prompt is charged, so the newcomer goes next.

Bound (Sheng et al., OSDI 2024): two tenants backlogged over a stretch of time are charged
service (divided by weight) that differs by at most ``U / weight(f) + U / weight(g)`` with
``U = max(prefill_weight * L_in, decode_weight * M)``, ``L_in`` the longest prompt and ``M`` the
pool's capacity. It assumes ``prefill_weight <= decode_weight`` and one tier, and does not cover
backfill (a tenant passing a blocked head for up to ``backfill_limit_s``);
tests/budgets/test_fair_share_bound.py checks it on every store, with ``backfill_limit_s = 0`` and
adversarial usage reports.

Lift rule (applied when a tenant that is *not backlogged* enqueues or is granted on the fast path)
--------------------------------------------------------------------------------------------------
1. ``base`` = min counter over the *other* backlogged tenants; if there are none,
   min counter over the *other* tenants with at least one live lease; if none either, no base.
2. A tenant with a counter: ``counter = max(counter, base)`` (unchanged when there is no base).
3. A tenant never seen (no counter): ``counter = base``, or, with no base, the min over all existing
   counters, or 0.0 when there are none.

Using in-flight tenants when nobody else is backlogged matters: without it, a tenant idle while
another was served alone (fast path, never backlogged) would keep its old low counter and, once both
queue, take the pool exclusively until it "caught up".

Grant pass (``grant_pass``; run on enqueue, release, reap, withdrawal and layout change)
---------------------------------------------------------------------------------------
::

    held_all = {}                      # shared pools no later ticket may be granted on
    scanned = 0
    for tier in tiers that have waiting tickets, by (rank, name):
        held_lower = {}                # shared pools held against *later tiers* only
        candidates = {tenant: head of its (tier, tenant) FIFO}
        while candidates and scanned < max_scan:
            pick the candidate with the smallest (counters[tenant], head.seq, tenant)
            scanned += 1
            private_ok  = every private pool of the demand: in_flight + cost <= capacity
            shared_full = some shared pool: in_flight + cost > floor(ceiling(tier) * capacity)
            held        = some shared pool of the demand is in held_all
            if private_ok and not shared_full and not held:
                GRANT: in_flight[p] += cost for every pool; charge the VTC; pop the ticket;
                the tenant's next ticket in this FIFO (if any) becomes its candidate, with the
                updated counter
            else:
                remove the tenant from candidates (FIFO: nothing of it in this tier passes its head)
                if private_ok and shared_full:        # blocked by a shared pool's capacity/ceiling
                    held_lower |= shared pools of the demand
                    if now - head.enqueued_at >= backfill_limit_s:
                        held_all |= shared pools of the demand
        held_all |= held_lower
        stop if scanned == max_scan

What that means:
- Tier first, then fair share (lowest counter), then FIFO per tenant; ties by seq (unique, so the
  tenant-name tie-break never decides in practice, it is there for completeness).
- A ticket blocked only by private pools (its tenant's budget) never holds anything: other tenants
  proceed. A ticket blocked only by a hold does not create holds of its own (no cascades).
- Backfill: a ticket blocked by a shared pool's capacity or ceiling lets later tickets of its own tier
  take that pool only while it has waited (since enqueue) less than ``backfill_limit_s``; from then
  on it holds *all* its shared pools against every later ticket, so they drain to it (no starvation).
- Priority: a blocked ticket holds its shared pools against *lower* tiers at once (a higher tier is
  never overtaken on a pool by a lower tier). Tickets on other pools proceed.
- Holds are recomputed by every pass from the waiting tickets and ``now``; nothing about them is
  stored. A hold can only prevent grants, so a pass that runs late never misses one.
- Bounded work: at most ``max_scan`` tickets are examined per pass (granted or not).
- Fast path (``grant_immediately``): when no ticket is waiting at all, a demand that fits is
  granted at once (lift, then charge). This is exactly what enqueue + grant pass would decide.

Driving the policy (every store, in this order; ``now`` = the store clock at that moment)
------------------------------------------------------------------------------------------
- ``acquire(demand, max_wait_s)``:
  1. ``check_demand``: UnknownTenantOrTier / NeverFits (ValueError for negative or duplicate pools).
  2. ``grant_immediately`` -> granted.
  3. ``enqueue`` (lift if the tenant was not backlogged), then a grant pass; if it granted the new
     ticket -> granted (a full tenant queue does not refuse a demand that never has to wait).
  4. If the tenant already had ``>= max_queue_len`` waiting tickets before this one: withdraw it,
     grant pass, QueueFull.
  5. Wait at most ``min(max_wait_s, tier.max_queue_wait_s)``; then withdraw, grant pass, QueueTimeout.
- Every withdrawal (timeout, cancellation) is followed by a grant pass: the ticket may have been
  holding pools.
- ``release``: ``release`` (charging the served output), then a grant pass. Reaping: ``release``
  of each expired lease with no usage (the whole reservation is charged), then one grant pass. A
  grant whose waiter is already gone is given back with ``actual_decode=0``.
- ``apply_layout``: replace the layout (leases and counters stay), ``drop_invalid`` (those waiters
  fail with the returned error), then a grant pass.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from budgets.types import (
    AdmissionError,
    BudgetLayout,
    Demand,
    NeverFits,
    PoolSpec,
    TierSpec,
    UnknownTenantOrTier,
)


@dataclass(slots=True)
class Ticket:
    seq: int
    demand: Demand
    enqueued_at: float


@dataclass(slots=True)
class PolicyState:
    layout: BudgetLayout
    in_flight: dict[str, int] = field(default_factory=dict)
    queues: dict[tuple[str, str], deque[Ticket]] = field(default_factory=dict)  # (tier, tenant) -> FIFO
    waiting: dict[int, Ticket] = field(default_factory=dict)  # seq -> ticket
    tenant_waiting: dict[str, int] = field(default_factory=dict)  # only tenants with > 0
    counters: dict[str, float] = field(default_factory=dict)
    leases_by_tenant: dict[str, int] = field(default_factory=dict)  # only tenants with > 0
    next_seq: int = 1


# ---- limits and validation ----


def pool_limit(pool: PoolSpec, tier: TierSpec) -> int:
    if not pool.shared:
        return pool.capacity
    return math.floor(tier.ceiling * pool.capacity)


def check_demand(layout: BudgetLayout, demand: Demand) -> None:
    """Raise UnknownTenantOrTier or NeverFits if the demand can never be granted under ``layout``."""
    if demand.prefill < 0 or demand.decode < 0:
        raise ValueError(f"negative token counts in {demand!r}")
    if len(set(demand.pools)) != len(demand.pools):
        raise ValueError(f"duplicate pools in {demand.pools!r}")
    if demand.tenant not in layout.tenants:
        raise UnknownTenantOrTier(f"unknown tenant {demand.tenant!r}")
    tier = layout.tiers.get(demand.tier)
    if tier is None:
        raise UnknownTenantOrTier(f"unknown tier {demand.tier!r}")
    cost = demand.cost
    for name in demand.pools:
        pool = layout.pools.get(name)
        if pool is None:
            raise UnknownTenantOrTier(f"unknown pool {name!r}")
        limit = pool_limit(pool, tier)
        if cost > limit:
            raise NeverFits(_never_fits_message(demand, pool, tier, limit), pool=name, cost=cost, limit=limit)


def _never_fits_message(demand: Demand, pool: PoolSpec, tier: TierSpec, limit: int) -> str:
    kind, _, short = pool.name.partition(":")
    if kind == "tenant":
        raise_hint = f"raise budget_tokens of tenant {short}"
    elif kind == "backend":
        raise_hint = f"raise capacity_tokens of backend pool {short} (or route this class to a larger pool)"
    else:
        raise_hint = f"raise the capacity of pool {pool.name}"
    if pool.shared and limit < pool.capacity:
        where = (
            f"pool {pool.name} grants tier {tier.name} at most {limit} tokens "
            f"({tier.ceiling:.0%} ceiling of capacity {pool.capacity})"
        )
        raise_hint += ", or use a tier with a higher ceiling"
    else:
        where = f"pool {pool.name} has capacity {pool.capacity} tokens"
    return (
        f"request costs {demand.cost} tokens (prompt {demand.prefill} + reserved output {demand.decode}) "
        f"but {where}; it can never be admitted: lower max_tokens / shorten the prompt, or {raise_hint}"
    )


def fits(state: PolicyState, demand: Demand) -> bool:
    layout = state.layout
    tier = layout.tiers[demand.tier]
    cost = demand.cost
    for name in demand.pools:
        if state.in_flight.get(name, 0) + cost > pool_limit(layout.pools[name], tier):
            return False
    return True


# ---- fair share ----


def usage_report(reported: object) -> int | None:
    """A reported output-token count as a whole number, or None when it is missing or not one.

    Reports cross a trust boundary (the backend's ``usage``); anything that is not a whole number
    (a bool, NaN, infinity, ``2.5``, a string) is treated as no report at all.
    """
    if isinstance(reported, bool):
        return None
    if isinstance(reported, int):
        return reported
    if isinstance(reported, float) and math.isfinite(reported) and reported.is_integer():
        return int(reported)
    return None


def served_output(decode: int, actual_decode: object) -> int:
    """Output tokens to charge for a lease that reserved ``decode``: the report clamped to
    ``[0, decode]``, or the whole reservation when there is no usable report (module docstring)."""
    reported = usage_report(actual_decode)
    if reported is None:
        return decode
    return min(max(reported, 0), decode)


def prompt_service(layout: BudgetLayout, demand: Demand) -> float:
    """What a grant charges: the prompt, weighted, divided by the tenant's weight."""
    return layout.policy.prefill_weight * demand.prefill / layout.tenants[demand.tenant].weight


def lift(state: PolicyState, tenant: str) -> None:
    """Apply the lift rule for ``tenant``; the caller guarantees the tenant is not backlogged."""
    counters = state.counters
    base: float | None = None
    for other in state.tenant_waiting:
        if other != tenant:
            c = counters[other]
            if base is None or c < base:
                base = c
    if base is None:
        for other in state.leases_by_tenant:
            if other != tenant:
                c = counters[other]
                if base is None or c < base:
                    base = c
    own = counters.get(tenant)
    if own is None:
        counters[tenant] = base if base is not None else min(counters.values(), default=0.0)
    elif base is not None and base > own:
        counters[tenant] = base


def _charge(state: PolicyState, demand: Demand) -> None:
    cost = demand.cost
    if cost:  # in_flight holds only pools with tokens in flight
        for name in demand.pools:
            state.in_flight[name] = state.in_flight.get(name, 0) + cost
    tenant = demand.tenant
    state.counters[tenant] = state.counters.get(tenant, 0.0) + prompt_service(state.layout, demand)
    state.leases_by_tenant[tenant] = state.leases_by_tenant.get(tenant, 0) + 1


def release(state: PolicyState, demand: Demand, actual_decode: int | None) -> None:
    """Return a lease's tokens; charge the tenant's VTC for the output it was served."""
    cost = demand.cost
    for name in demand.pools:
        left = state.in_flight.get(name, 0) - cost
        if left > 0:
            state.in_flight[name] = left
        else:
            state.in_flight.pop(name, None)
    tenant = demand.tenant
    n = state.leases_by_tenant.get(tenant, 0) - 1
    if n > 0:
        state.leases_by_tenant[tenant] = n
    else:
        state.leases_by_tenant.pop(tenant, None)
    spec = state.layout.tenants.get(tenant)
    if spec is not None and tenant in state.counters:
        served = served_output(demand.decode, actual_decode)
        if served:  # adding 0.0 changes nothing; the Lua port skips the write the same way
            state.counters[tenant] += state.layout.policy.decode_weight * served / spec.weight


# ---- queue operations ----


def grant_immediately(state: PolicyState, demand: Demand) -> bool:
    """The fast path: grant now iff nothing at all is waiting and the demand fits."""
    if state.waiting or not fits(state, demand):
        return False
    lift(state, demand.tenant)
    _charge(state, demand)
    return True


def enqueue(state: PolicyState, demand: Demand, now: float) -> Ticket:
    tenant = demand.tenant
    if tenant not in state.tenant_waiting:
        lift(state, tenant)
    ticket = Ticket(state.next_seq, demand, now)
    state.next_seq += 1
    state.waiting[ticket.seq] = ticket
    state.tenant_waiting[tenant] = state.tenant_waiting.get(tenant, 0) + 1
    state.queues.setdefault((demand.tier, tenant), deque()).append(ticket)
    return ticket


def _forget(state: PolicyState, ticket: Ticket) -> None:
    del state.waiting[ticket.seq]
    tenant = ticket.demand.tenant
    n = state.tenant_waiting[tenant] - 1
    if n > 0:
        state.tenant_waiting[tenant] = n
    else:
        del state.tenant_waiting[tenant]


def withdraw(state: PolicyState, seq: int) -> Ticket | None:
    """Remove a waiting ticket (timeout, cancellation, shutdown); None if it is no longer waiting."""
    ticket = state.waiting.get(seq)
    if ticket is None:
        return None
    key = (ticket.demand.tier, ticket.demand.tenant)
    fifo = state.queues[key]
    fifo.remove(ticket)
    if not fifo:
        del state.queues[key]
    _forget(state, ticket)
    return ticket


def drop_invalid(state: PolicyState) -> list[tuple[Ticket, AdmissionError]]:
    """After a layout change: withdraw tickets that can now never be granted, with the reason."""
    dropped: list[tuple[Ticket, AdmissionError]] = []
    for ticket in list(state.waiting.values()):
        try:
            check_demand(state.layout, ticket.demand)
        except AdmissionError as err:
            withdraw(state, ticket.seq)
            dropped.append((ticket, err))
    return dropped


def grant_pass(state: PolicyState, now: float) -> list[Ticket]:
    """Grant waiting tickets in rank order (see the module docstring); returns them in grant order."""
    if not state.waiting:
        return []
    layout = state.layout
    by_tier: dict[str, list[str]] = {}
    for tier_name, tenant in state.queues:
        by_tier.setdefault(tier_name, []).append(tenant)
    tier_order = sorted(by_tier, key=lambda name: (layout.tiers[name].rank, name))
    max_scan = layout.policy.max_scan
    backfill_limit = layout.policy.backfill_limit_s
    counters = state.counters
    in_flight = state.in_flight
    granted: list[Ticket] = []
    held_all: set[str] = set()
    scanned = 0
    for tier_name in tier_order:
        tier = layout.tiers[tier_name]
        held_lower: set[str] = set()
        heap: list[tuple[float, int, str]] = []
        for tenant in by_tier[tier_name]:
            head = state.queues[(tier_name, tenant)][0]
            heap.append((counters[tenant], head.seq, tenant))
        heapq.heapify(heap)
        while heap and scanned < max_scan:
            _, _, tenant = heapq.heappop(heap)
            fifo = state.queues[(tier_name, tenant)]
            ticket = fifo[0]
            scanned += 1
            demand = ticket.demand
            cost = demand.cost
            private_ok = True
            shared_full = False
            held = False
            for name in demand.pools:
                pool = layout.pools[name]
                used = in_flight.get(name, 0)
                if not pool.shared:
                    if used + cost > pool.capacity:
                        private_ok = False
                else:
                    if used + cost > pool_limit(pool, tier):
                        shared_full = True
                    if name in held_all:
                        held = True
            if private_ok and not shared_full and not held:
                fifo.popleft()
                _forget(state, ticket)
                _charge(state, demand)
                granted.append(ticket)
                if fifo:
                    heapq.heappush(heap, (counters[tenant], fifo[0].seq, tenant))
                else:
                    del state.queues[(tier_name, tenant)]
            elif private_ok and shared_full:
                shared = [name for name in demand.pools if layout.pools[name].shared]
                held_lower.update(shared)
                if now - ticket.enqueued_at >= backfill_limit:
                    held_all.update(shared)
        held_all |= held_lower
        if scanned >= max_scan:
            break
    return granted


def tokens_ahead(state: PolicyState, pool: str, rank: int) -> int:
    """Tokens of waiting tickets on ``pool`` in tiers ranked ``rank`` or better (for retry estimates)."""
    tiers = state.layout.tiers
    total = 0
    for ticket in state.waiting.values():
        d = ticket.demand
        tier = tiers.get(d.tier)
        if tier is not None and tier.rank <= rank and pool in d.pools:
            total += d.cost
    return total
