-- status.lua: a waiter's poll (the fallback for a lost pub/sub message).
-- ARGV: now-override, seq, lease id
-- Reply: {'W'} still waiting | {'G', granted_at, queued_s} | {'U'} unknown (store lost it)
if redis.call('HEXISTS', K.tickets, ARGV[2]) == 1 then
  return { 'W' }
end
local lease = load_lease(ARGV[3])
if lease == nil then
  return { 'U' }
end
return { 'G', lease.granted_at, lease.queued_s }
