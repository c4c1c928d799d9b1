-- lib.lua: shared by every tokengate script (the loader prepends it to each entry script).
--
-- This is a port of budgets/policy.py (and the retry estimate of budgets/retry.py). The Python
-- module's docstring is the specification; every function here names its Python counterpart and
-- must make the same decisions, in the same order, with the same float arithmetic (doubles on
-- both sides; counters are stored with %.17g so they round-trip exactly).
--
-- KEYS[1] is "{tg:<prefix>}:layout"; every other key is derived from its hash tag, so all keys of
-- one budget domain share one cluster slot. ARGV[1] is always the clock override: empty in
-- production (server TIME is used), a number only when a test drives the store's clock. ARGV[2]
-- is always the calling replica. Each entry file defines ``<name>_main(A)`` with ``A`` = its own
-- arguments (ARGV[3..]); the loader appends the call and ``return { reply, LOCAL }``: the reply
-- plus the wake-ups meant for the caller itself. ``batch`` runs several acquire/release
-- operations in one call (see batch.lua).

local T = string.sub(KEYS[1], 1, -8) -- strip ":layout"
local K = {
  layout = KEYS[1],
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
}
local SEP = '\31'
local LSEP = '\30'
local RATE_TAU = 10.0 -- budgets.retry.RATE_TAU_S
local MIN_RETRY = 1.0 -- budgets.retry.MIN_RETRY_S

local function split(s, sep)
  local out = {}
  if s == '' then
    return out
  end
  local i = 1
  while true do
    local j = string.find(s, sep, i, true)
    if not j then
      out[#out + 1] = string.sub(s, i)
      return out
    end
    out[#out + 1] = string.sub(s, i, j - 1)
    i = j + 1
  end
end

-- HSET of a long field/value list, in chunks (Lua's unpack has a limit of a few thousand values).
local function hset_many(key, fields)
  for i = 1, #fields, 1000 do
    redis.call('HSET', key, unpack(fields, i, math.min(i + 999, #fields)))
  end
end

local function fmt(x)
  return string.format('%.17g', x)
end

local function clock(arg)
  if arg ~= nil and arg ~= '' then
    return tonumber(arg)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- One instant per script call: every operation of a batch happens "at the same time".
local now_c = nil
local function script_now()
  if now_c == nil then
    now_c = clock(ARGV[1])
  end
  return now_c
end

local function qkey(tier, tenant)
  return T .. ':q:' .. #tier .. ':' .. tier .. ':' .. tenant
end

local function qtkey(tier)
  return T .. ':qt:' .. tier
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
local CALLER = ARGV[2]
local LOCAL = {}
local function notify(owner, payload)
  if owner == CALLER then
    LOCAL[#LOCAL + 1] = payload
  else
    redis.call('PUBLISH', wake_channel(owner), payload)
  end
end

-- ---- layout (cached per script call) ----
--
-- One hash T:spec holds the whole layout as the scripts read it: the policy fields, and one field
-- per pool ("p:<name>" = "capacity|shared"), tier ("t:<name>" = "rank|ceiling|max_wait") and
-- tenant ("n:<name>" = "weight|max_queue_len"). A call fetches the policy plus every spec its
-- demand names with a single HMGET.

local P = nil
local spec_c = {} -- field -> parsed spec, or false when absent

local function parse_spec(field, v)
  if not v then
    return false
  end
  local kind = string.sub(field, 1, 1)
  if kind == 'p' then
    local cap, shared = string.match(v, '^(.-)|(.)$')
    return { cap = tonumber(cap), shared = (shared == '1') }
  elseif kind == 't' then
    local f = split(v, '|')
    return { name = string.sub(field, 3), rank = tonumber(f[1]), ceiling = tonumber(f[2]), maxwait = tonumber(f[3]) }
  end
  local w, q = string.match(v, '^(.-)|(.-)$')
  return { weight = tonumber(w), maxq = tonumber(q) }
end

local function spec(field)
  local v = spec_c[field]
  if v == nil then
    v = parse_spec(field, redis.call('HGET', K.spec, field))
    spec_c[field] = v
  end
  return v
end

local function pool_spec(name)
  return spec('p:' .. name)
end

local function tier_spec(name)
  return spec('t:' .. name)
end

local function tenant_spec(name)
  return spec('n:' .. name)
end

-- The policy and (optionally) a demand's specs in one round trip; false when Redis has no layout.
-- Within one script call (a batch) the policy is read once; later calls fetch only new specs.
local function load_policy(d)
  local fields = {}
  if P == nil then
    fields = { 'ver', 'pw', 'dw', 'backfill', 'ttl', 'max_scan', 'tiers' }
  end
  local first = #fields + 1
  if d then
    local want = { 'n:' .. d.tenant, 't:' .. d.tier }
    for i = 1, #d.pools do
      want[#want + 1] = 'p:' .. d.pools[i]
    end
    for i = 1, #want do
      if spec_c[want[i]] == nil then
        fields[#fields + 1] = want[i]
      end
    end
  end
  if #fields == 0 then
    return true
  end
  local v = redis.call('HMGET', K.spec, unpack(fields))
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
    }
  end
  for i = first, #fields do
    spec_c[fields[i]] = parse_spec(fields[i], v[i])
  end
  return true
end

local function reset_layout_cache()
  P = nil
  for k in pairs(spec_c) do
    spec_c[k] = nil
  end
end

-- policy.pool_limit
local function pool_limit(p, t)
  if not p.shared then
    return p.cap
  end
  return math.floor(t.ceiling * p.cap)
end

-- ---- state (cached per script call, written through) ----

local used_c = {}
local function used(name)
  local u = used_c[name]
  if u == nil then
    u = tonumber(redis.call('HGET', K.used, name) or '0')
    used_c[name] = u
  end
  return u
end

-- Fetch the in-flight tokens of several pools at once.
local function prefetch_used(pools)
  local missing = {}
  for i = 1, #pools do
    if used_c[pools[i]] == nil then
      missing[#missing + 1] = pools[i]
    end
  end
  if #missing > 0 then
    local v = redis.call('HMGET', K.used, unpack(missing))
    for i = 1, #missing do
      used_c[missing[i]] = tonumber(v[i] or '0')
    end
  end
end

-- policy._charge / policy.release: add delta to every pool; an entry at or below zero is dropped.
local function add_used(pools, delta)
  if #pools == 0 then
    return
  end
  prefetch_used(pools)
  local set, del = {}, {}
  for i = 1, #pools do
    local name = pools[i]
    local left = used_c[name] + delta
    if left > 0 then
      set[#set + 1] = name
      set[#set + 1] = left
    else
      del[#del + 1] = name
      left = 0
    end
    used_c[name] = left
  end
  if #set > 0 then
    redis.call('HSET', K.used, unpack(set))
  end
  if #del > 0 then
    redis.call('HDEL', K.used, unpack(del))
  end
end

local vtc_c = {}
local function vtc(tenant) -- nil when the tenant has no counter
  local c = vtc_c[tenant]
  if c == nil then
    local v = redis.call('HGET', K.vtc, tenant)
    c = v and tonumber(v) or false
    vtc_c[tenant] = c
  end
  if c == false then
    return nil
  end
  return c
end

-- Fetch several tenants' counters at once.
local function prefetch_vtc(names)
  local missing = {}
  for i = 1, #names do
    if vtc_c[names[i]] == nil then
      missing[#missing + 1] = names[i]
    end
  end
  if #missing > 0 then
    local v = redis.call('HMGET', K.vtc, unpack(missing))
    for i = 1, #missing do
      vtc_c[missing[i]] = v[i] and tonumber(v[i]) or false
    end
  end
end

local function set_vtc(tenant, x)
  vtc_c[tenant] = x
  redis.call('HSET', K.vtc, tenant, fmt(x))
end

-- ---- demands, tickets, leases ----

-- A demand from its five packed fields: tenant, tier, prefill, decode, pools.
local function demand(tenant, tier, prefill, decode, pools)
  local d = {
    tenant = tenant,
    tier = tier,
    prefill = tonumber(prefill),
    decode = tonumber(decode),
    pools_raw = pools,
    pools = split(pools, LSEP),
  }
  d.cost = d.prefill + d.decode
  return d
end

local function pack_demand(d)
  return d.tenant .. SEP .. d.tier .. SEP .. d.prefill .. SEP .. d.decode .. SEP .. d.pools_raw
end

-- ticket record: demand(5) SEP enqueued_at SEP owner SEP lease id
local function load_ticket(seq)
  local v = redis.call('HGET', K.tickets, seq)
  if not v then
    return nil
  end
  local f = split(v, SEP)
  return {
    seq = tonumber(seq),
    d = demand(f[1], f[2], f[3], f[4], f[5]),
    enq = tonumber(f[6]),
    owner = f[7],
    lease = f[8],
  }
end

-- lease record: demand(5) SEP owner SEP granted_at SEP queued_s
local function load_lease(id)
  local v = redis.call('HGET', K.leases, id)
  if not v then
    return nil
  end
  local f = split(v, SEP)
  return {
    id = id,
    d = demand(f[1], f[2], f[3], f[4], f[5]),
    owner = f[6],
    granted_at = f[7],
    queued_s = f[8],
  }
end

local function store_lease(id, d, owner, now, queued)
  redis.call('HSET', K.leases, id, pack_demand(d) .. SEP .. owner .. SEP .. fmt(now) .. SEP .. fmt(queued))
  redis.call('ZADD', K.lexp, fmt(now + P.ttl), id)
end

local function delete_lease(id)
  redis.call('HDEL', K.leases, id)
  redis.call('ZREM', K.lexp, id)
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
    if d.cost > limit then
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
    if used(name) + d.cost > pool_limit(pool_spec(name), t) then
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
  if n == nil or n ~= n or n == math.huge or n == -math.huge or n ~= math.floor(n) then
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

local function min_counter_of(names, except)
  prefetch_vtc(names)
  local base = nil
  for i = 1, #names do
    local other = names[i]
    if other ~= except then
      local c = vtc(other)
      if c ~= nil and (base == nil or c < base) then
        base = c
      end
    end
  end
  return base
end

-- policy.lift (the caller guarantees the tenant is not backlogged). ``nobody_waits``: the caller
-- knows no ticket is waiting at all, so there is no backlogged tenant to look up.
local function lift(tenant, nobody_waits)
  local base = nil
  if not nobody_waits then
    base = min_counter_of(redis.call('HKEYS', K.twait), tenant)
  end
  if base == nil then
    local names = redis.call('HKEYS', K.tleases)
    names[#names + 1] = tenant -- fetched along with the others: lift reads it next
    base = min_counter_of(names, tenant)
  end
  local own = vtc(tenant)
  if own == nil then
    if base == nil then
      local all = redis.call('HVALS', K.vtc)
      for i = 1, #all do
        local c = tonumber(all[i])
        if base == nil or c < base then
          base = c
        end
      end
    end
    set_vtc(tenant, base or 0.0)
  elseif base ~= nil and base > own then
    set_vtc(tenant, base)
  end
end

-- policy._charge
local function charge(d)
  add_used(d.pools, d.cost)
  local spec = tenant_spec(d.tenant)
  set_vtc(d.tenant, (vtc(d.tenant) or 0.0) + prompt_service(d, spec.weight))
  redis.call('HINCRBY', K.tleases, d.tenant, 1)
end

-- budgets.retry.ReleaseRate
local function rate_value(v, now)
  if not v then
    return 0.0
  end
  local r, last = string.match(v, '^(.-)|(.-)$')
  local dt = math.max(0.0, now - tonumber(last))
  return tonumber(r) * math.exp(-dt / RATE_TAU)
end

local function rate_add(pools, amount, now)
  if #pools == 0 then
    return
  end
  local v = redis.call('HMGET', K.rate, unpack(pools))
  local set = {}
  for i = 1, #pools do
    set[#set + 1] = pools[i]
    set[#set + 1] = fmt(rate_value(v[i], now) + amount / RATE_TAU) .. '|' .. fmt(now)
  end
  redis.call('HSET', K.rate, unpack(set))
end

-- policy.release + MemoryStore._return (release-rate meters). ``served``: the output tokens to
-- charge (served_output of the report; d.decode for a reaped lease, 0 for a grant never delivered).
local function give_back(d, served, now)
  add_used(d.pools, -d.cost)
  if tonumber(redis.call('HINCRBY', K.tleases, d.tenant, -1)) <= 0 then
    redis.call('HDEL', K.tleases, d.tenant)
  end
  if served > 0 then -- adding 0.0 changes nothing (policy.release skips it too)
    local spec = tenant_spec(d.tenant)
    local c = vtc(d.tenant)
    if spec and c ~= nil then
      set_vtc(d.tenant, c + P.dw * served / spec.weight)
    end
  end
  rate_add(d.pools, d.cost, now)
end

-- ---- the queue ----

-- policy.enqueue
local function enqueue(d, now, owner, lease_id)
  if redis.call('HEXISTS', K.twait, d.tenant) == 0 then
    lift(d.tenant)
  end
  local seq = redis.call('INCR', K.seq)
  redis.call('HSET', K.tickets, seq, pack_demand(d) .. SEP .. fmt(now) .. SEP .. owner .. SEP .. lease_id)
  redis.call('HINCRBY', K.twait, d.tenant, 1)
  redis.call('HINCRBY', K.tierq, d.tier, 1)
  redis.call('RPUSH', qkey(d.tier, d.tenant), seq)
  redis.call('SADD', qtkey(d.tier), d.tenant)
  redis.call('SADD', rtkey(owner), seq)
  return seq
end

local function decr_or_drop(key, field)
  if tonumber(redis.call('HINCRBY', key, field, -1)) <= 0 then
    redis.call('HDEL', key, field)
  end
end

-- policy._forget
local function forget(tk)
  redis.call('HDEL', K.tickets, tk.seq)
  decr_or_drop(K.twait, tk.d.tenant)
  decr_or_drop(K.tierq, tk.d.tier)
  redis.call('SREM', rtkey(tk.owner), tk.seq)
end

-- policy.withdraw
local function withdraw(seq)
  local tk = load_ticket(seq)
  if tk == nil then
    return nil
  end
  local qk = qkey(tk.d.tier, tk.d.tenant)
  redis.call('LREM', qk, 1, tk.seq)
  if redis.call('LLEN', qk) == 0 then
    redis.call('SREM', qtkey(tk.d.tier), tk.d.tenant)
  end
  forget(tk)
  return tk
end

-- Min-heap of {counter, seq, tenant}, ordered like Python's tuples.
local function before(a, b)
  if a[1] ~= b[1] then
    return a[1] < b[1]
  end
  if a[2] ~= b[2] then
    return a[2] < b[2]
  end
  return a[3] < b[3]
end

local function heap_push(h, item)
  h[#h + 1] = item
  local i = #h
  while i > 1 do
    local parent = math.floor(i / 2)
    if before(h[i], h[parent]) then
      h[i], h[parent] = h[parent], h[i]
      i = parent
    else
      break
    end
  end
end

local function heap_pop(h)
  local top = h[1]
  local n = #h
  h[1] = h[n]
  h[n] = nil
  n = n - 1
  local i = 1
  while true do
    local l, r, m = 2 * i, 2 * i + 1, i
    if l <= n and before(h[l], h[m]) then
      m = l
    end
    if r <= n and before(h[r], h[m]) then
      m = r
    end
    if m == i then
      break
    end
    h[i], h[m] = h[m], h[i]
    i = m
  end
  return top
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
    local alive_until = redis.call('ZSCORE', K.replicas, tk.owner)
    if alive_until and tonumber(alive_until) < now + P.ttl then
      redis.call('ZADD', K.lexp, alive_until, tk.lease)
    end
  end
  if tk.seq ~= own then
    notify(tk.owner, 'G' .. SEP .. tk.seq .. SEP .. fmt(now) .. SEP .. fmt(queued))
  end
  return queued
end

-- policy.grant_pass. Returns the queued seconds of ``own`` when that ticket was granted.
local function grant_pass(now, own)
  if redis.call('HLEN', K.tickets) == 0 then
    return nil
  end
  local mine = nil
  local held_all = {}
  local scanned = 0
  for ti = 1, #P.tier_order do
    local tier_name = P.tier_order[ti]
    local tenants = redis.call('SMEMBERS', qtkey(tier_name))
    if #tenants > 0 then
      local t = tier_spec(tier_name)
      local held_lower = {}
      local heap = {}
      for i = 1, #tenants do
        local head = redis.call('LINDEX', qkey(tier_name, tenants[i]), 0)
        heap_push(heap, { vtc(tenants[i]) or 0.0, tonumber(head), tenants[i] })
      end
      while #heap > 0 and scanned < P.max_scan do
        local top = heap_pop(heap)
        local tenant = top[3]
        local qk = qkey(tier_name, tenant)
        local tk = load_ticket(top[2])
        scanned = scanned + 1
        local d = tk.d
        local private_ok, shared_full, held = true, false, false
        for i = 1, #d.pools do
          local name = d.pools[i]
          local p = pool_spec(name)
          local u = used(name)
          if not p.shared then
            if u + d.cost > p.cap then
              private_ok = false
            end
          else
            if u + d.cost > pool_limit(p, t) then
              shared_full = true
            end
            if held_all[name] then
              held = true
            end
          end
        end
        if private_ok and not shared_full and not held then
          redis.call('LPOP', qk)
          forget(tk)
          charge(d)
          local queued = grant_ticket(tk, now, own)
          if tk.seq == own then
            mine = queued
          end
          local nxt = redis.call('LINDEX', qk, 0)
          if nxt then
            heap_push(heap, { vtc(tenant) or 0.0, tonumber(nxt), tenant })
          else
            redis.call('SREM', qtkey(tier_name), tenant)
          end
        elseif private_ok and shared_full then
          local old = now - tk.enq >= P.backfill
          for i = 1, #d.pools do
            local name = d.pools[i]
            if pool_spec(name).shared then
              held_lower[name] = true
              if old then
                held_all[name] = true
              end
            end
          end
        end
      end
      for name in pairs(held_lower) do
        held_all[name] = true
      end
      if scanned >= P.max_scan then
        break
      end
    end
  end
  return mine
end

-- budgets.retry.retry_after (tokens_ahead included)
local function retry_after(d, now)
  local t = tier_spec(d.tier)
  local upper = math.max(MIN_RETRY, t.maxwait)
  local worst = 0.0
  local waiting = nil
  for i = 1, #d.pools do
    local name = d.pools[i]
    local p = pool_spec(name)
    if p then
      local free = pool_limit(p, t) - used(name)
      if waiting == nil then
        waiting = {}
        local all = redis.call('HVALS', K.tickets)
        for j = 1, #all do
          local f = split(all[j], SEP)
          waiting[#waiting + 1] = demand(f[1], f[2], f[3], f[4], f[5])
        end
      end
      local ahead = 0
      for j = 1, #waiting do
        local w = waiting[j]
        local wt = tier_spec(w.tier)
        if wt and wt.rank <= t.rank then
          for k = 1, #w.pools do
            if w.pools[k] == name then
              ahead = ahead + w.cost
              break
            end
          end
        end
      end
      local needed = ahead + d.cost - free
      if needed > 0 then
        local rate = rate_value(redis.call('HGET', K.rate, name), now)
        if rate > 0 then
          worst = math.max(worst, needed / rate)
        else
          worst = math.huge
        end
      end
    end
  end
  return math.min(math.max(worst, MIN_RETRY), upper)
end

local function beat(replica, now)
  redis.call('ZADD', K.replicas, fmt(now + P.ttl), replica)
end
