-- quota_usage.lua: quota.usage per window. A: key, oldest, key, oldest, ...
-- Reply: used_1, reserved_1, used_2, ...
local function quota_usage_main(A)
  local reply = {}
  for i = 1, #A, 2 do
    local cells = QU.window(T .. ':quota:' .. A[i], A[i + 1] + 0)
    local used, reserved = 0, 0
    for _, cell in pairs(cells) do
      used, reserved = used + cell[1], reserved + cell[2]
    end
    reply[#reply + 1] = fmt(used)
    reply[#reply + 1] = fmt(reserved)
  end
  return reply
end
