-- extend.lua: grow a live lease's output reservation in every pool it holds (policy.extend).
-- Never queues: the stream that outgrew its reservation is already running. An overdrawn pool
-- grants nothing new until releases bring it back under its limit (no grant pass is needed: more
-- in flight can only block grants; heads naming a grown private pool are parked if it no longer
-- fits them). A reservation is not service: no counter moves.
-- A (args after now-override and replica): lease id, tokens
-- Reply: the overdraft (>= 0: how far the fullest pool is now above its capacity, at most tokens),
-- or -1 when the lease is not live (released, reaped, or lost in a restart).
local function extend_main(A)
  local id = A[1]
  local tokens = tonumber(A[2])
  local lease = load_lease(id)
  if lease == nil or not load_policy(lease.d) then
    return -1
  end
  local d = lease.d
  if tokens <= 0 then
    return 0
  end
  -- Each pool grows by what the grown demand holds there more than before: its tenant's own pool
  -- not at all while the reservation stays within the limit it holds already.
  local before = {}
  for i = 1, #d.pools do
    before[i] = held_in(d, d.pools[i])
  end
  grow_demand(d, tokens)
  settled = false
  prefetch_used(d.pools)
  local over = 0
  for i = 1, #d.pools do
    local more = held_in(d, d.pools[i]) - before[i]
    if more ~= 0 then
      num_add(K.used, d.pools[i], more)
      local p = pool_spec(d.pools[i])
      if p then
        over = mmax(over, mmin(more, used(d.pools[i]) - p.cap))
      end
    end
  end
  -- A grown private pool may no longer fit its tenant's waiting head: park it (policy.extend).
  private_pools_changed(d)
  rcall('HSET', K.leases, id, pack_demand(d) .. SEP .. lease.owner .. SEP .. lease.granted_at .. SEP .. lease.queued_s)
  return over
end
