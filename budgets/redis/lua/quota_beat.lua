-- quota_beat.lua: quota.heartbeat. A: ttl_s, reservation ids. Reply: how many are held.
local function quota_beat_main(A)
  local at = fmt(script_now() + A[1])
  local n = 0
  for i = 2, #A do
    if rcall('ZSCORE', QU.exp_key(), A[i]) then
      rcall('ZADD', QU.exp_key(), at, A[i])
      n = n + 1
    end
  end
  return n
end
