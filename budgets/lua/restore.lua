-- restore.lua: re-register leases that are in flight on their owner but unknown to Redis.
-- Unconditional on purpose: the requests are running on the GPU whatever Redis remembers, so the
-- pools must count them; if that overcommits a pool, new grants wait until it drains. The tenant's
-- counter is not charged again (it was charged at grant, or was lost with the restart).
-- ARGV: now-override, replica, then per lease: id, tenant, tier, prefill, decode, pools, queued_s
-- Reply: number of leases re-created
local function main()
  local now = clock(ARGV[1])
  if not load_policy() then
    return -1
  end
  beat(ARGV[2], now)
  local n = 0
  for i = 3, #ARGV, 7 do
    local id = ARGV[i]
    if redis.call('HEXISTS', K.leases, id) == 0 and not redis.call('ZSCORE', K.gone, id) then
      local d = demand(ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4], ARGV[i + 5])
      for j = 1, #d.pools do
        add_used(d.pools[j], d.cost)
      end
      redis.call('HINCRBY', K.tleases, d.tenant, 1)
      store_lease(id, d, ARGV[2], now, tonumber(ARGV[i + 6]))
      redis.call('ZREM', K.reaped, id)
      n = n + 1
    end
  end
  return n
end
