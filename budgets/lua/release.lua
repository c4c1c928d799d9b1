-- release.lua: return a lease's tokens and run a grant pass (MemoryStore.release).
-- ARGV: now-override, replica, lease id, actual decode ('' when unknown)
-- Reply: 1 when the lease was live, -1 when it was reaped (expired), 0 when unknown (already
-- released, never granted, or lost in a restart). The last two leave a tombstone so a racing
-- heartbeat restore cannot re-create the lease.
local function main()
  local now = clock(ARGV[1])
  local have_policy = load_policy()
  local id = ARGV[3]
  local lease = load_lease(id)
  if lease == nil or not have_policy then
    local window = have_policy and 2 * P.ttl or 60
    redis.call('ZADD', K.gone, fmt(now + window), id)
    if redis.call('ZSCORE', K.reaped, id) then
      redis.call('ZREM', K.reaped, id)
      return -1
    end
    return 0
  end
  delete_lease(id)
  local actual = nil
  if ARGV[4] ~= '' then
    actual = tonumber(ARGV[4])
  end
  give_back(lease.d, actual, now)
  grant_pass(now, nil)
  return 1
end
