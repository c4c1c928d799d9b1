-- lib.lua: shared by every tokengate script (the loader puts it before the entry files).
--
-- This is a port of budgets/policy.py (and the retry estimate of budgets/retry.py). The Python
-- module's docstring is the specification; every function here names its Python counterpart and
-- must make the same decisions, in the same order, with the same float arithmetic (doubles on
-- both sides; counters are stored with %.17g so they round-trip exactly). The index that keeps a
-- grant pass O(log n) (budgets/queue_index.py) lives in sorted sets: see "the index" below.
--
-- keys[1] is "{tg:<prefix>}:layout"; every other key is derived from its hash tag, so all keys of
-- one budget domain share one cluster slot. args[1] is always the clock override: empty in
-- production (server TIME is used), a number only when a test drives the store's clock. args[2]
-- is always the calling replica. Each entry file defines ``<name>_main(A)`` with ``A`` = its own
-- arguments (args[3..]); the loader (budgets/redis/scripts.py) wraps it as
-- ``begin(keys, args); reply = { <name>_main(own_args(args)), LOCAL }; flush(); return reply``:
-- the reply plus the wake-ups meant for the caller itself; ``flush`` writes what the call wrote
-- behind (see "state"). ``batch`` runs several acquire/release operations in one call (see
-- batch.lua).

-- Per-call state, set by ``begin`` (at the end of this file) before every entry function runs:
-- T the hash-tagged key prefix, K the domain's keys, ARGS the call's arguments, and the caches
-- below. Nothing here is read before ``begin``, so the same source serves both ways of running
-- it: as a Redis 7 function library (loaded once, ``begin`` per FCALL) and as EVAL scripts.
local T, K, ARGS

-- Globals this code calls on every operation, bound once by ``begin`` (not at load: FUNCTION LOAD
-- runs the body with only redis.register_function in reach). A function library's global
-- table is empty, the real globals behind its metatable's __index: each global name read is
-- two table lookups and a metamethod check, an upvalue one array read.
local function global_functions() -- (defined before the locals below: these names are the globals)
  return redis.call, tonumber, unpack, type, pairs, string.sub, string.find, string.format, string.byte,
    string.match, struct.pack, struct.unpack, math.min, math.max, math.floor
end
local rcall, tonumber, unpack, type, pairs, ssub, sfind, sformat, sbyte, smatch, spack, sunpack, mmin, mmax, mfloor
local INF = 1 / 0

-- policy's "Settled", within one call: true once a pass has run to its end, false again as soon as
-- anything a pass looks at changes (in-flight tokens, a counter, a head record, a withdrawal, a
-- forgotten tenant). An acquire in the same call that queues behind its tenant's existing head
-- changes none of it, so its pass would grant nothing: it returns at once (after promotions, as
-- policy.grant_pass). Per call only, never stored: each call (a ``batch`` is one) starts
-- unsettled, so replicas of other versions are not concerned.
local settled = false

-- The keys of one budget domain (a pure function of its layout key).
local function keyset(layout)
  local T = ssub(layout, 1, -8) -- strip ":layout"
  return {
    T = T,
    layout = layout,
    spec = T .. ':spec',
    used = T .. ':used',
    vtc = T .. ':vtc',
    tleases = T .. ':tleases',
    twait = T .. ':twait',
    tierq = T .. ':tierq',
    rate = T .. ':rate',
    leases = T .. ':leases',
    lexp = T .. ':lexp',
    gone = T .. ':gone',
    reaped = T .. ':reaped',
    seq = T .. ':seq',
    tickets = T .. ':tickets',
    replicas = T .. ':replicas',
    -- derived state: the index of the grant pass (budgets/queue_index.py) and the lift bases
    vb = T .. ':vb',
    vl = T .. ':vl',
    idle = T .. ':idle',
    ahead = T .. ':ahead',
    heads = T .. ':heads',
    age = T .. ':age',
    gtiers = T .. ':gtiers',
    clock = T .. ':clock',
    -- not key names: group_of's cache
    groups = {},
    groups_n = 0,
}
end

local SEP = '\31'
local LSEP = '\30'
local RATE_TAU = 10.0 -- budgets.retry.RATE_TAU_S
local MIN_RETRY = 1.0 -- budgets.retry.MIN_RETRY_S

local function split(s, sep)
  -- (two array slots made with the table: most lists here are a demand's pools, one or two, which
  -- filled one by one from nothing would reallocate the array twice)
  local out = { nil, nil }
  if s == '' then
    return out
  end
  local i = 1
  while true do
    local j = sfind(s, sep, i, true)
    if not j then
      out[#out + 1] = ssub(s, i)
      return out
    end
    out[#out + 1] = ssub(s, i, j - 1)
    i = j + 1
  end
end

-- HSET of a long field/value list, in chunks (Lua's unpack has a limit of a few thousand values).
local function hset_many(key, fields)
  for i = 1, #fields, 1000 do
    rcall('HSET', key, unpack(fields, i, mmin(i + 999, #fields)))
  end
end

-- The first eight SEP-separated fields of a record, as ``split`` gives them (nil past the last),
-- without a table: one pattern match instead of a find and a sub per field (~0.4 us against ~1.4).
local FIELDS8 = '^([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)'

local function fields8(v)
  local a, b, c, d, e, f, g, h = smatch(v, FIELDS8)
  if a == nil then -- fewer than eight fields (a head record of an older version)
    local t = split(v, SEP)
    return t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8]
  end
  return a, b, c, d, e, f, g, h
end

local now_c -- this call's instant (script_now, below)

-- A number as text that reads back as the same double. Formatting one costs ~2,500 instructions
-- (about what a small Redis command costs), and a call writes the same numbers again and again:
-- its instant into several records, a tenant's counter into T:vtc and its head record, a
-- head's enqueued_at into T:age and the record. So each call keeps what it formatted.
local fmt_c -- number -> text, this call's
local function fmt(x)
  local s = fmt_c[x]
  if s == nil then
    -- A whole number (a count, a cost, a sum of them) formats as an integer: the same text
    -- below 1e15, without libc's floating-point printing (~2,000 instructions a number).
    if x % 1 == 0 and x > -1e15 and x < 1e15 and x ~= 0 then
      s = sformat('%d', x)
    else
      s = sformat('%.17g', x)
    end
    if x ~= 0 and x == x then -- 0 == -0, which format differently; NaN is no table key
      fmt_c[x] = s
    end
  end
  return s
end

-- The other way round, and for the same reason: records keep the text of the numbers they were
-- read with (a ticket's seq and enqueued_at, a head's seq, cost and rank seq) and write it back
-- as it was, and a number argument of redis.call is text where it can be ('1', not 1: Redis
-- formats a Lua number with %.17g). Numbers we wrote ourselves are read with ``s + 0``, not
-- ``tonumber(s)``, which converts its argument twice (lua_isnumber, then lua_tonumber).

local function clock(arg)
  if arg ~= nil and arg ~= '' then
    return tonumber(arg)
  end
  local t = rcall('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- One instant per script call: every operation of a batch happens "at the same time".
local function script_now()
  if now_c == nil then
    now_c = clock(ARGS[1])
  end
  return now_c
end

local function qkey(tier, tenant)
  return T .. ':q:' .. #tier .. ':' .. tier .. ':' .. tenant
end

-- shortest_first only: the same tickets as T:q:... in a zset by order key (policy.order_key);
-- members spack('>d', seq), so equal keys go by seq (bytewise = numeric for these doubles).
local function oqkey(tier, tenant)
  return T .. ':qo:' .. #tier .. ':' .. tier .. ':' .. tenant
end

local function oq_member(seq)
  return spack('>d', seq)
end

-- The seq of the lowest (order key, seq) of a shortest_first queue, nil when it is empty.
local function oq_first(oq)
  local m = rcall('ZRANGE', oq, '0', '0')[1]
  if m == nil then
    return nil
  end
  return (sunpack('>d', m))
end

local function rtkey(replica)
  return T .. ':rtk:' .. replica
end

local function wake_channel(replica)
  return T .. ':wake:' .. replica
end

-- Grants and failures of the caller's own tickets travel back in the reply instead of pub/sub,
-- so the caller hands them to its waiters the moment the script returns (as the memory store
-- does synchronously); other owners are told on their channel.
local CALLER, LOCAL
local function notify(owner, payload)
  if owner == CALLER then
    LOCAL[#LOCAL + 1] = payload
  else
    rcall('PUBLISH', wake_channel(owner), payload)
  end
end

-- ---- layout (cached per script call) ----
--
-- One hash T:spec holds the whole layout as the scripts read it: the policy fields, and one field
-- per pool ("p:<name>" = "capacity|shared"), tier ("t:<name>" = "rank|ceiling|max_wait") and
-- tenant ("n:<name>" = "weight|max_queue_len"). A call fetches the policy plus every spec its
-- demand names with a single HMGET.

local P
-- Parsed specs by kind ('p' pools, 't' tiers, 'n' tenants), then name (a table per kind, so that a
-- lookup needs no "<kind>:<name>" string built first): the spec, or false when the layout has no
-- such name. SP is kept across calls with the layout (below) and holds what every call reads and
-- the layout's shape bounds: its tiers and shared pools. Tenants' specs and their private pools
-- (one per tenant, in a typical layout) are kept for at most KEPT_TENANTS names (the kept entry's
-- ``few``, emptied when full) and always for the call (SX); the rest are read per call, with the
-- demand's one HMGET.
--
-- Why not keep them all: Lua's collector marks every live object of the functions' heap once per
-- cycle, and a cycle comes every few hundred script calls. Kept specs of 10,000 tenants (two
-- tables each, ~680 B) made that marking walk megabytes the CPU caches do not hold: three
-- quarters of Redis' cache misses, ~25 % of its CPU per single call, and the collector steps
-- were the slowest 1 % of calls (docs/benchmarks.md, "Kept specs and Lua's collector"). A few
-- hundred fit the caches and spare a small domain's calls the reads.
local SP
local SX
local kept -- this call's entry of ``layouts`` (below), once known
local KEPT_TENANTS = 256

local function new_specs()
  return { p = {}, t = {}, n = {} }
end

local function remember(kind, name, v)
  if kept ~= nil and (kind == 'n' or (kind == 'p' and not (v and v.shared))) then
    SX[kind][name] = v
    if kept.few_n >= KEPT_TENANTS then
      kept.few, kept.few_n = { p = {}, n = {} }, 0
    end
    kept.few[kind][name] = v
    kept.few_n = kept.few_n + 1
  else
    SP[kind][name] = v
  end
end

local function known_spec(kind, name)
  local v = SP[kind][name]
  if v == nil then
    v = SX[kind][name]
    if v == nil and kept ~= nil and kind ~= 't' then
      v = kept.few[kind][name]
      SX[kind][name] = v -- for the call, should ``few`` be emptied before its end
    end
  end
  return v
end

-- Parsed layouts kept across calls while the library stays loaded (a Redis 7 function library;
-- EVAL scripts start empty every call): layout key -> { stamp, P, spec }. The stamp is the
-- layout's version and digest: apply_layout bumps the version whenever it rewrites T:spec, and
-- a Redis that lost its data counts versions from 1 again, where the digest tells layouts apart.
local layouts = {}
local layouts_n = 0

local function parse_spec(kind, name, v)
  if not v then
    return false
  end
  -- (a plain find and subs, not a pattern with a lazy ``.-``: that tries the rest of the pattern at
  -- every character, ~4,000 instructions a match)
  if kind == 'p' then -- "<capacity>|<0/1>"
    return { cap = ssub(v, 1, -3) + 0, shared = (sbyte(v, -1) == 49) }
  elseif kind == 't' then
    local f = split(v, '|')
    return { name = name, rank = tonumber(f[1]), ceiling = tonumber(f[2]), maxwait = tonumber(f[3]) }
  end
  local bar = sfind(v, '|', 1, true)
  return { weight = ssub(v, 1, bar - 1) + 0, maxq = ssub(v, bar + 1) + 0 }
end

local function spec(kind, name)
  local v = known_spec(kind, name)
  if v == nil then
    v = parse_spec(kind, name, rcall('HGET', K.spec, kind .. ':' .. name))
    remember(kind, name, v)
  end
  return v
end

-- (pool_spec and tenant_spec look where the spec usually is first: a shared pool's in SP, a
-- private pool's or a tenant's in SX once the call has read it; then the whole way, ``spec``.)
local function pool_spec(name)
  local v = SP.p[name]
  if v == nil then
    v = SX.p[name]
    if v == nil then
      v = spec('p', name)
    end
  end
  return v
end

local function tier_spec(name)
  local v = SP.t[name]
  if v == nil then
    v = spec('t', name)
  end
  return v
end

local function tenant_spec(name)
  local v = SX.n[name]
  if v == nil then
    v = spec('n', name)
  end
  return v
end

-- Ask for spec ``kind:name`` unless this call knows it (load_policy's field lists).
local function want(fields, kinds, names, kind, name)
  if known_spec(kind, name) == nil then
    fields[#fields + 1] = kind .. ':' .. name
    kinds[#fields], names[#fields] = kind, name
  end
end

-- The policy and (optionally) a demand's specs in one round trip; false when Redis has no layout.
-- Within one script call (a batch) the policy is read once; later calls fetch only new specs.
local function load_policy(d)
  if P ~= nil and d ~= nil and known_spec('n', d.tenant) ~= nil and SP.t[d.tier] ~= nil then
    -- a later operation of the call whose specs are all known already: nothing to read
    local pools, known = d.pools, true
    for i = 1, #pools do
      if known_spec('p', pools[i]) == nil then
        known = false
        break
      end
    end
    if known then
      return true
    end
  end
  local fields = { nil, nil } -- (two slots made with it: see split)
  local ver, stamp -- of the layout, when it is not in ``layouts`` yet
  if P == nil then
    local v = rcall('HMGET', K.layout, 'ver', 'digest')
    if v[1] and v[2] then
      local c = layouts[K.layout]
      if c and c.stamp == v[1] .. SEP .. v[2] then
        P, SP, kept = c.P, c.spec, c
      else
        ver, stamp = v[1], v[1] .. SEP .. v[2]
      end
    end
  end
  if P == nil then
    fields = { 'ver', 'pw', 'dw', 'backfill', 'ttl', 'max_scan', 'tiers', 'idle', 'qo' }
  end
  local first = #fields + 1
  local kinds, names = { nil, nil }, { nil, nil } -- of the spec fields asked for, from ``first`` on
  if d then
    want(fields, kinds, names, 'n', d.tenant)
    want(fields, kinds, names, 't', d.tier)
    for i = 1, #d.pools do
      want(fields, kinds, names, 'p', d.pools[i])
    end
  end
  if #fields == 0 then
    return true
  end
  local v = rcall('HMGET', K.spec, unpack(fields))
  if P == nil then
    if not v[1] then
      return false
    end
    P = {
      ver = v[1],
      pw = tonumber(v[2]),
      dw = tonumber(v[3]),
      backfill = tonumber(v[4]),
      ttl = tonumber(v[5]),
      max_scan = tonumber(v[6]),
      tier_order = split(v[7], LSEP),
      idle = tonumber(v[8] or '3600'),
    }
    -- PolicySpec.tenant_queue_order, max_defer_s, defer_s_per_token (absent: fifo)
    local qo = split(v[9] or 'fifo', LSEP)
    P.sf = qo[1] == 'shortest_first'
    P.max_defer = tonumber(qo[2] or '10')
    P.per_token = tonumber(qo[3] or '0.01')
    if stamp and P.ver == ver then -- T:spec is the one that version wrote
      if layouts_n >= 64 then
        layouts, layouts_n = {}, 0
      end
      if layouts[K.layout] == nil then
        layouts_n = layouts_n + 1
      end
      kept = { stamp = stamp, P = P, spec = SP, few = { p = {}, n = {} }, few_n = 0 }
      layouts[K.layout] = kept
    end
  end
  for i = first, #fields do
    remember(kinds[i], names[i], parse_spec(kinds[i], names[i], v[i]))
  end
  return true
end

local function reset_layout_cache()
  P, kept = nil, nil
  SP, SX = new_specs(), new_specs() -- new tables: the ones kept in ``layouts`` may be another call's
  if layouts[K.layout] ~= nil then
    layouts[K.layout] = nil
    layouts_n = layouts_n - 1
  end
end

-- policy.pool_limit
local function pool_limit(p, t)
  if not p.shared then
    return p.cap
  end
  return mfloor(t.ceiling * p.cap)
end

-- ---- state (cached per script call, written behind) ----
--
-- The hashes of counts and sums (T:used, T:twait, T:tleases, T:ahead, T:tierq: field -> a
-- positive number, absent at zero), the head records (T:heads, below) and the release meters
-- (T:rate, "the release rate") are read at most once per call and written once, at its end:
-- ``flush``, which the entry wrapper (budgets/redis/scripts.py) calls after the entry returns.
-- Why: a batch of 32 cycles changes T:used's shared pool 64 times and T:ahead's and T:tierq's
-- fields as often, with a net change of zero, and every redis.call costs ~3,000 instructions in
-- the Lua->Redis bridge before the command's own work.
-- Nothing reads these hashes past the caches within a call (reindex flushes before it reads
-- T:heads whole), and other clients see them between calls only, when they are written. A call
-- that fails half way writes none of them (as it writes half of the rest: a failing call is a bug
-- either way). What it costs (docs/benchmarks.md, "Written behind"): a call of one operation
-- executes ~6 % more instructions than writing through (the caches' tables and bookkeeping cost
-- more than the one or two commands it saves there); a batch of 32 cycles 14 % fewer at 10
-- tenants, 2 % at 10,000. Batches are what Redis runs when it is busy.
local nums_c -- key -> field -> number: what this call knows of the counting hashes (begin makes one
-- table per hash; T:used's is also ``used_c``, read by every pass)
local used_c
local dirty_c -- key -> field -> true: fields changed and not written yet (nil: none)
local rates_c, rates_at -- pool -> number: T:rate as this call knows it (see "the release rate")

local function touch(key, field)
  if dirty_c == nil then
    dirty_c = {}
  end
  local d = dirty_c[key]
  if d == nil then
    d = {}
    dirty_c[key] = d
  end
  d[field] = true
end

-- The field's number (0 when absent).
local function num(key, field)
  local c = nums_c[key]
  local n = c[field]
  if n == nil then
    n = (rcall('HGET', key, field) or 0) + 0
    c[field] = n
  end
  return n
end

-- Add ``delta`` (a whole number) to the field; at or below zero it is dropped (and reads 0).
-- Returns the new number. A field the call does not know yet is changed at once with HINCRBY,
-- which reads it too (a read and a write later would be two commands where one does); a known
-- one is written behind.
local function num_add(key, field, delta)
  local c = nums_c[key]
  local n = c[field]
  if n == nil then
    n = rcall('HINCRBY', key, field, fmt(delta))
    if n > 0 then
      c[field] = n
      return n
    end
  else
    n = n + delta
  end
  if n < 0 then
    n = 0
  end
  c[field] = n
  local d = dirty_c and dirty_c[key]
  if d then -- (touch, without the call, once the hash has a dirty field)
    d[field] = true
  else
    touch(key, field)
  end
  return n
end

-- num(K.used, name), without looking up the hash's table: every pass asks.
local function used(name)
  local u = used_c[name]
  if u == nil then
    u = (rcall('HGET', K.used, name) or 0) + 0
    used_c[name] = u
  end
  return u
end

-- The names that ``cache`` has no entry for; nil when it has them all (no table is made then).
local function unknown(cache, names)
  local missing = nil
  for i = 1, #names do
    if cache[names[i]] == nil then
      if missing == nil then
        missing = { nil }
      end
      missing[#missing + 1] = names[i]
    end
  end
  return missing
end

-- Fetch the in-flight tokens of several pools at once: one HMGET of those this call does not know
-- yet (none, mostly: every pass asks for its groups' pools).
local function prefetch_used(pools)
  local missing = unknown(used_c, pools)
  if missing ~= nil then
    local v = rcall('HMGET', K.used, unpack(missing))
    for i = 1, #missing do
      used_c[missing[i]] = (v[i] or 0) + 0
    end
  end
end

-- policy._charge / policy.release: add delta to every pool; an entry at or below zero is dropped.
local function add_used(pools, delta)
  if #pools == 0 then
    return
  end
  settled = false
  prefetch_used(pools)
  for i = 1, #pools do
    num_add(K.used, pools[i], delta)
  end
end

-- Demand.held_in: what a demand (or the head of one: both carry cost, pcost and own) holds in pool
-- ``name``: ``pcost`` (the prompt + the most output it may produce) in its tenant's own pool when
-- that is more than ``cost``, ``cost`` in every other. (Loops on the grant path write it out,
-- ``d.own == name and d.pcost or d.cost``: a call per pool was 2 % of a cycle's instructions.)
local function held_in(d, name)
  if d.own == name then
    return d.pcost
  end
  return d.cost
end

-- add_used for what a demand holds (policy._hold): ``sign`` 1 takes, -1 gives back.
local function add_held(d, sign)
  if d.own == nil then
    add_used(d.pools, sign * d.cost)
    return
  end
  settled = false
  prefetch_used(d.pools)
  for i = 1, #d.pools do
    local name = d.pools[i]
    num_add(K.used, name, sign * (d.own == name and d.pcost or d.cost))
  end
end

-- Counters live in the sorted set T:vtc (tenant -> counter): the score is the double itself, so
-- reads are exact, and the lowest counter of all (lift rule 3) is its first entry. T:vb and T:vl
-- hold the counters of backlogged tenants and of tenants with live leases (lift rules 1 and 2).
local vtc_c
local function vtc(tenant) -- nil when the tenant has no counter
  local c = vtc_c[tenant]
  if c == nil then
    local v = rcall('ZSCORE', K.vtc, tenant)
    c = v and v + 0 or false
    vtc_c[tenant] = c
  end
  if c == false then
    return nil
  end
  return c
end

-- Waiting tickets (T:twait) and live leases (T:tleases) per tenant.
local count, count_add = num, num_add

-- The number of waiting tickets in the domain (HLEN T:tickets), kept by enqueue and forget: every
-- pass of a batch asks whether anything waits at all.
local tickets_n
local function tickets_waiting()
  if tickets_n == nil then
    tickets_n = rcall('HLEN', K.tickets)
  end
  return tickets_n
end

local function backlogged(tenant)
  return count(K.twait, tenant) > 0
end

local function leased(tenant)
  return count(K.tleases, tenant) > 0
end

-- The lowest score of a sorted set whose member is not ``skip``; nil when there is none.
local function lowest(key, skip)
  local v = rcall('ZRANGE', key, '0', '1', 'WITHSCORES')
  if v[1] and v[1] ~= skip then
    return v[2] + 0
  end
  if v[3] then
    return v[4] + 0
  end
  return nil
end

-- ---- the index (budgets/queue_index.py) ----
--
-- T:heads       hash  "<tier> SEP <tenant>" -> the head of that FIFO: flags (old 0/1, parked 0/1)
--                     SEP seq SEP cost SEP enqueued_at SEP counter it is ranked with SEP group id
--                     SEP private pools (LSEP-joined) SEP rank seq (the queue's lowest seq;
--                     absent in records of older versions, where it is the head's own seq)
-- group id            the demand's shared pools, sorted bytewise, LSEP-joined
-- T:gy:<n>:<tier>:<gid>  zset, all scores 0: young active heads by rank; member =
--                     spack('>dd', counter, seq) .. tenant, so that the byte order of members
--                     is the order of (counter, seq) for the non-negative doubles involved
-- T:gc:...        zset  young active heads by cost (member tenant)
-- T:go:...        zset  old active heads by rank (as T:gy)
-- T:gt:<tier>     set   group ids with active heads in that tier; T:gtiers: tiers with such a set
-- T:pv:<pool>     set   heads naming private pool <pool> (parked or not)
-- T:age           zset  young heads by enqueued_at; member spack('>d', seq) .. head key
-- T:clock         the latest ``now`` of a grant pass (ages outside a pass are measured against it)
local function head_key(tier, tenant)
  return tier .. SEP .. tenant
end

local function gkey(kind, tier, gid)
  return T .. ':g' .. kind .. ':' .. #tier .. ':' .. tier .. ':' .. gid
end

-- A group of the pass: its keys and shared pools. A pure function of the domain, tier and group,
-- read only by the pass, so kept across calls (per keyset, bounded).
-- (By tier, then group: a lookup builds no "<tier><SEP><gid>" string.)
local function group_of(tier, gid)
  local groups = K.groups[tier]
  local g = groups and groups[gid]
  if g == nil then
    if K.groups_n >= 4096 then
      K.groups, K.groups_n = {}, 0
      groups = nil
    end
    if groups == nil then
      groups = {}
      K.groups[tier] = groups
    end
    g = {
      gid = gid,
      pools = split(gid, LSEP),
      y = gkey('y', tier, gid),
      c = gkey('c', tier, gid),
      o = gkey('o', tier, gid),
    }
    groups[gid] = g
    K.groups_n = K.groups_n + 1
  end
  return g
end

local function gtkey(tier)
  return T .. ':gt:' .. tier
end

local function pvkey(pool)
  return T .. ':pv:' .. pool
end

local function rank_member(counter, seq, tenant)
  return spack('>dd', counter, seq) .. tenant
end

local function age_member(seq, hk)
  return spack('>d', seq) .. hk
end

-- Python's (counter, seq) tuple order of two rank members (never Lua's locale-dependent ``<``).
local function ranked_before(a, b)
  local c1, s1 = sunpack('>dd', a)
  local c2, s2 = sunpack('>dd', b)
  if c1 ~= c2 then
    return c1 < c2
  end
  return s1 < s2
end

local function bytes_before(a, b)
  local n = mmin(#a, #b)
  for i = 1, n do
    local x, y = sbyte(a, i), sbyte(b, i)
    if x ~= y then
      return x < y
    end
  end
  return #a < #b
end

local clock_c
local function pass_clock()
  if clock_c == nil then
    local v = rcall('GET', K.clock)
    clock_c = v and tonumber(v) or -INF
  end
  return clock_c
end

local function parse_head(hk, v)
  local flags, seq, cost, enq, counter, gid, private, rs = fields8(v)
  local sep = sfind(hk, SEP, 1, true)
  local tier, tenant = ssub(hk, 1, sep - 1), ssub(hk, sep + 1)
  local c, pc, own = tonumber(cost), nil, nil
  if c == nil then -- "<cost>/<pcost>": its tenant's pool holds more (demand, below)
    local slash = sfind(cost, '/', 1, true)
    pc, cost = ssub(cost, slash + 1) + 0, ssub(cost, 1, slash - 1)
    c, own = cost + 0, 'tenant:' .. tenant
  end
  return {
    hk = hk,
    tier = tier,
    tenant = tenant,
    old = ssub(flags, 1, 1) == '1',
    parked = ssub(flags, 2, 2) == '1',
    seq = seq + 0,
    seq_s = seq,
    cost = c,
    cost_s = cost,
    pcost = pc or c,
    own = own,
    enq = enq + 0,
    enq_s = enq,
    counter = counter + 0,
    gid = gid,
    private = split(private, LSEP),
    private_raw = private,
    rs = (rs or seq) + 0,
    rs_s = rs or seq,
  }
end

-- The heads this call has read or written: head key -> its parsed record, or false when that queue
-- has no head. Every change of a head record goes through store_head or remove_head, which keep
-- it; within one call a head is read and parsed from Redis once (a release reads the released
-- tenant's head to rank it and again to re-check its private pool).
local heads_c

local function load_head(hk)
  local h = heads_c[hk]
  if h == nil then
    local v = rcall('HGET', K.heads, hk)
    h = v and parse_head(hk, v) or false
    heads_c[hk] = h
  end
  return h or nil
end

-- A head's T:heads record, as ``flush`` writes it.
local function head_record(h)
  local flags = (h.old and '1' or '0') .. (h.parked and '1' or '0')
  local cost = h.own and h.cost_s .. '/' .. fmt(h.pcost) or h.cost_s
  return flags .. SEP .. h.seq_s .. SEP .. cost .. SEP .. h.enq_s .. SEP .. fmt(h.counter) .. SEP
    .. h.gid .. SEP .. h.private_raw .. SEP .. h.rs_s
end

-- The head record is written at the call's end (``flush``), as it is then: a head stored twice in
-- a call (activated, repositioned, promoted) is written once.
local function store_head(h)
  heads_c[h.hk] = h
  touch(K.heads, h.hk)
  settled = false
end

-- Write what the call changed in the written-behind hashes (see "state"): per hash one HSET of
-- the fields that hold something and one HDEL of those that do not. The two argument lists are
-- kept from call to call (filled to ``ns`` / ``nd``; what lies past is stale): fresh tables per
-- hash, grown a slot at a time, cost a single call about as much as the commands they save.
local flush_set, flush_del = {}, {}

local function flush()
  if dirty_c == nil then
    return
  end
  for key, fields in pairs(dirty_c) do
    local set, del, ns, nd = flush_set, flush_del, 0, 0
    local c = nums_c[key] -- (nil for T:heads and T:rate)
    for f in pairs(fields) do
      local v -- the field's text; nil: delete it
      if c ~= nil then
        local n = c[f]
        v = n > 0 and fmt(n) or nil
      elseif key == K.heads then
        local h = heads_c[f]
        v = h and head_record(h) or nil
      else -- T:rate
        v = fmt(rates_c[f]) .. '|' .. fmt(rates_at[f])
      end
      if v then
        set[ns + 1] = f
        set[ns + 2] = v
        ns = ns + 2
      else
        nd = nd + 1
        del[nd] = f
      end
    end
    for i = 1, ns, 1000 do
      rcall('HSET', key, unpack(set, i, mmin(i + 999, ns)))
    end
    for i = 1, nd, 1000 do
      rcall('HDEL', key, unpack(del, i, mmin(i + 999, nd)))
    end
    if ns > 256 or nd > 256 then -- (a reindex's or a restore's: not kept alive between calls)
      flush_set, flush_del = {}, {}
    end
  end
  dirty_c = nil
end

-- Group ids this call knows to be in T:gt:<tier> (it read them there or added them): tier -> gid
-- -> true. An activation of a head in such a group needs no SADD (every grant activates the
-- granted tenant's next head). Kept by the pass's SREM of an emptied group and by reindex.
local listed_c
local function listed(tier)
  local l = listed_c[tier]
  if l == nil then
    l = {}
    listed_c[tier] = l
  end
  return l
end

-- T:gt:<tier> whole, once a pass of this call has read it: tier -> its group ids, kept by
-- activate's SADD and the pass's SREM (as listed_c). A batch's later passes read no SMEMBERS. The
-- order of the ids decides nothing: no two heads of a tier share a rank (their rank seqs differ),
-- so the pass finds the same lowest candidate whatever order it looks at the groups in.
local members_c

local function tier_groups(tier)
  local gids = members_c[tier]
  if gids == nil then
    gids = rcall('SMEMBERS', gtkey(tier))
    members_c[tier] = gids
    local l = listed(tier)
    for i = 1, #gids do
      l[gids[i]] = true
    end
  end
  return gids
end

-- ``gc_prev``: the T:gc:... key still holding this tenant's previous head (see remove_head), or nil.
local function activate(h, counter, gc_prev)
  h.parked = false
  h.counter = counter
  local m = rank_member(counter, h.rs, h.tenant)
  local ck = nil
  local g = group_of(h.tier, h.gid)
  if h.old then
    rcall('ZADD', g.o, '0', m)
  else
    rcall('ZADD', g.y, '0', m)
    ck = g.c
    rcall('ZADD', ck, h.cost_s, h.tenant) -- (member: the tenant, so it replaces gc_prev's entry there)
  end
  if gc_prev ~= nil and gc_prev ~= ck then
    rcall('ZREM', gc_prev, h.tenant)
  end
  local l = listed(h.tier)
  if not l[h.gid] then
    if rcall('SADD', gtkey(h.tier), h.gid) == 1 then
      rcall('SADD', K.gtiers, h.tier)
      local m = members_c[h.tier]
      if m then
        m[#m + 1] = h.gid
      end
    end
    l[h.gid] = true
  end
end

local function deactivate(h)
  local m = rank_member(h.counter, h.rs, h.tenant)
  local g = group_of(h.tier, h.gid)
  if h.old then
    rcall('ZREM', g.o, m)
  else
    rcall('ZREM', g.y, m)
    rcall('ZREM', g.c, h.tenant)
  end
  h.parked = true -- an emptied group leaves T:gt:<tier> when a pass finds it empty
end

-- queue_index.private_ok: every private pool of the head has room for what it holds there.
local function private_ok(h, private)
  prefetch_used(private)
  for i = 1, #private do
    local name = private[i]
    if used(name) + (h.own == name and h.pcost or h.cost) > pool_spec(name).cap then
      return false
    end
  end
  return true
end

-- The instant of this call's last promote that left no aged head in T:age (see promote).
local promoted_at

-- QueueIndex.add: the ticket ``tk`` becomes the head of its queue, ranked with ``rs`` (the
-- queue's lowest seq, as its text; default its own). ``prev``: what remove_head left of the queue's previous
-- head when this one succeeds it (nil otherwise).
local function add_head(tk, now, old, rs, prev)
  local d = tk.d
  local shared, private = {}, {}
  for i = 1, #d.pools do
    if pool_spec(d.pools[i]).shared then
      shared[#shared + 1] = d.pools[i]
    else
      private[#private + 1] = d.pools[i]
    end
  end
  table.sort(shared, bytes_before)
  local h = {
    hk = head_key(d.tier, d.tenant),
    tier = d.tier,
    tenant = d.tenant,
    old = old or now - tk.enq >= P.backfill,
    parked = true,
    seq = tk.seq,
    seq_s = tk.seq_s,
    cost = d.cost,
    cost_s = fmt(d.cost),
    pcost = d.pcost,
    own = d.own,
    enq = tk.enq,
    enq_s = tk.enq_s,
    counter = 0,
    gid = table.concat(shared, LSEP),
    private = private,
    private_raw = table.concat(private, LSEP),
    rs = rs and rs + 0 or tk.seq,
    rs_s = rs or tk.seq_s,
  }
  if not h.old then
    rcall('ZADD', K.age, h.enq_s, age_member(h.seq, h.hk))
    if promoted_at ~= nil and promoted_at - h.enq >= P.backfill then
      promoted_at = nil
    end
  end
  if prev == nil or prev.private_raw ~= h.private_raw then
    if prev ~= nil then
      for i = 1, #prev.private do
        rcall('SREM', pvkey(prev.private[i]), h.hk)
      end
    end
    for i = 1, #private do
      rcall('SADD', pvkey(private[i]), h.hk)
    end
  end
  local gc_prev = prev and prev.gc
  if private_ok(h, private) then
    activate(h, vtc(d.tenant), gc_prev)
  elseif gc_prev ~= nil then
    rcall('ZREM', gc_prev, h.tenant)
  end
  store_head(h) -- (HSET: it replaces the previous head's field too)
  return h
end

-- QueueIndex.remove. ``successor``: the queue's next ticket becomes its head within this call
-- (grant_head), under the same head key. Then the head's T:heads field, its T:pv memberships and
-- (young and active) its T:gc entry stay for add_head to overwrite, keep or remove: the next head
-- of a tenant usually names the same pools, and each is a command saved per grant. Returned for
-- add_head's ``prev``. Meanwhile nothing reads them: the call's caches know the head gone, and
-- private_changed passes over it (QueueIndex.private_changed, in Python, no longer sees it).
local function remove_head(h, successor)
  local gc = nil
  if not h.parked then
    if successor and not h.old then
      local g = group_of(h.tier, h.gid)
      rcall('ZREM', g.y, rank_member(h.counter, h.rs, h.tenant))
      h.parked = true
      gc = g.c
    else
      deactivate(h)
    end
  end
  heads_c[h.hk] = false
  settled = false
  local left = nil
  if successor then
    left = { private = h.private, private_raw = h.private_raw, gc = gc }
  else
    touch(K.heads, h.hk) -- (deleted by ``flush``: heads_c holds false)
    for i = 1, #h.private do
      rcall('SREM', pvkey(h.private[i]), h.hk)
    end
  end
  if not h.old then
    rcall('ZREM', K.age, age_member(h.seq, h.hk))
  end
  return left
end

-- QueueIndex.reposition: the tenant's counter changed; its active heads move to their new rank.
local function reposition(tenant, counter)
  local hks, unread = {}, {}
  for i = 1, #P.tier_order do
    local hk = head_key(P.tier_order[i], tenant)
    hks[i] = hk
    if heads_c[hk] == nil then
      unread[#unread + 1] = hk
    end
  end
  if #unread > 0 then
    local recs = rcall('HMGET', K.heads, unpack(unread))
    for i = 1, #unread do
      heads_c[unread[i]] = recs[i] and parse_head(unread[i], recs[i]) or false
    end
  end
  for i = 1, #hks do
    local h = heads_c[hks[i]]
    if h then
      if not h.parked then
        local g = group_of(h.tier, h.gid)
        local key = h.old and g.o or g.y
        rcall('ZREM', key, rank_member(h.counter, h.rs, tenant))
        rcall('ZADD', key, '0', rank_member(counter, h.rs, tenant))
        h.counter = counter
        store_head(h)
      end
    end
  end
end

-- QueueIndex.reseq: the queue's lowest seq (``rs``, as text) changed while its head stays
-- (shortest_first).
local function reseq(h, rs)
  local n = rs + 0
  if not h.parked then
    local g = group_of(h.tier, h.gid)
    local key = h.old and g.o or g.y
    rcall('ZREM', key, rank_member(h.counter, h.rs, h.tenant))
    rcall('ZADD', key, '0', rank_member(h.counter, n, h.tenant))
  end
  h.rs, h.rs_s = n, rs
  store_head(h)
end

-- QueueIndex.private_changed: tokens in flight on private ``pool`` changed.
local function private_changed(pool)
  local hks = rcall('SMEMBERS', pvkey(pool))
  for i = 1, #hks do
    local h = load_head(hks[i])
    if h then -- (nil: a head remove_head left for its successor, which is not indexed yet)
      local ok = private_ok(h, h.private)
      if not h.parked and not ok then
        deactivate(h)
        store_head(h)
      elseif h.parked and ok then
        activate(h, vtc(h.tenant))
        store_head(h)
      end
    end
  end
end

local function private_pools_changed(d)
  for i = 1, #d.pools do
    local p = pool_spec(d.pools[i])
    if p and not p.shared then -- a pool gone from the layout has no heads left
      private_changed(d.pools[i])
    end
  end
end

-- policy._set_counter
local function set_vtc(tenant, x)
  settled = false
  vtc_c[tenant] = x
  local s = fmt(x)
  rcall('ZADD', K.vtc, s, tenant)
  if backlogged(tenant) then
    rcall('ZADD', K.vb, s, tenant)
    reposition(tenant, x)
  end
  if leased(tenant) then
    rcall('ZADD', K.vl, s, tenant)
  end
end

-- policy._idle: the tenant has no waiting ticket and no live lease from ``now`` on.
local function mark_idle(tenant, now)
  rcall('ZADD', K.idle, fmt(now), tenant)
end

-- ``now - since >= after`` for the entries of sorted set ``key`` (scores ``since``), oldest first,
-- at most ``limit``: the score range is widened by a hair and the exact test decides, so that the
-- answer is the one Python's float arithmetic gives. The hair covers the rounding of ``now - after``
-- and ``now - since`` (a few units in the last place of the clock, ~1e-16 of it) with room to
-- spare; it must stay small next to the clock, not next to 1: every entry inside it is fetched and
-- dropped again. (It was 1e-9 of the clock, 1.8 s of Unix time, and each grant pass at 100,000
-- tenants fetched the ~1,500 young heads of that window: 93 us of the pass's Redis time.)
local function aged(key, now, after, limit)
  local edge = now - after
  local hair = 1e-12 * mmax(1, math.abs(now), math.abs(edge))
  local v = rcall('ZRANGEBYSCORE', key, '-inf', fmt(edge + hair), 'WITHSCORES', 'LIMIT', '0', limit)
  local out = {}
  for i = 1, #v, 2 do
    if not (now - tonumber(v[i + 1]) >= after) then
      break
    end
    out[#out + 1] = v[i]
  end
  return out
end

-- policy.forget_idle
local function forget_idle(now, limit)
  local gone = aged(K.idle, now, P.idle, limit)
  for i = 1, #gone do
    rcall('ZREM', K.idle, gone[i])
    rcall('ZREM', K.vtc, gone[i])
    vtc_c[gone[i]] = false
    settled = false
  end
  return #gone
end

-- QueueIndex.promote. Every pass of a batch promotes at the call's one instant: once a promote
-- left no aged head behind, the next at the same instant finds one only if add_head has indexed a
-- young head that is aged at that instant since (``promoted_at``, declared above add_head, is
-- cleared then).
local function promote(now, limit)
  if promoted_at == now then
    return 0
  end
  local members = aged(K.age, now, P.backfill, limit)
  if #members < limit then
    promoted_at = now
  end
  for i = 1, #members do
    local h = load_head(ssub(members[i], 9))
    rcall('ZREM', K.age, members[i])
    if not h.parked then
      local m = rank_member(h.counter, h.rs, h.tenant)
      local g = group_of(h.tier, h.gid)
      rcall('ZREM', g.y, m)
      rcall('ZREM', g.c, h.tenant)
      rcall('ZADD', g.o, '0', m)
    end
    h.old = true
    store_head(h)
  end
  return #members
end

-- ---- demands, tickets, leases ----

-- A demand from its five packed fields: tenant, tier, prefill, decode, pools. ``decode`` is the
-- reserved output, or "<reserved>/<limit>" when the request may produce more than it reserves
-- (budgets.redis.keys.pack_demand): its tenant's own pool (``own``) then holds ``pcost``, the prompt
-- + the limit (Demand.private_cost), every other pool ``cost``.
local function demand(tenant, tier, prefill, decode, pools)
  local p, o = prefill + 0, tonumber(decode)
  local lim, own = nil, nil
  if o == nil then
    local slash = sfind(decode, '/', 1, true)
    o, lim = ssub(decode, 1, slash - 1) + 0, ssub(decode, slash + 1)
  end
  local cost = p + o
  local pcost = cost
  if lim ~= nil and p + lim > cost then
    pcost, own = p + lim, 'tenant:' .. tenant
  end
  return {
    tenant = tenant,
    tier = tier,
    prefill = p,
    decode = o,
    cost = cost,
    pcost = pcost,
    own = own,
    limit_s = lim,
    prefill_s = prefill,
    decode_s = decode,
    pools_raw = pools,
    pools = split(pools, LSEP),
  }
end

-- A demand's reservation grew by ``tokens`` (policy.extend): what each pool holds follows.
local function grow_demand(d, tokens)
  d.decode = d.decode + tokens
  d.cost = d.cost + tokens
  d.pcost, d.own = d.cost, nil
  if d.limit_s == nil then
    d.decode_s = fmt(d.decode)
    return
  end
  d.decode_s = fmt(d.decode) .. '/' .. d.limit_s
  local held = d.prefill + d.limit_s
  if held > d.cost then
    d.pcost, d.own = held, 'tenant:' .. d.tenant
  end
end

local function pack_demand(d)
  return d.tenant .. SEP .. d.tier .. SEP .. d.prefill_s .. SEP .. d.decode_s .. SEP .. d.pools_raw
end

-- ticket record: demand(5) SEP enqueued_at SEP owner SEP lease id
-- ``seq``: as text (a list's or hash's member) or as a number. A ticket keeps the text of its seq
-- and enqueued_at for the records and replies that repeat them.
local function load_ticket(seq)
  if type(seq) == 'number' then
    seq = fmt(seq)
  end
  local v = rcall('HGET', K.tickets, seq)
  if not v then
    return nil
  end
  local tenant, tier, prefill, decode, pools, enq, owner, lease = fields8(v)
  return {
    seq = seq + 0,
    seq_s = seq,
    d = demand(tenant, tier, prefill, decode, pools),
    enq = enq + 0,
    enq_s = enq,
    owner = owner,
    lease = lease,
  }
end

-- The seq of ``owner``'s waiting ticket for ``lease_id``, nil when there is none. Walks the owner's
-- tickets: only the recovery of a lost acquire reply asks (withdraw.lua).
local function owned_ticket(owner, lease_id)
  local seqs = rcall('SMEMBERS', rtkey(owner))
  for i = 1, #seqs do
    local v = rcall('HGET', K.tickets, seqs[i])
    if v and split(v, SEP)[8] == lease_id then
      return seqs[i]
    end
  end
  return nil
end

-- Ticket ``seq`` is ``owner``'s ticket for ``lease_id``. A seq alone does not name a ticket for
-- good: a Redis that restarted empty numbers its tickets from 1 again, so a waiter (or a deferred
-- withdrawal) from before the restart must not take a newer ticket with its old seq for its own.
local function ticket_is(seq, owner, lease_id)
  local v = rcall('HGET', K.tickets, seq)
  if not v then
    return false
  end
  local tail = SEP .. owner .. SEP .. lease_id
  return ssub(v, -#tail) == tail
end

-- lease record: demand(5) SEP owner SEP granted_at SEP queued_s
local function load_lease(id)
  local v = rcall('HGET', K.leases, id)
  if not v then
    return nil
  end
  local tenant, tier, prefill, decode, pools, owner, granted_at, queued_s = fields8(v)
  return {
    id = id,
    d = demand(tenant, tier, prefill, decode, pools),
    owner = owner,
    granted_at = granted_at,
    queued_s = queued_s,
  }
end

local function store_lease(id, d, owner, now, queued)
  rcall('HSET', K.leases, id, pack_demand(d) .. SEP .. owner .. SEP .. fmt(now) .. SEP .. fmt(queued))
  rcall('ZADD', K.lexp, fmt(now + P.ttl), id)
end

local function delete_lease(id)
  rcall('HDEL', K.leases, id)
  rcall('ZREM', K.lexp, id)
end

-- policy.check_demand, as an error reply (nil when the demand can be granted some day).
local function check_demand(d)
  if not tenant_spec(d.tenant) then
    return { 'E', 'tenant', d.tenant }
  end
  local t = tier_spec(d.tier)
  if not t then
    return { 'E', 'tier', d.tier }
  end
  for i = 1, #d.pools do
    local p = pool_spec(d.pools[i])
    if not p then
      return { 'E', 'pool', d.pools[i] }
    end
    local limit = pool_limit(p, t)
    if (d.own == d.pools[i] and d.pcost or d.cost) > limit then
      return { 'E', 'never', d.pools[i], limit }
    end
  end
  return nil
end

-- policy.fits
local function fits(d)
  local t = tier_spec(d.tier)
  prefetch_used(d.pools)
  for i = 1, #d.pools do
    local name = d.pools[i]
    if used(name) + (d.own == name and d.pcost or d.cost) > pool_limit(pool_spec(name), t) then
      return false
    end
  end
  return true
end

-- ---- fair share ----

-- policy.prompt_service: a grant charges the prompt only; output is charged as served, at release.
local function prompt_service(d, weight)
  return P.pw * d.prefill / weight
end

-- policy.usage_report + policy.served_output. ``reported`` is the release argument ('' when
-- unknown; the Python side only ever sends a whole number or ''): clamped to [0, decode], the
-- whole reservation when missing or not a whole finite number (n ~= n is NaN).
local function served_output(decode, reported)
  local n = tonumber(reported)
  if n == nil or n ~= n or n == INF or n == -INF or n ~= mfloor(n) then
    return decode
  end
  if n < 0 then
    return 0
  end
  if n > decode then
    return decode
  end
  return n
end

-- policy.lift (the caller guarantees the tenant is not backlogged). ``nobody_waits``: the caller
-- knows no ticket is waiting at all, so there is no backlogged tenant to look up.
local function lift(tenant, nobody_waits)
  local base = nil
  if not nobody_waits then
    base = lowest(K.vb, tenant)
  end
  if base == nil then
    base = lowest(K.vl, tenant)
  end
  local own = vtc(tenant)
  if own == nil then
    if base == nil then
      base = lowest(K.vtc, tenant)
    end
    set_vtc(tenant, base or 0.0)
  elseif base ~= nil and base > own then
    set_vtc(tenant, base)
  end
end

-- policy._charge. ``queued``: the demand was a waiting ticket until now (grant_head), so its
-- tenant was backlogged and is not in T:idle (only a tenant with neither tickets nor leases is).
local function charge(d, queued)
  add_held(d, 1)
  local n = count_add(K.tleases, d.tenant, 1)
  -- (a ticket granted from the queue is often a tenant this call has not read: its spec and its
  -- private pools', read by private_pools_changed, in one HMGET)
  load_policy(d)
  local spec = tenant_spec(d.tenant)
  local x = (vtc(d.tenant) or 0.0) + prompt_service(d, spec.weight)
  set_vtc(d.tenant, x) -- also T:vl: the tenant holds a lease now
  if n == 1 and not queued then
    rcall('ZREM', K.idle, d.tenant)
  end
  if d.pcost ~= 0 then
    private_pools_changed(d)
  end
end


-- ---- the release rate ----
--
-- budgets.retry.ReleaseRate: per pool, tokens released per second, decaying with RATE_TAU. T:rate
-- holds "<rate>|<at>" per pool; a call keeps the pools it read as numbers (``rates_c``: pool ->
-- rate, ``rates_at``: pool -> at) and writes them behind (``flush``): a batch's releases all move
-- the shared pool's meter, and each write was two number formattings and a read of what the last
-- one wrote. (%.17g gives the same double back: the meter runs as if written and read each time.)

local function read_rate(name, v, now)
  if v then
    local bar = sfind(v, '|', 1, true)
    rates_c[name], rates_at[name] = ssub(v, 1, bar - 1) + 0, ssub(v, bar + 1) + 0
  else
    rates_c[name], rates_at[name] = 0.0, now
  end
end

-- Pool ``name``'s meter now (read once per call).
local function rate_now(name, now)
  local r = rates_c[name]
  if r == nil then
    read_rate(name, rcall('HGET', K.rate, name), now)
    r = rates_c[name]
  end
  return r * math.exp(-mmax(0.0, now - rates_at[name]) / RATE_TAU)
end

-- Meter the tokens ``d`` gave back in each of its pools (held_in).
local function rate_add(d, now)
  local pools = d.pools
  local missing = unknown(rates_c, pools)
  if missing ~= nil then
    local v = rcall('HMGET', K.rate, unpack(missing))
    for i = 1, #missing do
      read_rate(missing[i], v[i], now)
    end
  end
  for i = 1, #pools do
    local name = pools[i]
    rates_c[name] = rate_now(name, now) + (d.own == name and d.pcost or d.cost) / RATE_TAU
    rates_at[name] = now
    touch(K.rate, name)
  end
end

-- policy.release + MemoryStore._return (release-rate meters). ``served``: the output tokens to
-- charge (served_output of the report; d.decode for a reaped lease, 0 for a grant never delivered).
local function give_back(d, served, now)
  add_held(d, -1)
  if count_add(K.tleases, d.tenant, -1) == 0 then
    rcall('ZREM', K.vl, d.tenant)
    if not backlogged(d.tenant) then
      mark_idle(d.tenant, now)
    end
  end
  if served > 0 then -- adding 0.0 changes nothing (policy.release skips it too)
    local spec = tenant_spec(d.tenant)
    local c = vtc(d.tenant)
    if spec and c ~= nil then
      set_vtc(d.tenant, c + P.dw * served / spec.weight)
    end
  end
  rate_add(d, now)
  if d.pcost ~= 0 then
    private_pools_changed(d)
  end
end

-- ---- the queue ----

local function add_ahead(d, sign)
  if d.pcost == 0 then
    return
  end
  for i = 1, #d.pools do
    local name = d.pools[i]
    num_add(K.ahead, name .. SEP .. d.tier, sign * (d.own == name and d.pcost or d.cost))
  end
end

-- policy.order_key
local function order_key(d, enq)
  return enq + mmin(d.decode * P.per_token, P.max_defer)
end

-- policy.enqueue
local function enqueue(d, now, owner, lease_id)
  local backlog = count(K.twait, d.tenant)
  if backlog == 0 then
    lift(d.tenant)
  end
  local seq = rcall('INCR', K.seq)
  local tk = { seq = seq, seq_s = sformat('%d', seq), d = d, enq = now, enq_s = fmt(now) }
  tickets_n = tickets_waiting() + 1 -- (counted before the HSET below)
  rcall('HSET', K.tickets, tk.seq_s, pack_demand(d) .. SEP .. tk.enq_s .. SEP .. owner .. SEP .. lease_id)
  count_add(K.twait, d.tenant, 1)
  if backlog == 0 then
    rcall('ZREM', K.idle, d.tenant)
    rcall('ZADD', K.vb, fmt(vtc(d.tenant)), d.tenant)
  end
  num_add(K.tierq, d.tier, 1)
  add_ahead(d, 1)
  local qk = qkey(d.tier, d.tenant)
  local n = rcall('RPUSH', qk, tk.seq_s)
  if P.sf then
    local oq = oqkey(d.tier, d.tenant)
    rcall('ZADD', oq, fmt(order_key(d, now)), oq_member(seq))
    if n > 1 and oq_first(oq) == seq then -- it goes before the head: it is the head now
      remove_head(load_head(head_key(d.tier, d.tenant)))
      add_head(tk, pass_clock(), false, rcall('LINDEX', qk, '0'))
    end
  end
  if n == 1 then
    add_head(tk, pass_clock(), false)
  end
  rcall('SADD', rtkey(owner), tk.seq_s)
  return seq
end

-- policy._forget. ``granted``: the ticket leaves to be charged at once (grant_head), so its
-- tenant holds a lease before the call ends and is not idle: policy._forget marks it idle and
-- _charge unmarks it; here neither writes (nor reads T:tleases to decide).
local function forget(tk, now, granted)
  tickets_n = tickets_waiting() - 1 -- (counted before the HDEL below; tk is a waiting ticket)
  rcall('HDEL', K.tickets, tk.seq_s)
  if count_add(K.twait, tk.d.tenant, -1) == 0 then
    rcall('ZREM', K.vb, tk.d.tenant)
    if not granted and not leased(tk.d.tenant) then
      mark_idle(tk.d.tenant, now)
    end
  end
  num_add(K.tierq, tk.d.tier, -1)
  add_ahead(tk.d, -1)
  rcall('SREM', rtkey(tk.owner), tk.seq_s)
end

-- policy._leave_ordered: take ``seq`` out of a shortest_first queue (list and zset); true when it
-- was the first ticket.
local function leave_queue(qk, oq, seq)
  rcall('ZREM', oq, oq_member(seq))
  if tonumber(rcall('LINDEX', qk, '0')) == seq then
    rcall('LPOP', qk)
    return true
  end
  rcall('LREM', qk, '1', seq)
  return false
end

-- policy.withdraw
local function withdraw(seq, now)
  settled = false
  local tk = load_ticket(seq)
  if tk == nil then
    return nil
  end
  local qk = qkey(tk.d.tier, tk.d.tenant)
  if P.sf then
    local oq = oqkey(tk.d.tier, tk.d.tenant)
    local first = leave_queue(qk, oq, tk.seq)
    local h = load_head(head_key(tk.d.tier, tk.d.tenant))
    local nxt = oq_first(oq)
    if nxt == nil then
      remove_head(h)
    elseif h.seq == tk.seq then
      remove_head(h)
      add_head(load_ticket(nxt), pass_clock(), false, rcall('LINDEX', qk, '0'))
    elseif first then
      reseq(h, rcall('LINDEX', qk, '0'))
    end
  elseif tonumber(rcall('LINDEX', qk, '0')) == tk.seq then
    rcall('LPOP', qk)
    remove_head(load_head(head_key(tk.d.tier, tk.d.tenant)))
    local nxt = rcall('LINDEX', qk, '0')
    if nxt then
      add_head(load_ticket(nxt), pass_clock(), false)
    end
  else
    rcall('LREM', qk, '1', tk.seq_s)
  end
  forget(tk, now)
  return tk
end


-- A granted ticket becomes a lease under the id its owner chose; the owner is told by pub/sub
-- (except ``own``: the caller learns it from the reply).
local function grant_ticket(tk, now, own)
  local queued = now - tk.enq
  store_lease(tk.lease, tk.d, tk.owner, now, queued)
  if tk.owner ~= CALLER then
    -- The lease lives no longer than its owner's last sign of life + TTL (T:replicas holds
    -- last beat + TTL): a ticket of a replica that just died gives its grant back within one
    -- TTL of the death, not one TTL after the grant. A live owner beats every TTL/4 or sooner,
    -- so its new lease still has >= 3/4 TTL to receive its first heartbeat.
    local alive_until = rcall('ZSCORE', K.replicas, tk.owner)
    if alive_until and tonumber(alive_until) < now + P.ttl then
      rcall('ZADD', K.lexp, alive_until, tk.lease)
    end
  end
  if tk.seq ~= own then
    notify(tk.owner, 'G' .. SEP .. tk.seq_s .. SEP .. tk.lease .. SEP .. fmt(now) .. SEP .. fmt(queued))
  end
  return queued
end

local function held_by(g, held)
  for i = 1, #g.pools do
    if held[g.pools[i]] then
      return true
    end
  end
  return false
end

-- policy._room: the least limit - in flight over the group's shared pools.
local function room_of(g, t)
  prefetch_used(g.pools)
  local room = INF
  for i = 1, #g.pools do
    local left = pool_limit(pool_spec(g.pools[i]), t) - used(g.pools[i])
    if left < room then
      room = left
    end
  end
  return room
end

local function hold(set, g)
  for i = 1, #g.pools do
    set[g.pools[i]] = true
  end
end

-- The lowest eligible candidate of one tier (see policy.grant_pass): returns it with its group,
-- room and whether it is old; also adds to held_lower the groups whose young heads it passes.
local function next_candidate(live, t, cursor, held_lower, contributed)
  local best, best_g, best_room, best_old = nil, nil, 0, false
  local passing = nil -- { group, its young head }: made when one is passed (mostly none)
  for i = 1, #live do
    local g = live[i]
    local room = room_of(g, t)
    local cand = rcall('ZRANGE', g.o, '0', '0')[1]
    local cand_old = cand ~= nil
    local succ
    if cursor == nil then
      succ = rcall('ZRANGE', g.y, '0', '0')[1]
      if cand == nil and succ == nil then
        rcall('SREM', gtkey(t.name), g.gid) -- emptied since (deactivate leaves it)
        listed(t.name)[g.gid] = nil
        local m = members_c[t.name]
        if m then
          for j = #m, 1, -1 do
            if m[j] == g.gid then
              table.remove(m, j)
            end
          end
        end
      end
    else
      succ = rcall('ZRANGEBYLEX', g.y, '(' .. cursor, '+', 'LIMIT', '0', '1')[1]
    end
    if succ then
      if tonumber(rcall('ZRANGE', g.c, '0', '0', 'WITHSCORES')[2]) <= room then
        if cand == nil or ranked_before(succ, cand) then
          cand, cand_old = succ, false
        end
      elseif not contributed[g.gid] then
        if passing == nil then
          passing = {}
        end
        passing[#passing + 1] = { g, succ }
      end
    end
    if cand ~= nil and (best == nil or ranked_before(cand, best)) then
      best, best_g, best_room, best_old = cand, g, room, cand_old
    end
  end
  for i = 1, passing and #passing or 0 do
    local g, succ = passing[i][1], passing[i][2]
    if best == nil or ranked_before(succ, best) then -- passed over: blocked, none of its group fits
      hold(held_lower, g)
      contributed[g.gid] = true
    end
  end
  return best, best_g, best_room, best_old
end

-- Grant the head ``h`` (ticket ``tk``) in a pass; its tenant's next ticket becomes head, and joins
-- ``live`` if its group is new to the pass and not held.
local function grant_head(h, tk, now, own, live, held_all)
  local qk = qkey(h.tier, h.tenant)
  local nxt
  if P.sf then
    local oq = oqkey(h.tier, h.tenant)
    leave_queue(qk, oq, tk.seq)
    nxt = oq_first(oq)
  else
    rcall('LPOP', qk)
    nxt = rcall('LINDEX', qk, '0') or nil -- (an empty list's nil bulk reply is false in Lua)
  end
  if vtc_c[h.tenant] == nil and not h.parked then
    -- An active head is ranked with its tenant's counter (set_vtc repositions it on every change,
    -- activate ranks it with the counter of the moment): the charge below needs no ZSCORE.
    vtc_c[h.tenant] = h.counter
  end
  local left = remove_head(h, nxt ~= nil)
  forget(tk, now, true)
  charge(tk.d, true)
  local queued = grant_ticket(tk, now, own)
  if nxt then
    local rs = nil -- fifo: the queue's first ticket is its next head
    if P.sf then
      rs = rcall('LINDEX', qk, '0')
    end
    local nh = add_head(load_ticket(nxt), now, false, rs, left)
    if not nh.parked then
      local known = false
      for i = 1, #live do
        if live[i].gid == nh.gid then
          known = true
        end
      end
      local g = group_of(h.tier, nh.gid)
      if not known and not held_by(g, held_all) then
        live[#live + 1] = g
      end
    end
  end
  return queued
end

-- policy.grant_pass. Returns the queued seconds of ``own`` when that ticket was granted.
local function grant_pass(now, own)
  if own == nil and tickets_waiting() == 0 then -- ``own`` is waiting: not empty
    return nil
  end
  if now > pass_clock() then
    clock_c = now
    rcall('SET', K.clock, fmt(now))
  end
  local budget = P.max_scan
  if promote(now, budget) == 0 and settled then
    return nil
  end
  settled = false -- until this pass reaches its end
  local mine = nil
  local held_all = {}
  for ti = 1, #P.tier_order do
    local tier_name = P.tier_order[ti]
    local gids = tier_groups(tier_name)
    if #gids > 0 then
      local t = tier_spec(tier_name)
      local live = {}
      for i = 1, #gids do
        local g = group_of(tier_name, gids[i])
        if not held_by(g, held_all) then
          live[#live + 1] = g
        end
      end
      local held_lower, contributed = {}, {}
      local cursor = nil
      while true do
        if budget <= 0 then
          return mine
        end
        local best, g, room, old = next_candidate(live, t, cursor, held_lower, contributed)
        if best == nil then
          break
        end
        budget = budget - 1
        cursor = best
        local h = load_head(head_key(tier_name, ssub(best, 17)))
        if h.cost <= room then
          -- just below the granted rank: the tenant's next head may have the same one
          local c, rs = sunpack('>dd', best)
          cursor = spack('>dd', c, rs - 0.5) .. h.tenant
          local tk = load_ticket(h.seq_s)
          local queued = grant_head(h, tk, now, own, live, held_all)
          if tk.seq == own then
            mine = queued
          end
        elseif old then
          hold(held_lower, g)
          hold(held_all, g)
          local still = {}
          for i = 1, #live do
            if not held_by(live[i], held_all) then
              still[#still + 1] = live[i]
            end
          end
          live = still
        else
          hold(held_lower, g)
          contributed[g.gid] = true
        end
      end
      for name in pairs(held_lower) do
        held_all[name] = true
      end
    end
  end
  settled = true
  return mine
end

-- budgets.retry.retry_after (tokens_ahead from T:ahead)
local function retry_after(d, now)
  local t = tier_spec(d.tier)
  local upper = mmax(MIN_RETRY, t.maxwait)
  local worst = 0.0
  for i = 1, #d.pools do
    local name = d.pools[i]
    local p = pool_spec(name)
    if p then
      local free = pool_limit(p, t) - used(name)
      local ahead = 0
      for j = 1, #P.tier_order do
        local other = tier_spec(P.tier_order[j])
        if other and other.rank <= t.rank then
          ahead = ahead + num(K.ahead, name .. SEP .. other.name)
        end
      end
      local needed = ahead + (d.own == name and d.pcost or d.cost) - free
      if needed > 0 then
        local rate = rate_now(name, now)
        if rate > 0 then
          worst = mmax(worst, needed / rate)
        else
          worst = INF
        end
      end
    end
  end
  return mmin(mmax(worst, MIN_RETRY), upper)
end


-- A call beats for a replica once: every operation of a call happens at the same instant, so a
-- batch's queued acquires would write the same score again.
local beaten
local function beat(replica, now)
  if beaten ~= replica then
    rcall('ZADD', K.replicas, fmt(now + P.ttl), replica)
    beaten = replica
  end
end


-- policy.reindex: the index (and the shortest_first zsets) built again from the queues (after a
-- layout change). A head keeps its age class; a ticket that only now becomes head is classed as
-- usual. O(waiting tickets).
local function reindex()
  flush() -- (it reads T:heads whole)
  settled = false
  local was_old = {}
  local recs = rcall('HGETALL', K.heads)
  local doomed = { K.heads, K.age }
  for i = 1, #recs, 2 do
    local h = load_head(recs[i])
    was_old[h.seq] = h.old
    for j = 1, #h.private do
      doomed[#doomed + 1] = pvkey(h.private[j])
    end
  end
  local tiers = rcall('SMEMBERS', K.gtiers)
  for i = 1, #tiers do
    local gids = rcall('SMEMBERS', gtkey(tiers[i]))
    for j = 1, #gids do
      doomed[#doomed + 1] = gkey('y', tiers[i], gids[j])
      doomed[#doomed + 1] = gkey('c', tiers[i], gids[j])
      doomed[#doomed + 1] = gkey('o', tiers[i], gids[j])
    end
    doomed[#doomed + 1] = gtkey(tiers[i])
  end
  doomed[#doomed + 1] = K.gtiers
  for i = 1, #doomed, 1000 do
    rcall('DEL', unpack(doomed, i, mmin(i + 999, #doomed)))
  end
  listed_c, members_c = {}, {}
  heads_c = {}
  local seqs = rcall('HKEYS', K.tickets)
  local seen = {}
  for i = 1, #seqs do
    local tk = load_ticket(seqs[i])
    local qk = qkey(tk.d.tier, tk.d.tenant)
    if not seen[qk] then
      seen[qk] = true
      local rs = rcall('LINDEX', qk, '0')
      local head_seq = rs
      local oq = oqkey(tk.d.tier, tk.d.tenant)
      rcall('DEL', oq)
      if P.sf then -- the order keys under the new settings
        local members = rcall('LRANGE', qk, '0', '-1')
        for j = 1, #members do
          local other = load_ticket(members[j])
          rcall('ZADD', oq, fmt(order_key(other.d, other.enq)), oq_member(other.seq))
        end
        head_seq = oq_first(oq)
      end
      local head = load_ticket(head_seq)
      local old = was_old[head.seq]
      if old == nil then
        add_head(head, pass_clock(), false, rs)
      else
        add_head(head, -INF, old, rs)
      end
    end
  end
end

-- Derived state written by an older version of these scripts (counters in a hash, no index):
-- rebuilt once from the base records. O(tenants + waiting tickets).
local INDEX_FORMAT = '2'
local function upgrade(now)
  if rcall('HGET', K.layout, 'index') == INDEX_FORMAT then
    return
  end
  if rcall('TYPE', K.vtc).ok == 'hash' then
    local kv = rcall('HGETALL', K.vtc)
    rcall('DEL', K.vtc)
    for i = 1, #kv, 2 do
      rcall('ZADD', K.vtc, kv[i + 1], kv[i])
    end
  end
  rcall('DEL', K.vb, K.vl, K.idle, K.ahead)
  nums_c[K.ahead] = {}
  if dirty_c ~= nil then
    dirty_c[K.ahead] = nil
  end
  local counters = rcall('ZRANGE', K.vtc, '0', '-1', 'WITHSCORES')
  for i = 1, #counters, 2 do
    local tenant, c = counters[i], counters[i + 1]
    local b, l = backlogged(tenant), leased(tenant)
    if b then
      rcall('ZADD', K.vb, c, tenant)
    end
    if l then
      rcall('ZADD', K.vl, c, tenant)
    end
    if not b and not l then
      mark_idle(tenant, now)
    end
  end
  local all = rcall('HVALS', K.tickets)
  for i = 1, #all do
    local f = split(all[i], SEP)
    add_ahead(demand(f[1], f[2], f[3], f[4], f[5]), 1)
  end
  for i = 1, #P.tier_order do
    rcall('DEL', T .. ':qt:' .. P.tier_order[i]) -- the old per-tier tenant sets
  end
  reindex()
  rcall('HSET', K.layout, 'index', INDEX_FORMAT)
end

-- ---- entry ----

-- Keys per layout key, kept across calls when the library stays loaded (a Redis 7 function).
local keysets = {}
local keysets_n = 0

-- Every entry function starts here: the call's keys and arguments, and fresh per-call caches.
local function begin(keys, args)
  if rcall == nil then
    rcall, tonumber, unpack, type, pairs, ssub, sfind, sformat, sbyte, smatch, spack, sunpack, mmin, mmax, mfloor =
      global_functions()
  end
  local layout = keys[1]
  -- Redis Cluster, the domain's slot being moved: a key not here yet counts as the new owner's, and
  -- a call reaching one fails where it stands, its earlier writes kept. So before any write, one
  -- key that never exists is looked up: refused means the slot is moving, and nothing runs.
  local probe = redis.pcall('EXISTS', layout .. ':moving')
  if type(probe) == 'table' and probe.err then
    error({ err = 'TRYAGAIN the domain\'s slot is being moved' })
  end
  K = keysets[layout]
  if K == nil then
    if keysets_n >= 64 then
      keysets, keysets_n = {}, 0
    end
    K = keyset(layout)
    keysets[layout] = K
    keysets_n = keysets_n + 1
  end
  T = K.T
  ARGS = args
  CALLER = args[2]
  LOCAL = {}
  now_c, clock_c, P = nil, nil, nil
  fmt_c = {}
  SP, SX, vtc_c = new_specs(), new_specs(), {}
  kept = nil
  used_c = {}
  nums_c = { [K.used] = used_c, [K.twait] = {}, [K.tleases] = {}, [K.ahead] = {}, [K.tierq] = {} }
  dirty_c = nil
  heads_c = {}
  rates_c, rates_at = {}, {}
  settled = false
  beaten = nil
  tickets_n, promoted_at = nil, nil
  listed_c, members_c = {}, {}
end

-- An entry's own arguments: ARGV after the clock override and the caller.
local function own_args(args)
  local A = {}
  for i = 3, #args do
    A[i - 2] = args[i]
  end
  return A
end
