-- quota_settle.lua: quota.settle. A: reservation id, then per charge the amount used ('' or
-- nothing: the amount reserved). Reply: 1 settled now, 0 not held (settled, expired or lost).
local function quota_settle_main(A)
  local record = QU.take(A[1])
  if record == nil then
    return 0
  end
  QU.settle(record, A, 2)
  return 1
end
