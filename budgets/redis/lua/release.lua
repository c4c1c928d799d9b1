-- release.lua: return a lease's tokens and run a grant pass (MemoryStore.release).
-- A (args after now-override and replica): lease id, reported completion tokens ('' when unknown;
-- clamped to the reserved decode, see served_output)
-- Reply: 1 when the lease was live, -1 when it was reaped (expired), 0 when unknown (already
-- released, never granted, or lost in a restart). The last two leave a tombstone so a racing
-- heartbeat restore cannot re-create the lease.
local function release_main(A)
  local now = script_now()
  local id = A[1]
  local lease = load_lease(id)
  local have_policy = load_policy(lease and lease.d)
  if lease == nil or not have_policy then
    local window = have_policy and 2 * P.ttl or 60
    rcall('ZADD', K.gone, fmt(now + window), id)
    if rcall('ZSCORE', K.reaped, id) then
      rcall('ZREM', K.reaped, id)
      return -1
    end
    return 0
  end
  delete_lease(id)
  give_back(lease.d, served_output(lease.d.decode, A[2]), now)
  grant_pass(now, nil)
  return 1
end
