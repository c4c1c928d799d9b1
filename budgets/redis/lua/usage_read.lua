-- usage_read.lua: budgets/usage_log.py's read. A: hours. Reply: per hour that has counts: hour, n,
-- then n field, value pairs.
local function usage_read_main(A)
  local reply = {}
  for i = 1, #A do
    local flat = rcall('HGETALL', T .. ':usage:' .. A[i])
    if #flat > 0 then
      reply[#reply + 1] = A[i]
      reply[#reply + 1] = #flat / 2
      for j = 1, #flat do
        reply[#reply + 1] = flat[j]
      end
    end
  end
  return reply
end
