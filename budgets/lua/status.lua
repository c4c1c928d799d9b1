-- status.lua: a waiter's poll (the fallback for a lost pub/sub message).
-- ARGV: now-override, replica, seq, lease id
-- Reply: {'W'} still waiting | {'G', granted_at, queued_s} | {'U'} unknown (store lost it)
local function main()
  if redis.call('HEXISTS', K.tickets, ARGV[3]) == 1 then
    return { 'W' }
  end
  local lease = load_lease(ARGV[4])
  if lease == nil then
    return { 'U' }
  end
  return { 'G', lease.granted_at, lease.queued_s }
end
