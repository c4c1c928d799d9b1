-- heartbeat.lua: extend live leases (MemoryStore.heartbeat) and report the ones Redis does not
-- know (lost in a restart, or reaped after missed heartbeats) so the owner can restore them.
-- A (args after now-override and replica): lease ids...
-- Reply: {'NOLAYOUT'} | list of unknown, non-tombstoned lease ids
local function heartbeat_main(A)
  local now = script_now()
  if not load_policy() then
    return { 'NOLAYOUT' }
  end
  beat(CALLER, now)
  local expiry = fmt(now + P.ttl)
  local unknown = {}
  for i = 1, #A do
    local id = A[i]
    if rcall('ZSCORE', K.lexp, id) then
      rcall('ZADD', K.lexp, expiry, id)
    elseif not rcall('ZSCORE', K.gone, id) then
      unknown[#unknown + 1] = id
    end
  end
  return unknown
end
