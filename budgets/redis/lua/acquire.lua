-- acquire.lua: validate, fast-path grant, or enqueue + grant pass (MemoryStore.acquire up to the wait).
-- A (args after now-override and replica): lease id, tenant, tier, prefill, decode, pools (LSEP-joined)
-- Reply: {'G', granted_at, queued_s} | {'Q', seq, enqueued_at, max_queue_wait_s}
--      | {'FULL', queued, max_queue_len, retry_after} | {'E', kind, name[, limit]} | {'NOLAYOUT'}
local function acquire_main(A)
  local now = script_now()
  local replica, lease_id = CALLER, A[1]
  local d = demand(A[2], A[3], A[4], A[5], A[6])
  if not load_policy(d) then
    return { 'NOLAYOUT' }
  end
  local err = check_demand(d)
  if err then
    return err
  end
  -- policy.grant_immediately: nothing waiting at all and the demand fits.
  if tickets_waiting() == 0 and fits(d) then
    lift(d.tenant, true)
    charge(d)
    store_lease(lease_id, d, replica, now, 0.0)
    return { 'G', fmt(now), '0' }
  end
  -- Enqueue and pass even when the tenant's queue is full: a demand the pass grants at once never
  -- waits, so it is not refused (MemoryStore.acquire step 3).
  beat(replica, now)
  local seq = enqueue(d, now, replica, lease_id)
  local mine = grant_pass(now, seq)
  if mine ~= nil then
    return { 'G', fmt(now), fmt(mine) }
  end
  local spec = tenant_spec(d.tenant)
  local ahead = count(K.twait, d.tenant) - 1
  if ahead >= spec.maxq then
    withdraw(seq, now)
    grant_pass(now, nil)
    return { 'FULL', ahead, spec.maxq, fmt(retry_after(d, now)) }
  end
  return { 'Q', seq, fmt(now), fmt(tier_spec(d.tier).maxwait) }
end
