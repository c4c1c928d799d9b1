"""The grant policy: pure, synchronous, deterministic. No asyncio, no clock, no I/O.

Both stores make exactly these decisions (the Redis store re-implements them in Lua), so the rules
are written out here and kept simple. ``now`` is always passed in.

State
-----
- ``in_flight[pool]``: tokens held by live leases (integers). A demand holds ``held(pool)``:
  ``cost`` = prefill + decode in every pool it names, except its tenant's own pool
  (``tenant:<tenant>``) when it may produce more than it reserves (``decode_limit > decode``,
  learned reservations): there it holds prefill + ``decode_limit``, so a tenant's estimates never
  lift what it can have running past its budget. Below, "cost" in a pool means ``held(pool)``.
- Waiting tickets, each ``(seq, demand, enqueued_at)``; ``seq`` is a store-wide counter that only
  grows. Tickets wait in one queue per ``(tier, tenant)``; its *first* ticket is its lowest seq, and
  its *head* (the one ticket of it the grant pass looks at) is the first ticket, or under
  ``shortest_first`` the one with the lowest order key (below).
- ``counters[tenant]``: the virtual token counter (VTC), a float >= 0.
- ``leases_by_tenant[tenant]``: number of live leases (only used by the lift rule).
- A tenant is *backlogged* while it has at least one waiting ticket, in any tier.

Limits
------
``limit(pool, tier)`` = ``capacity`` for a private pool (``shared=False``), and
``floor(ceiling(tier) * capacity)`` for a shared pool. A demand *fits* when, for every pool it names,
``in_flight[pool] + held(pool) <= limit(pool, tier)``. ``NeverFits`` is raised up front when
``held(pool) > limit(pool, tier)`` for some pool (it could not fit even with the pool empty).

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
drop back below the newcomer at every release and keep the pool (measured: a newcomer waited behind
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

Order inside one tenant's queue (``PolicySpec.tenant_queue_order``)
-------------------------------------------------------------------
- ``fifo`` (the default): the head is the first ticket; tickets of a ``(tier, tenant)`` queue are
  granted in arrival order.
- ``shortest_first``: the head is the ticket with the lowest ``(order_key, seq)``, where
  ``order_key = enqueued_at + min(decode * defer_s_per_token, max_defer_s)``: shortest predicted
  output first (``decode`` is the reservation, i.e. the learned estimate under learned
  reservations), with aging built into the key. The key never changes while the ticket waits, so
  **a ticket is only ever passed by tickets of its own queue enqueued less than** ``max_defer_s``
  **after it** (any later one has ``order_key >= enqueued_at >=`` its key): its wait is its FIFO wait
  plus at most the service of what its own tenant sent in the next ``max_defer_s``.
- Never across tenants: the rank of a queue in the pass is ``(counter, first.seq, tenant)`` under
  either order (the first ticket's seq, not the head's), so which *tenant* is served next, and
  fair share, do not depend on the order inside queues; only which of its tickets it is served
  with (and so its cost) does.
- A newcomer with a lower key than the head becomes the head at once; the ticket it displaced is no
  head any more (it holds nothing) and is classed again, like any ticket, when it becomes head
  again: old at once if it has waited ``backfill_limit_s`` by then. Its holds are thus delayed by
  at most ``max_defer_s`` plus the newcomers' own ``backfill_limit_s``.
- A layout change re-keys every waiting ticket with the new settings (switching the order on or off
  takes effect for tickets already waiting).

Grant pass (``grant_pass``; run on enqueue, release, reap, withdrawal and layout change)
---------------------------------------------------------------------------------------
Words: a tenant's *head* in a tier is the head of its ``(tier, tenant)`` queue (above); its *rank*
is ``(counters[tenant], first.seq, tenant)``, ``first`` its queue's lowest seq (the head itself
under ``fifo``). A head is *old* once it has waited
``backfill_limit_s``, else *young*: a ticket that has waited that long when it becomes head is old
at once (``now - enqueued_at >= backfill_limit_s``, with the pass's ``now`` during a pass and the
latest pass's ``now``, ``state.clock``, outside one); a head that ages while it is head is made old
by ``promote`` below. A head stays old while it is head (a store clock stepping back changes nothing). A head's
*group* is its tier plus the set of shared pools its demand names; ``room(group)`` is the least
``limit(pool, tier) - in_flight[pool]`` over those pools (unbounded for none). A head *fits* when
its cost is at most the room of its group. ::

    promote: the young heads with now - enqueued_at >= backfill_limit_s become old, oldest first
             (by enqueued_at, then seq), at most max_scan of them (the rest at the next passes)
    held_all = {}                      # shared pools no later ticket may be granted on
    budget = max_scan                  # tickets the pass may still examine
    for tier in tiers that have waiting tickets, by (rank, name):
        held_lower = {}                # shared pools held against *later tiers* only
        cursor = below every rank
        loop:
            stop the pass if budget == 0
            candidates = the tier's heads ranked after cursor, except heads blocked by a private
                         pool (in_flight + cost > capacity) and heads naming a pool in held_all
            eligible   = old candidates, and young candidates of every group in which some young
                         candidate fits
            if no eligible:
                held_lower |= shared pools of every candidate      # young, and none fits
                break
            c = the eligible candidate with the lowest rank
            held_lower |= shared pools of every candidate ranked before c   # passed: none fits
            budget -= 1; cursor = rank(c)  # c is *examined*
            if c fits:
                GRANT: in_flight[p] += cost for every pool; charge the VTC; take the ticket out;
                the queue's next head (if any) is ranked with the updated counter; cursor = just
                below rank(c) (under shortest_first the next head may have c's very rank: a
                prompt of 0 tokens leaves the counter, and a granted head that was not the first
                ticket leaves first.seq, as they were)
            else:                         # blocked by a shared pool's capacity or ceiling
                held_lower |= shared pools of c
                if c is old: held_all |= shared pools of c
        held_all |= held_lower

What that means:
- Tier first, then fair share (lowest counter), then the tenant's queue order; ties by seq (unique, so the
  tenant-name tie-break never decides in practice, it is there for completeness).
- A ticket blocked by private pools (its tenant's budget) never holds anything: other tenants
  proceed. A ticket naming a held pool does not create holds of its own (no cascades).
- Backfill: a ticket blocked by a shared pool's capacity or ceiling lets later tickets of its own tier
  take that pool only while it has waited (since enqueue) less than ``backfill_limit_s``; from then
  on it holds *all* its shared pools against every later ticket, so they drain to it (no starvation).
- Priority: a blocked ticket holds its shared pools against *lower* tiers at once (a higher tier is
  never overtaken on a pool by a lower tier). Tickets on other pools proceed.
- Holds are recomputed by every pass from the waiting tickets and ``now``; nothing about them is
  stored. A hold can only prevent grants, so a pass that runs late never misses one.
- Bounded work: at most ``max_scan`` tickets are examined per pass (granted or found blocked on
  shared capacity). The rest waits for the next pass (the next enqueue, release, reap...).
- Fast path (``grant_immediately``): when no ticket is waiting at all, a demand that fits is
  granted at once (lift, then charge). This is exactly what enqueue + grant pass would decide.

Why the pass is written this way (so that one pass costs O(log n), not O(n)). The stores keep the
heads indexed (budgets/queue_index.py; sorted sets in Redis): per group, young heads by rank and by
cost, old heads by rank; heads blocked by a private pool parked until that pool changes; young heads
promoted to old as they age. A pass then looks at the lowest old head and the lowest young head of
each unheld group, and decides "no young head of this group fits" from the lowest young cost, without
visiting the heads. Three rules changed from the earlier pass, which looked at every head and
charged each look to ``max_scan``; with every demand naming at most one shared pool and neither a pass nor its promotions
cut short by ``max_scan``, the two make the same decisions (tests/budgets/test_policy_index.py
checks it against the earlier pass):

1. A ticket naming a held pool holds nothing, even when it also lacks capacity (before, it held its
   other shared pools too). It cannot be granted before the holder anyway, and it takes its own
   holds as soon as the hold on it ends; this is what lets a pass skip a held group whole.
2. ``max_scan`` counts examined tickets only. Tickets blocked by a private pool or by a hold, and
   young tickets passed because none of their group fits, are never looked at one by one, so they
   no longer use up the budget.
3. A head that ages while it is head becomes old at the start of a pass, at most ``max_scan`` per
   pass: a burst of heads that all age at once (say 100,000 tenants that queued in the same second)
   is promoted over several passes instead of in one long one, and each of them backfills like a
   young head until its turn. Old stays old, so that nothing is ever demoted.

Settled: the pass that has nothing to do costs nothing
-----------------------------------------------------
A pass that runs to its end (not cut short by ``max_scan``) leaves the state *settled*: run again
on the same heads, counters, in-flight tokens and layout, it would grant nothing (a pass grants
until no eligible head fits, and holds only ever prevent grants). Everything that changes what a
pass looks at unsettles the state: a release, an extension, a grant, a counter set, a withdrawal, a
layout change, forgetting idle tenants, and an enqueue that makes a new head that fits. An enqueue
behind an existing head does not (it changes no head, rank, room or hold), and neither does time,
except through promotions. Nor does a new head that does not fit (a private pool blocks it, or its
cost is more than its group's room), as long as no other group names one of its shared pools and a
shared pool it does not name: the heads that were there are as they were, and a head that cannot be
granted can then only add holds and use up ``max_scan``, which only ever prevent grants. Where such
a group exists, a new hold can *free* a pool: a head naming a held pool holds nothing (rule 1
above), so a head of that group that held its other pools stops holding them, and a head waiting
only on those may now be granted (a batch head on a class pool, freed when a new critical head
holds the backend pool of a standard head that named both). Such a new head unsettles the state.
(At 100,000 tenants with one ticket each on one pool, every acquire on a full pool makes a head
that leaves the state settled.) So a pass on a settled state that promotes nothing returns at once,
with exactly the decision a full pass would make. This is the common case under load: on a saturated pool every acquire queues behind its
tenant's own head or makes a head that does not fit, and its pass used to cost as much as the pass
after a release. (tests/budgets/test_policy_properties.py checks every such pass against a full one.)

Forgetting idle tenants (bounded memory)
----------------------------------------
A tenant with no waiting ticket and no live lease since ``idle_since[t]`` is *idle*. ``forget_idle``
(run by every store's reaper) deletes the counter of each tenant idle for at least
``idle_forget_s`` (``now - idle_since >= idle_forget_s``), oldest first; it comes back as a tenant
never seen (lift rule 3). Its debt is forgiven after that long: without this, per-tenant state
would grow with every tenant that ever sent a request.

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
  of each expired lease with no usage (the whole reservation is charged), then one grant pass,
  then ``forget_idle``. A grant whose waiter is already gone is given back with ``actual_decode=0``.
- ``apply_layout``: replace the layout (leases and counters stay), ``drop_invalid`` (those waiters
  fail with the returned error), then a grant pass.

Every function that changes the state takes the store's ``now`` where it can make a tenant idle.
The index (``state.index``) is derived state kept in step by these functions: code outside this
module changes counters only through ``set_counter`` and the layout only through ``apply_layout``
(or ``state.layout = ...`` followed by ``drop_invalid``).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from budgets.min_tree import MinMap, MostlyInOrder
from budgets.queue_index import Group, Head, QueueIndex, Ticket
from budgets.types import (
    AdmissionError,
    BudgetLayout,
    Demand,
    NeverFits,
    PolicySpec,
    PoolSpec,
    TierSpec,
    UnknownTenantOrTier,
)

__all__ = ["PolicyState", "Ticket"]

_NO_IDLE = (math.inf, "")  # above every (idle since, tenant): the idle order's empty slots


@dataclass(slots=True)
class PolicyState:
    layout: BudgetLayout
    in_flight: dict[str, int] = field(default_factory=dict)
    queues: dict[tuple[str, str], deque[Ticket]] = field(default_factory=dict)  # (tier, tenant) -> FIFO
    # shortest_first only: (tier, tenant) -> sorted [(order_key, seq)] of the same tickets
    ordered: dict[tuple[str, str], list[tuple[float, int]]] = field(default_factory=dict)
    waiting: dict[int, Ticket] = field(default_factory=dict)  # seq -> ticket
    tenant_waiting: dict[str, int] = field(default_factory=dict)  # only tenants with > 0
    counters: dict[str, float] = field(default_factory=dict)
    leases_by_tenant: dict[str, int] = field(default_factory=dict)  # only tenants with > 0
    next_seq: int = 1
    # Derived state, kept in step by this module (never decides anything by itself).
    clock: float = -math.inf  # the highest ``now`` a grant pass has seen
    index: QueueIndex = field(default_factory=QueueIndex)
    tier_waiting: dict[str, int] = field(default_factory=dict)  # only tiers with > 0
    ahead: dict[tuple[str, str], int] = field(default_factory=dict)  # (pool, tier) -> waiting tokens
    idle_since: dict[str, float] = field(default_factory=dict)  # tenants idle since (not forgotten)
    # (idle since, tenant) of the same tenants, oldest first (they go idle in clock order, mostly)
    idle_order: MostlyInOrder[str, tuple[float, str]] = field(default_factory=lambda: MostlyInOrder(_NO_IDLE))
    # The lift's bases, each counter in one of them (``_move``): backlogged tenants'; tenants'
    # with live leases and nothing waiting (rule 2 is asked only when no other tenant is
    # backlogged: every other leased tenant is here then); everyone else's (idle, or not active
    # yet: rule 3, asked when nobody else is backlogged or leased, when every counter is here).
    # So a counter that changes moves one tree, whatever its tenant is doing.
    backlog_min: MinMap[str, float] = field(default_factory=lambda: MinMap(math.inf))
    lease_min: MinMap[str, float] = field(default_factory=lambda: MinMap(math.inf))
    idle_min: MinMap[str, float] = field(default_factory=lambda: MinMap(math.inf))
    tier_order: tuple[BudgetLayout | None, tuple[str, ...]] = (None, ())  # (layout, tiers by rank)
    # The last grant pass ran to its end and nothing it looks at has changed since: the next pass
    # can only grant after a promotion (see "Settled" in the module docstring).
    settled: bool = False


# ---- limits and validation ----


def pool_limit(pool: PoolSpec, tier: TierSpec) -> int:
    if not pool.shared:
        return pool.capacity
    return math.floor(tier.ceiling * pool.capacity)


def check_demand(layout: BudgetLayout, demand: Demand) -> None:
    """Raise UnknownTenantOrTier or NeverFits if the demand can never be granted under ``layout``."""
    if demand.prefill < 0 or demand.decode < 0 or demand.decode_limit < 0:
        raise ValueError(f"negative token counts in {demand!r}")
    names = demand.pools
    if len(names) > 1 and len(set(names)) != len(names):
        raise ValueError(f"duplicate pools in {names!r}")
    if demand.tenant not in layout.tenants:
        raise UnknownTenantOrTier(f"unknown tenant {demand.tenant!r}")
    tier = layout.tiers.get(demand.tier)
    if tier is None:
        raise UnknownTenantOrTier(f"unknown tier {demand.tier!r}")
    cost = demand.cost
    pools = layout.pools
    for name in names:
        pool = pools.get(name)
        if pool is None:
            raise UnknownTenantOrTier(f"unknown pool {name!r}")
        limit = math.floor(tier.ceiling * pool.capacity) if pool.shared else pool.capacity  # pool_limit
        if demand.private_cost != demand.cost:
            cost = demand.held_in(name)
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
    held = demand.held_in(pool.name)
    if held != demand.cost:
        what = f"{held} tokens (prompt {demand.prefill} + output limit {held - demand.prefill})"
    else:
        what = f"{demand.cost} tokens (prompt {demand.prefill} + reserved output {demand.decode})"
    return (
        f"request costs {what} but {where}; it can never be admitted: lower max_tokens / shorten "
        f"the prompt, or {raise_hint}"
    )


def fits(state: PolicyState, demand: Demand) -> bool:
    layout = state.layout
    tier = layout.tiers[demand.tier]
    cost = demand.cost
    held = demand.private_cost != cost
    for name in demand.pools:
        if held:
            cost = demand.held_in(name)
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
    if type(actual_decode) is int:  # the usual report (a bool's type is not int): nothing to check
        return min(max(actual_decode, 0), decode)
    reported = usage_report(actual_decode)
    if reported is None:
        return decode
    return min(max(reported, 0), decode)


def prompt_service(layout: BudgetLayout, demand: Demand) -> float:
    """What a grant charges: the prompt, weighted, divided by the tenant's weight."""
    return layout.policy.prefill_weight * demand.prefill / layout.tenants[demand.tenant].weight


def set_counter(state: PolicyState, tenant: str, value: float) -> None:
    """Set a tenant's counter (tests, restores): the only way to change one from outside, since the
    index ranks heads by counter."""
    state.settled = False
    _set_counter(state, tenant, value)


def _set_counter(state: PolicyState, tenant: str, value: float) -> None:
    state.counters[tenant] = value
    if tenant in state.tenant_waiting:
        state.backlog_min.set(tenant, value)
        state.index.reposition(tenant, value)  # (a head being granted is out of the index already)
    elif tenant in state.leases_by_tenant:
        state.lease_min.set(tenant, value)
    else:
        state.idle_min.set(tenant, value)


def _move(state: PolicyState, tenant: str, src: MinMap[str, float], dst: MinMap[str, float]) -> None:
    """The tenant's state changed (``PolicyState.backlog_min`` says which base each names): its
    counter moves from ``src`` to ``dst``."""
    src.discard(tenant)
    counter = state.counters.get(tenant)
    if counter is not None:
        dst.set(tenant, counter)


def lift(state: PolicyState, tenant: str) -> None:
    """Apply the lift rule for ``tenant``; the caller guarantees the tenant is not backlogged."""
    base = state.backlog_min.lowest_other(tenant)  # (math.inf: no such tenant)
    if base == math.inf:
        base = state.lease_min.lowest_other(tenant)
    own = state.counters.get(tenant)
    if own is None:
        if base == math.inf:
            base = state.idle_min.lowest()  # (every counter: nobody else is backlogged or leased)
        _set_counter(state, tenant, base if base != math.inf else 0.0)
    elif base != math.inf and base > own:
        _set_counter(state, tenant, base)


def _charge(state: PolicyState, demand: Demand) -> None:
    cost = demand.private_cost  # (>= cost: 0 only when it holds nothing anywhere)
    if cost:  # in_flight holds only pools with tokens in flight
        _hold(state.in_flight, demand, 1)
    tenant = demand.tenant
    leased = state.leases_by_tenant
    n = leased.get(tenant, 0)
    leased[tenant] = n + 1
    if not n:
        _active(state, tenant)
        # (Backlogged, it stays in backlog_min; granted its last ticket, _forget moved it already.)
        if tenant not in state.tenant_waiting and tenant not in state.lease_min.slots:
            _move(state, tenant, state.idle_min, state.lease_min)
    _set_counter(state, tenant, state.counters.get(tenant, 0.0) + prompt_service(state.layout, demand))
    if cost and state.index.private:
        _private_changed(state, demand, freed=False)


def release(state: PolicyState, demand: Demand, actual_decode: int | None, now: float | None = None) -> None:
    """Return a lease's tokens; charge the tenant's VTC for the output it was served. ``now`` (the
    store clock) dates the tenant's idleness when this was its last lease."""
    state.settled = False
    cost = demand.private_cost
    _hold(state.in_flight, demand, -1)
    tenant = demand.tenant
    n = state.leases_by_tenant.get(tenant, 0) - 1
    if n > 0:
        state.leases_by_tenant[tenant] = n
    else:
        state.leases_by_tenant.pop(tenant, None)
        if tenant not in state.tenant_waiting:
            _move(state, tenant, state.lease_min, state.idle_min)
            _idle(state, tenant, state.clock if now is None else now)
    spec = state.layout.tenants.get(tenant)
    if spec is not None and tenant in state.counters:
        served = served_output(demand.decode, actual_decode)
        if served:  # adding 0.0 changes nothing; the Lua port skips the write the same way
            _set_counter(
                state,
                tenant,
                state.counters[tenant] + state.layout.policy.decode_weight * served / spec.weight,
            )
    if cost and state.index.private:
        _private_changed(state, demand, freed=True)


def extend(state: PolicyState, demand: Demand, tokens: int) -> tuple[Demand, int]:
    """Grow a live lease's output reservation by ``tokens``; never queues. Each pool grows by what
    the grown demand holds there more than before: every pool by ``tokens``, except its tenant's
    own pool while the reservation stays within ``decode_limit`` (that pool holds the limit
    already). Waiting heads that name a private pool it grew in are checked again, like after a
    grant.

    Returns the grown demand and the overdraft: how far the fullest of its pools now is above its
    capacity, at most what it grew by there (0 when the growth fit). An overdrawn pool grants
    nothing new until releases bring it back under its limit, which the grant pass does by itself
    (a demand fits only under the limit). A reservation is not service: no fair-share counter moves.
    """
    state.settled = False
    grown = replace(demand, decode=demand.decode + tokens)
    over = 0
    for name in demand.pools:
        more = grown.held_in(name) - demand.held_in(name)
        if not more:
            continue
        used = state.in_flight.get(name, 0) + more
        state.in_flight[name] = used
        spec = state.layout.pools.get(name)
        if spec is not None:
            over = max(over, min(more, used - spec.capacity))
    if tokens and state.index.private:
        # A private pool that grew may no longer fit its tenant's waiting head: park it, or the
        # next pass grants it past the tenant's budget (the pass checks only shared room).
        _private_changed(state, demand, freed=tokens < 0)
    return grown, over


def _hold(in_flight: dict[str, int], demand: Demand, sign: int) -> None:
    """Add (``sign`` 1) or give back (-1) what ``demand`` holds in each of its pools (``held_in``);
    a pool left with nothing in flight leaves ``in_flight``."""
    cost = demand.cost
    held = demand.private_cost != cost
    for name in demand.pools:
        if held:
            cost = demand.held_in(name)
        left = in_flight.get(name, 0) + sign * cost
        if left > 0:
            in_flight[name] = left
        else:
            in_flight.pop(name, None)


def _private_changed(state: PolicyState, demand: Demand, freed: bool) -> None:
    private = state.index.private
    for name in demand.pools:
        if name in private:
            state.index.private_changed(name, state.layout, state.counters, state.in_flight, freed)


# ---- idle tenants ----


def _idle(state: PolicyState, tenant: str, now: float) -> None:
    state.idle_since[tenant] = now
    state.idle_order.add(tenant, (now, tenant))


def _active(state: PolicyState, tenant: str) -> None:
    """The tenant has a waiting ticket or a live lease again (it had neither)."""
    if state.idle_since.pop(tenant, None) is not None:
        state.idle_order.discard(tenant)


def forget_idle(state: PolicyState, now: float, limit: int | None = None) -> int:
    """Forget the counters of tenants idle for ``idle_forget_s`` (module docstring), at most
    ``limit`` of them; returns how many were forgotten."""
    after = state.layout.policy.idle_forget_s
    order, since_of, counters = state.idle_order, state.idle_since, state.counters
    n = 0
    while limit is None or n < limit:
        oldest = order.lowest()
        if oldest == _NO_IDLE or not now - oldest[0] >= after:
            break
        tenant = oldest[1]
        order.discard(tenant)
        del since_of[tenant]
        counters.pop(tenant, None)
        state.idle_min.discard(tenant)
        state.settled = False
        n += 1
    return n


# ---- queue operations ----


def grant_immediately(state: PolicyState, demand: Demand) -> bool:
    """The fast path: grant now iff nothing at all is waiting and the demand fits."""
    if state.waiting or not fits(state, demand):
        return False
    state.settled = False
    lift(state, demand.tenant)
    _charge(state, demand)
    return True


def enqueue(state: PolicyState, demand: Demand, now: float) -> Ticket:
    tenant = demand.tenant
    tier = demand.tier
    backlog = state.tenant_waiting.get(tenant, 0)
    if not backlog:
        lift(state, tenant)
    ticket = Ticket(state.next_seq, demand, now)
    state.next_seq += 1
    state.waiting[ticket.seq] = ticket
    state.tenant_waiting[tenant] = backlog + 1
    if not backlog:
        _active(state, tenant)
        src = state.lease_min if tenant in state.leases_by_tenant else state.idle_min
        _move(state, tenant, src, state.backlog_min)
    state.tier_waiting[tier] = state.tier_waiting.get(tier, 0) + 1
    if demand.private_cost:
        ahead = state.ahead
        for name in demand.pools:
            ahead[(name, tier)] = ahead.get((name, tier), 0) + demand.held_in(name)
    key = (tier, tenant)
    fifo = state.queues.get(key)
    pol = state.layout.policy
    if fifo is None:
        state.queues[key] = deque((ticket,))
        if pol.tenant_queue_order != "fifo":
            state.ordered[key] = [(order_key(pol, ticket), ticket.seq)]
        head = state.index.add(
            key, ticket, state.layout, state.counters[tenant], state.in_flight, state.clock
        )
        if state.settled and (_may_fit(state, head) or _may_lift_holds(state, head)):
            state.settled = False  # a new head that a pass may grant, or that may free another
    else:
        fifo.append(ticket)
        if pol.tenant_queue_order != "fifo":
            order = state.ordered[key]
            bisect.insort(order, (order_key(pol, ticket), ticket.seq))
            if order[0][1] == ticket.seq:  # it goes before the head: it is the head now
                state.settled = False
                index = state.index
                index.remove(index.heads[key])
                index.add(
                    key,
                    ticket,
                    state.layout,
                    state.counters[tenant],
                    state.in_flight,
                    state.clock,
                    rank_seq=fifo[0].seq,
                )
    return ticket


def order_key(pol: PolicySpec, ticket: Ticket) -> float:
    """A ticket's place in its (tier, tenant) queue under ``shortest_first`` (module docstring);
    ties go to the lower seq."""
    return ticket.enqueued_at + min(ticket.demand.decode * pol.defer_s_per_token, pol.max_defer_s)


def _leave_ordered(
    state: PolicyState,
    key: tuple[str, str],
    fifo: deque[Ticket],
    order: list[tuple[float, int]],
    ticket: Ticket,
) -> None:
    """Take ``ticket`` out of a shortest_first queue (both of its orders)."""
    entry = (order_key(state.layout.policy, ticket), ticket.seq)
    i = bisect.bisect_left(order, entry)
    del order[i]
    if fifo[0] is ticket:
        fifo.popleft()
    else:
        fifo.remove(ticket)
    if not fifo:
        del state.queues[key]
        del state.ordered[key]


def _forget(state: PolicyState, ticket: Ticket, now: float | None, granted: bool = False) -> None:
    """The ticket leaves the queue. ``granted``: to be charged at once (grant_pass), so its tenant
    holds a lease before anyone can look and is not marked idle in between."""
    del state.waiting[ticket.seq]
    demand = ticket.demand
    tenant, tier = demand.tenant, demand.tier
    n = state.tenant_waiting[tenant] - 1
    if n > 0:
        state.tenant_waiting[tenant] = n
    else:
        del state.tenant_waiting[tenant]
        # (granted: leased the moment after, by the charge: straight to lease_min)
        dst = state.lease_min if granted or tenant in state.leases_by_tenant else state.idle_min
        _move(state, tenant, state.backlog_min, dst)
        if not granted and tenant not in state.leases_by_tenant:
            _idle(state, tenant, state.clock if now is None else now)
    n = state.tier_waiting[tier] - 1
    if n > 0:
        state.tier_waiting[tier] = n
    else:
        del state.tier_waiting[tier]
    if demand.private_cost:
        ahead = state.ahead
        for name in demand.pools:
            left = ahead.get((name, tier), 0) - demand.held_in(name)
            if left > 0:
                ahead[(name, tier)] = left
            else:
                ahead.pop((name, tier), None)


def withdraw(state: PolicyState, seq: int, now: float | None = None) -> Ticket | None:
    """Remove a waiting ticket (timeout, cancellation, shutdown); None if it is no longer waiting."""
    ticket = state.waiting.get(seq)
    if ticket is None:
        return None
    state.settled = False
    key = (ticket.demand.tier, ticket.demand.tenant)
    fifo = state.queues[key]
    order = state.ordered.get(key) if state.ordered else None
    if order is not None:
        _withdraw_ordered(state, key, fifo, order, ticket)
    elif fifo[0] is ticket:
        fifo.popleft()
        index = state.index
        index.remove(index.heads[key])
        if fifo:
            tenant = key[1]
            index.add(key, fifo[0], state.layout, state.counters[tenant], state.in_flight, state.clock)
        else:
            del state.queues[key]
    else:
        fifo.remove(ticket)
    _forget(state, ticket, now)
    return ticket


def _withdraw_ordered(
    state: PolicyState,
    key: tuple[str, str],
    fifo: deque[Ticket],
    order: list[tuple[float, int]],
    ticket: Ticket,
) -> None:
    index = state.index
    head = index.heads[key]
    first = fifo[0] is ticket
    _leave_ordered(state, key, fifo, order, ticket)
    if not fifo:
        index.remove(head)
    elif head.ticket is ticket:
        index.remove(head)
        tenant = key[1]
        index.add(
            key,
            state.waiting[order[0][1]],
            state.layout,
            state.counters[tenant],
            state.in_flight,
            state.clock,
            rank_seq=fifo[0].seq,
        )
    elif first:
        index.reseq(head, fifo[0].seq)


def apply_layout(state: PolicyState, layout: BudgetLayout) -> list[tuple[Ticket, AdmissionError]]:
    """Replace the layout (leases and counters stay); returns the tickets dropped by ``drop_invalid``."""
    state.layout = layout
    return drop_invalid(state)


def drop_invalid(state: PolicyState) -> list[tuple[Ticket, AdmissionError]]:
    """After a layout change: withdraw tickets that can now never be granted, with the reason; then
    index the heads again under the new layout (O(waiting tickets), once per layout change)."""
    dropped: list[tuple[Ticket, AdmissionError]] = []
    for ticket in list(state.waiting.values()):
        try:
            check_demand(state.layout, ticket.demand)
        except AdmissionError as err:
            key = (ticket.demand.tier, ticket.demand.tenant)
            fifo = state.queues[key]
            fifo.remove(ticket)
            if not fifo:
                del state.queues[key]
            _forget(state, ticket, None)  # reindex rebuilds the shortest_first orders
            dropped.append((ticket, err))
    reindex(state)
    return dropped


def reindex(state: PolicyState) -> None:
    """Build the index (and the shortest_first orders) from the waiting tickets again (after a layout
    change, which may change the order). A ticket that was head and still is keeps its age class;
    a ticket that only now becomes head (its predecessor was dropped, or the order changed) is
    classed as usual."""
    state.settled = False
    index = state.index
    was_old = {head.ticket.seq: head.old for head in index.heads.values()}
    index.clear()
    layout, counters, in_flight, clock = state.layout, state.counters, state.in_flight, state.clock
    pol = layout.policy
    state.ordered.clear()
    ordered = pol.tenant_queue_order != "fifo"
    for key, fifo in state.queues.items():
        if ordered:
            order = state.ordered[key] = sorted((order_key(pol, t), t.seq) for t in fifo)
            head = state.waiting[order[0][1]]
        else:
            head = fifo[0]
        old = was_old.get(head.seq)
        at = clock if old is None else -math.inf
        index.add(key, head, layout, counters[key[1]], in_flight, at, bool(old), fifo[0].seq)


def _may_fit(state: PolicyState, head: Head) -> bool:
    """Whether ``head`` fits its group's room now (False too while a private pool parks it)."""
    group = head.group
    if group is None:
        return False
    layout = state.layout
    return head.ticket.demand.cost <= _room(group, layout.tiers[head.tier], layout, state.in_flight)


def _may_lift_holds(state: PolicyState, head: Head) -> bool:
    """Whether ``head``'s holds could take another head's holds away (rule 1 of the pass: a head
    naming a held pool holds nothing): some active group of another pool set names one of its
    shared pools and a shared pool it does not name. Then the new hold can free that other pool,
    and a head waiting only on it may be granted ("Settled" in the module docstring)."""
    mine = head.shared
    if head.group is None or not mine:
        return False  # parked or naming no shared pool: it holds nothing
    for by_pools in state.index.groups.values():
        for pools, group in by_pools.items():
            if group and pools != mine and not set(pools).isdisjoint(mine) and not set(pools) <= set(mine):
                return True
    return False


def _tier_order(state: PolicyState) -> tuple[str, ...]:
    layout = state.layout
    cached, order = state.tier_order
    if cached is not layout:
        order = tuple(t.name for t in sorted(layout.tiers.values(), key=lambda t: (t.rank, t.name)))
        state.tier_order = (layout, order)
    return order


def _room(group: Group, tier: TierSpec, layout: BudgetLayout, in_flight: Mapping[str, int]) -> float:
    """The least ``limit(pool, tier) - in_flight`` over the group's shared pools."""
    if group.limits_of is not layout:  # (a group's tier and pools never change; the layout may)
        pools = layout.pools
        group.limits = tuple((n, math.floor(tier.ceiling * pools[n].capacity)) for n in group.pools)
        group.limits_of = layout
    room = math.inf
    for name, limit in group.limits:
        left = limit - in_flight.get(name, 0)
        if left < room:
            room = left
    return room


def grant_pass(state: PolicyState, now: float) -> list[Ticket]:
    """Grant waiting tickets in rank order (see the module docstring); returns them in grant order."""
    if not state.waiting:
        return []
    if now > state.clock:
        state.clock = now
    layout = state.layout
    index = state.index
    budget = layout.policy.max_scan
    promoted = index.promote(now, layout.policy.backfill_limit_s, budget)
    if not promoted and state.settled:
        return []
    state.settled = False  # until this pass reaches its end
    in_flight = state.in_flight
    granted: list[Ticket] = []
    held_all: set[str] = set()
    cached, tiers = state.tier_order
    for tier_name in tiers if cached is layout else _tier_order(state):
        by_pools = index.groups.get(tier_name)
        if not by_pools:
            continue
        tier = layout.tiers[tier_name]
        if held_all:
            live = [g for g in by_pools.values() if held_all.isdisjoint(g.pools)]
        else:
            live = list(by_pools.values())
        held_lower: set[str] = set()
        contributed: set[int] = set()  # id() of groups whose pools are in held_lower
        cursor: tuple[float, float, str] | None = None
        passing: list[tuple[Group, tuple[float, int, str]]] = []  # young heads of pruned groups
        while True:
            if budget <= 0:
                return granted
            best = None
            best_group: Group | None = None
            best_room = 0.0
            if passing:
                passing = []
            for g in live:
                room = _room(g, tier, layout, in_flight)
                cand = g.lowest_old()
                young = g.young
                if young.n:
                    succ = young.first() if cursor is None else young.after(cursor)
                    if succ is not None:
                        if g.lowest_young_cost() <= room:
                            if cand is None or succ < cand:
                                cand = succ
                        elif id(g) not in contributed:
                            passing.append((g, succ))
                if cand is not None and (best is None or cand < best):
                    best, best_group, best_room = cand, g, room
            for g, succ in passing:
                if best is None or succ < best:  # passed over: blocked, and none of its group fits
                    held_lower.update(g.pools)
                    contributed.add(id(g))
            if best is None or best_group is None:
                break
            budget -= 1
            cursor = best
            tenant = best[2]
            qkey = (tier_name, tenant)
            head = index.heads[qkey]
            ticket = head.ticket
            demand = ticket.demand
            if demand.cost <= best_room:
                # Just before the granted rank: the tenant's next head may have the same one (below).
                cursor = (best[0], best[1] - 0.5, tenant)
                fifo = state.queues[qkey]
                index.remove(head)
                order = state.ordered.get(qkey) if state.ordered else None
                if order is None:
                    fifo.popleft()
                    nxt = fifo[0] if fifo else None
                    if nxt is None:
                        del state.queues[qkey]
                else:
                    _leave_ordered(state, qkey, fifo, order, ticket)
                    nxt = state.waiting[order[0][1]] if fifo else None
                _forget(state, ticket, now, granted=True)
                _charge(state, demand)
                granted.append(ticket)
                if nxt is not None:
                    new = index.add(
                        qkey,
                        nxt,
                        layout,
                        state.counters[tenant],
                        in_flight,
                        now,
                        False,
                        fifo[0].seq,
                    )
                    ng = new.group
                    if ng is not None and ng not in live and held_all.isdisjoint(ng.pools):
                        live.append(ng)
            elif head.old:
                held_lower.update(best_group.pools)
                held_all.update(best_group.pools)
                live = [g for g in live if held_all.isdisjoint(g.pools)]
            else:
                held_lower.update(best_group.pools)
                contributed.add(id(best_group))
        held_all |= held_lower
    state.settled = True
    return granted


def tokens_ahead(state: PolicyState, pool: str, rank: int) -> int:
    """Tokens of waiting tickets on ``pool`` in tiers ranked ``rank`` or better (for retry estimates)."""
    ahead = state.ahead
    return sum(ahead.get((pool, tier.name), 0) for tier in state.layout.tiers.values() if tier.rank <= rank)
