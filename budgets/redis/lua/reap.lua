-- reap.lua: return expired leases' tokens (MemoryStore._reap), withdraw the waiting tickets of
-- replicas whose liveness expired, drop old tombstones; one grant pass if anything changed; then
-- forget tenants idle for idle_forget_s (policy.forget_idle), at most ``limit`` per call.
-- Reaped ids are remembered for a while (T:reaped) so a late release can tell "reaped" (False)
-- from "lost in a restart" and a late heartbeat can still re-register a request that is running.
-- A (args after now-override and the caller, alive by definition): max leases per call
-- Reply: {leases reaped, tickets withdrawn, more left (0/1: leases or idle tenants)}
local function reap_main(A)
  local now = script_now()
  if not load_policy() then
    return { 0, 0, 0 }
  end
  local me = CALLER
  beat(me, now)
  local limit = tonumber(A[1])  -- leases per call
  local expired = rcall('ZRANGEBYSCORE', K.lexp, '-inf', fmt(now), 'LIMIT', 0, limit)
  local remember = fmt(now + mmax(60, 10 * P.ttl))
  for i = 1, #expired do
    local lease = load_lease(expired[i])
    delete_lease(expired[i])
    rcall('ZADD', K.reaped, remember, expired[i])
    if lease ~= nil then
      give_back(lease.d, lease.d.decode, now) -- usage unknown: the whole reservation is charged
    end
  end
  local withdrawn = 0
  local dead = rcall('ZRANGEBYSCORE', K.replicas, '-inf', '(' .. fmt(now), 'LIMIT', 0, 64)
  for i = 1, #dead do
    local r = dead[i]
    if r ~= me then
      local seqs = rcall('SMEMBERS', rtkey(r))
      for j = 1, #seqs do
        if withdraw(seqs[j], now) ~= nil then
          withdrawn = withdrawn + 1
        end
      end
      rcall('DEL', rtkey(r))
      rcall('ZREM', K.replicas, r)
    end
  end
  rcall('ZREMRANGEBYSCORE', K.gone, '-inf', fmt(now))
  rcall('ZREMRANGEBYSCORE', K.reaped, '-inf', fmt(now))
  if #expired > 0 or withdrawn > 0 then
    grant_pass(now, nil)
  end
  local forgotten = forget_idle(now, limit)
  local more = 0
  if #expired == limit or forgotten == limit then
    more = 1
  end
  return { #expired, withdrawn, more }
end
