-- withdraw.lua: a waiter gives up (timeout or cancellation).
-- A (ARGV after now-override and replica): seq, lease id, release_if_granted ('1' for a cancelled waiter)
-- Reply: {'W', retry_after} withdrawn | {'G', granted_at, queued_s} the grant won the race (kept)
--      | {'R'} the grant won the race and was released | {'U'} unknown (store lost it)
local function withdraw_main(A)
  local now = script_now()
  if not load_policy() then
    return { 'U' }
  end
  local tk = withdraw(A[1], now)
  if tk ~= nil then
    -- A withdrawn ticket may have been holding pools for itself: others may now be granted.
    grant_pass(now, nil)
    return { 'W', fmt(retry_after(tk.d, now)) }
  end
  local lease = load_lease(A[2])
  if lease == nil then
    return { 'U' }
  end
  if A[3] == '1' then
    delete_lease(lease.id)
    give_back(lease.d, 0, now) -- granted as its waiter gave up: never reached it, nothing served
    grant_pass(now, nil)
    return { 'R' }
  end
  return { 'G', lease.granted_at, lease.queued_s }
end
