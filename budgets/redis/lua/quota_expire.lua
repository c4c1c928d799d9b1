-- quota_expire.lua: quota.expire, at most A[1] reservations per call, settled at the amounts
-- reserved. Reply: {settled, more left (0/1)}.
local function quota_expire_main(A)
  local limit = A[1] + 0
  local due = rcall('ZRANGEBYSCORE', QU.exp_key(), '-inf', fmt(script_now()), 'LIMIT', 0, limit)
  for i = 1, #due do
    local record = QU.take(due[i])
    if record ~= nil then
      QU.settle(record, nil, 1)
    end
  end
  return { #due, #due == limit and 1 or 0 }
end
