-- restore.lua: re-register leases that are in flight on their owner but unknown to Redis.
-- Unconditional on purpose: the requests are running on the GPU whatever Redis remembers, so the
-- pools must count them; if that overcommits a pool, new grants wait until it drains. The tenant's
-- counter is not charged again (it was charged at grant, or was lost with the restart).
-- A (args after now-override and replica): then per lease: id, tenant, tier, prefill, decode, pools, queued_s
-- Reply: number of leases re-created
local function restore_main(A)
  local now = script_now()
  if not load_policy() then
    return -1
  end
  beat(CALLER, now)
  local n = 0
  for i = 1, #A, 7 do
    local id = A[i]
    if rcall('HEXISTS', K.leases, id) == 0 and not rcall('ZSCORE', K.gone, id) then
      local d = demand(A[i + 1], A[i + 2], A[i + 3], A[i + 4], A[i + 5])
      load_policy(d)
      add_held(d, 1)
      if count_add(K.tleases, d.tenant, 1) == 1 then
        rcall('ZREM', K.idle, d.tenant)
        local c = vtc(d.tenant)
        if c ~= nil then
          rcall('ZADD', K.vl, fmt(c), d.tenant)
        end
      end
      private_pools_changed(d)
      store_lease(id, d, CALLER, now, tonumber(A[i + 6]))
      rcall('ZREM', K.reaped, id)
      n = n + 1
    end
  end
  return n
end
