-- usage_add.lua: budgets/usage_log.py's add. A: hour, keep_s, then field, delta pairs. T:usage:<hour>
-- is a hash of counts (HINCRBY: every replica's adds sum); it expires keep_s after its last add.
-- Reply: the fields added to.
local function usage_add_main(A)
  local key = T .. ':usage:' .. A[1]
  local n = 0
  for i = 3, #A, 2 do
    rcall('HINCRBY', key, A[i], A[i + 1])
    n = n + 1
  end
  rcall('EXPIRE', key, A[2])
  return n
end
