-- status.lua: a waiter's poll (the fallback for a lost pub/sub message).
-- A (args after now-override and replica): seq, lease id
-- Reply: {'W'} still waiting | {'G', granted_at, queued_s} | {'U'} unknown (store lost it)
local function status_main(A)
  if ticket_is(A[1], CALLER, A[2]) then
    return { 'W' }
  end
  local lease = load_lease(A[2])
  if lease == nil then
    return { 'U' }
  end
  return { 'G', lease.granted_at, lease.queued_s }
end
