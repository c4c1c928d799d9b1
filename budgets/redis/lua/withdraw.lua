-- withdraw.lua: a waiter gives up (timeout or cancellation), or an acquire whose reply was lost
-- (Redis timed out or the connection broke after it was sent) is taken back by the recovery.
-- A (args after now-override and replica): seq ('' when the reply was lost: the ticket, if the
-- acquire queued one, is found among the caller's by lease id), lease id, release_if_granted ('1'
-- for a cancelled waiter or a lost reply)
-- Reply: {'W', retry_after} withdrawn | {'G', granted_at, queued_s} the grant won the race (kept)
--      | {'R'} the grant won the race and was released | {'U'} unknown (store lost it)
local function withdraw_main(A)
  local now = script_now()
  if not load_policy() then
    return { 'U' }
  end
  local seq = A[1]
  if seq == '' then
    seq = owned_ticket(CALLER, A[2])
  elseif not ticket_is(seq, CALLER, A[2]) then
    seq = nil -- not this lease's ticket (any more): Redis lost ours, or granted it
  end
  local tk = seq and withdraw(seq, now)
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
